"""Where the native library is built and cached, and whether a cached file may be loaded.

The rule (``docs/security.md``): load no native code from a place another user can write.
A library in a directory someone else can write, or a file someone else can write, could be
their code, and loading it runs that code as us.

* **Directories.** We build in and load from a directory only if it is a real directory
  (not a symbolic link) that we own and that neither group nor others can write, and every
  directory above it is owned by us or root and not writable by group or others unless
  sticky (as ``/tmp``, where only an entry's owner can rename it): otherwise another user
  could swap the directory for one of theirs between our check and the load. Directories
  we create get mode 0700 (the missing parents too), checked with ``os.lstat`` afterwards,
  so a directory or symbolic link pre-created by someone else at a predictable path
  (``/tmp/collage-native-<uid>``) is never used. Where the predictable directory fails the
  check, one warning names it and why, and the process builds in a fresh
  ``tempfile.mkdtemp()`` directory of its own (removed at exit).
* **Files.** A cached library, and the record of its SHA-256 beside it
  (``<library>.sha256``), must be regular files that we own and that neither group nor
  others can write (group too: whoever can rewrite the library can rewrite its record).
  Otherwise one warning, and the library is built in the process's own directory.
* **Digests.** Each library we build is recorded with its SHA-256, and a cached library is
  loaded only if its bytes still have that digest: a mismatch is a rebuild, with one
  warning, never a load (no record, as from a version before records: a silent rebuild).
  New files are written under temporary names with mode 0600 and renamed, the record
  before the library, so a reader that sees a library sees its record.

Between the check and the load only we or root can change the file: no one else can write
the directory or any directory above it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from ... import private_files
from ...private_files import (cache_root, forget_warnings, make_private_dir, not_private_dir,
                              not_private_file, private_dir_problem, record_of, sha256,
                              warn_once)

__all__ = ["build_dir", "trusted_target", "unchanged", "new_file", "install", "reset",
           "PREFIX"]

#: the prefix of the library's files (the cache key follows); temporaries start with "."
PREFIX = "native_adamw-"
_own_dir: Path | None = None  # this process's mkdtemp directory, once one was needed


def reset() -> None:
    """Forget the warnings given (tests: a new environment). The process's own directory,
    once made, stays its own until exit."""
    forget_warnings()


# ---------------------------------------------------------------------------------------
# directories
# ---------------------------------------------------------------------------------------


def _configured_dir() -> Path:
    return cache_root() / "native"


def _own_temporary_dir() -> Path:
    """This process's own directory: a fresh ``tempfile.mkdtemp()`` (mode 0700, a name no
    one can predict), checked like any other, removed at exit (a loaded library stays
    mapped)."""
    global _own_dir
    if _own_dir is None or not _own_dir.is_dir():
        path = Path(tempfile.mkdtemp(prefix="collage-native-"))
        reason = not_private_dir(path)
        if reason is not None:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"no private directory to build native code in: {reason}")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _own_dir = path
    return _own_dir


def build_dir() -> Path:
    """The directory to build in and load from: ``$COLLAGE_CACHE_DIR/native/`` (default
    ``~/.cache/collage/native/``, ``$XDG_CACHE_HOME`` honoured; where it cannot be created,
    ``<tmp>/collage-native-<uid>/``) if it is private, else the process's own directory,
    with one warning naming the refused one and why."""
    path = _configured_dir()
    try:
        reason = make_private_dir(path)
    except OSError:  # read-only home: a per-user directory under the temporary one
        path = Path(tempfile.gettempdir()) / f"collage-native-{os.getuid()}"
        reason = private_dir_problem(path)
    if reason is None:
        return path
    warn_once(f"not building or loading native code in {path}: {reason}; building in a "
               "private temporary directory instead (to cache builds again, fix that, e.g. "
               "chmod 700, or set COLLAGE_CACHE_DIR to a private directory)")
    return _own_temporary_dir()


# ---------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------


def trusted_target(target: Path) -> Path:
    """``target``, or the same name in the process's own directory where the library at
    ``target`` or its record may hold another user's writing (one warning; the file is
    left alone)."""
    for path in (target, record_of(target)):
        reason = not_private_file(path)
        if reason is not None:
            warn_once(f"not loading native code from {target}: {reason}; building in a "
                       "private temporary directory instead (remove the file to cache the "
                       "build again)")
            return _own_temporary_dir() / target.name
    return target


def unchanged(target: Path) -> bool:
    """Whether the library ``target`` exists with the SHA-256 recorded when it was built.
    Otherwise it is to be rebuilt: silently where there is no record (a build of a version
    before records, or interrupted), with one warning where the bytes changed."""
    try:
        recorded = record_of(target).read_text().strip()
    except FileNotFoundError:
        return False
    if not target.exists():
        return False
    actual = sha256(target)
    if actual == recorded:
        return True
    warn_once(f"rebuilding the native library {target}: its SHA-256 {actual[:12]}... is "
               f"not the {recorded[:12]}... recorded when it was built")
    return False


def new_file(directory: Path) -> Path:
    """An empty file of ours in ``directory`` under a temporary name, mode 0600."""
    return private_files.new_file(directory, PREFIX)


def install(built: Path, target: Path) -> None:
    """Rename the library ``built`` (a :func:`new_file`) to ``target`` with mode 0600,
    having recorded its SHA-256 beside ``target`` first."""
    private_files.install(built, target, PREFIX)
