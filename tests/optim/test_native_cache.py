"""The native library's cache loads nothing from a place another user can write (issue #23,
``collage/optim/native/cache.py``, ``docs/security.md``).

How the tests can fail: every "someone else's" library planted here is a byte-for-byte copy
of a good build with its good SHA-256 record, under the name the loader looks for. The only
thing between it and the load is the check under test (``test_private_cache_is_reused``
shows the same copy, planted privately, is loaded), so a missing check loads it, and the
test sees it in ``/proc/self/maps`` and in ``info()["path"]``.

Speed: the loader runs with the portable flag set only (about 1 s to compile here, the
AVX-512 one 11 s; the cache's logic does not depend on the flags), the good build is made
once per module, and a refused cache builds in the process's own directory, which later
tests reuse.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from collage.optim.native import build

pytestmark = pytest.mark.skipif(
    build._compiler() is None, reason="no C compiler: the native kernels cannot be built")

PORTABLE = build._FLAGS[-1:]


@pytest.fixture(autouse=True)
def portable_loader(monkeypatch):
    """A loader that has not tried yet and builds the portable flag set; restored after."""
    monkeypatch.setattr(build, "_FLAGS", PORTABLE)
    build._reset()
    yield
    monkeypatch.undo()
    build._reset()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    """(library, its SHA-256 record): one portable build in a private directory."""
    root = tmp_path_factory.mktemp("good")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLLAGE_CACHE_DIR", str(root))
        library, _ = build._build(build._compiler(), PORTABLE)
    return library, library.with_name(library.name + ".sha256")


def _plant(root: Path, good: tuple[Path, Path]) -> Path:
    """Copies of the good library and its record where a load with ``COLLAGE_CACHE_DIR``
    = ``root`` looks first (``root/native/``, made private); the planted library."""
    directory = root / "native"
    directory.mkdir(mode=0o700, parents=True)
    for path in good:
        shutil.copyfile(path, directory / path.name)
        os.chmod(directory / path.name, 0o600)
    return directory / good[0].name


def _load(root: Path, monkeypatch) -> tuple[dict, list[str]]:
    """build.load() with ``COLLAGE_CACHE_DIR`` = ``root``: (info, the warnings' texts)."""
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(root))
    build._reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.load() is not None, build.info()
    return build.info(), [str(w.message) for w in caught]


def _mapped(path: Path) -> bool:
    """Whether the file at ``path`` is mapped into this process (``/proc/self/maps``)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps here")
    wanted = os.path.realpath(path)
    return any(line.split()[-1] == wanted for line in maps.read_text().splitlines()
               if len(line.split()) >= 6)


def _assert_refused(planted: Path, info: dict, caught: list[str], why: str) -> None:
    """The planted library was not loaded: the library in use lies elsewhere, in a private
    directory, and one warning named the refused place and why."""
    assert not _mapped(planted)
    loaded = Path(info["path"])
    assert loaded != planted and _mapped(loaded)
    assert stat.S_IMODE(os.lstat(loaded.parent).st_mode) == 0o700
    assert os.lstat(loaded.parent).st_uid == os.getuid()
    ours = [text for text in caught if why in text]
    assert len(ours) == 1, caught
    assert str(planted.parent) in ours[0] or str(planted) in ours[0]


def test_private_cache_is_reused(tmp_path, good, monkeypatch) -> None:
    """The control: the very copy the other tests plant is loaded where it is private."""
    planted = _plant(tmp_path, good)
    info, caught = _load(tmp_path, monkeypatch)
    assert info["path"] == str(planted) and not info["compiled"] and caught == []
    assert _mapped(planted)


def _dir_writable_by_others(root: Path, planted: Path) -> str:
    planted.parent.chmod(0o777)
    return "writable by group or others"


def _dir_writable_by_group(root: Path, planted: Path) -> str:
    planted.parent.chmod(0o770)
    return "writable by group or others"


def _parent_writable_by_others(root: Path, planted: Path) -> str:
    root.chmod(0o777)  # someone else could swap root/native for a directory of theirs
    return "not sticky"


def _dir_is_a_symlink(root: Path, planted: Path) -> str:
    elsewhere = root / "elsewhere"
    planted.parent.rename(elsewhere)  # a private directory, holding the good copy
    planted.parent.symlink_to(elsewhere)
    return "symbolic link"


DIRECTORIES = {"dir 0o777": _dir_writable_by_others, "dir 0o770": _dir_writable_by_group,
               "parent 0o777": _parent_writable_by_others, "symlink": _dir_is_a_symlink}


@pytest.mark.parametrize("change", DIRECTORIES, ids=str)
def test_directory_another_user_can_write_is_not_loaded_from(tmp_path, good, monkeypatch,
                                                             change: str) -> None:
    planted = _plant(tmp_path, good)
    why = DIRECTORIES[change](tmp_path, planted)
    info, caught = _load(tmp_path, monkeypatch)
    _assert_refused(planted, info, caught, why)


def _file_writable_by_others(planted: Path) -> str:
    planted.chmod(0o606)
    return "writable by group or others"


def _file_writable_by_group(planted: Path) -> str:
    planted.chmod(0o660)
    return "writable by group or others"


def _record_writable_by_others(planted: Path) -> str:
    planted.with_name(planted.name + ".sha256").chmod(0o666)
    return "writable by group or others"


def _file_owned_by_another_user(planted: Path) -> str:
    if os.getuid() != 0:
        pytest.skip("only root can give a file to another user")
    os.chown(planted, 65534, -1)
    return "owned by uid 65534"


FILES = {"file 0o606": _file_writable_by_others, "file 0o660": _file_writable_by_group,
         "record 0o666": _record_writable_by_others, "other owner": _file_owned_by_another_user}


@pytest.mark.parametrize("change", FILES, ids=str)
def test_file_another_user_can_write_is_not_loaded(tmp_path, good, monkeypatch,
                                                   change: str) -> None:
    planted = _plant(tmp_path, good)
    why = FILES[change](planted)
    info, caught = _load(tmp_path, monkeypatch)
    _assert_refused(planted, info, caught, why)


def test_library_changed_after_its_build_is_rebuilt_not_loaded(tmp_path, good,
                                                               monkeypatch) -> None:
    """One byte appended (the library still loads: only the digest tells) is a rebuild in
    place with one warning; the rebuilt file has the recorded digest."""
    planted = _plant(tmp_path, good)
    with open(planted, "ab") as handle:
        handle.write(b"\0")
    changed = planted.read_bytes()
    info, caught = _load(tmp_path, monkeypatch)
    assert info["compiled"] and info["path"] == str(planted)
    assert planted.read_bytes() != changed
    record = planted.with_name(planted.name + ".sha256").read_text().strip()
    assert hashlib.sha256(planted.read_bytes()).hexdigest() == record
    assert len([text for text in caught if "rebuilding" in text and str(planted) in text]) == 1


def test_library_without_a_record_is_rebuilt_silently(tmp_path, good, monkeypatch) -> None:
    """A library from a version before records: rebuilt, no warning."""
    planted = _plant(tmp_path, good)
    planted.with_name(planted.name + ".sha256").unlink()
    info, caught = _load(tmp_path, monkeypatch)
    assert info["compiled"] and info["path"] == str(planted) and caught == []


def test_normal_path_is_private_and_reused_by_a_fresh_process(tmp_path, monkeypatch) -> None:
    """An empty cache under umask 0: the directories are made 0700 and the files 0600
    anyway, no temporary file is left, and this process (its loader reset) and a fresh
    one load the library without compiling or warning."""
    root = tmp_path / "cache" / "home"
    old_umask = os.umask(0)
    try:
        info, caught = _load(root, monkeypatch)
    finally:
        os.umask(old_umask)
    library = Path(info["path"])
    assert info["compiled"] and caught == [] and library.parent == root / "native"
    for directory in (root.parent, root, root / "native"):
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700, directory
    # the library and its record, no temporary left behind
    assert sorted(path.name for path in library.parent.iterdir()) == sorted(
        [library.name, library.name + ".sha256"])
    for path in library.parent.iterdir():
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path
    again, caught = _load(root, monkeypatch)  # this process, the loader reset: no compile
    assert again["path"] == str(library) and again["compiled"] is False and caught == []
    code = ("import json; from collage.optim.native import build; "
            f"build._FLAGS = {PORTABLE!r}; print(json.dumps(build.info()))")
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code],
                          env={**os.environ, "COLLAGE_CACHE_DIR": str(root)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second["path"] == str(library) and second["compiled"] is False


@pytest.fixture
def fake_tmp(tmp_path, monkeypatch) -> Path:
    """A temporary directory like /tmp (ours, world-writable, sticky) for tempfile, and a
    cache directory that cannot be created (read-only home): the loader falls back to
    ``<fake tmp>/collage-native-<uid>``."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    (tmp_path / "a-file").write_text("")
    return tmp


def _unwritable_home(fake_tmp: Path) -> Path:
    return fake_tmp.parent / "a-file" / "home"


def test_predictable_tmp_directory_is_made_private(fake_tmp, monkeypatch) -> None:
    info, caught = _load(_unwritable_home(fake_tmp), monkeypatch)
    predictable = fake_tmp / f"collage-native-{os.getuid()}"
    assert Path(info["path"]).parent == predictable and caught == []
    assert stat.S_IMODE(os.lstat(predictable).st_mode) == 0o700


def _pre_created_symlink(predictable: Path, good) -> Path:
    private = predictable.parent.parent / "theirs"
    planted = _plant(private, good)
    predictable.symlink_to(planted.parent)
    return predictable / planted.name


def _pre_created_open_dir(predictable: Path, good) -> Path:
    planted = _plant(predictable.parent, good)
    planted.parent.rename(predictable)
    predictable.chmod(0o777)
    return predictable / planted.name


@pytest.mark.parametrize("pre_create", [_pre_created_symlink, _pre_created_open_dir],
                         ids=["symlink", "dir 0o777"])
def test_predictable_tmp_directory_made_by_someone_else_is_not_used(fake_tmp, good,
                                                                    monkeypatch,
                                                                    pre_create) -> None:
    """``<tmp>/collage-native-<uid>`` made before us (a symbolic link, or an open
    directory), holding a good copy: not followed, not loaded from."""
    predictable = fake_tmp / f"collage-native-{os.getuid()}"
    planted = pre_create(predictable, good)
    info, caught = _load(_unwritable_home(fake_tmp), monkeypatch)
    assert Path(info["path"]).parent != predictable
    _assert_refused(planted, info, caught, str(predictable))
