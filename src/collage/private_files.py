"""Files only we can have written: the checks and the writing that every cache of collage
shares (the native library, ``optim/native/cache.py``; the BPE token ids,
``train/bpe.py``; ``docs/security.md``).

A cached file is trusted only if it is a regular file that we own and that neither group nor
others can write, in a directory that is ours alike, with every directory above it ours or
root's and not writable by group or others unless sticky; and if its bytes still have the
SHA-256 recorded beside it (``<file>.sha256``) when it was written. New files are written
under temporary names with mode 0600 and renamed, the record before the file, so a reader
that sees a file sees its record. A leaf module: the standard library only.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import warnings
from pathlib import Path

__all__ = ["warn_once", "forget_warnings", "cache_root", "not_ours", "not_private_dir",
           "make_private_dir", "private_dir_problem", "record_of", "not_private_file", "sha256", "new_file",
           "install"]

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_warned: set[str] = set()


def forget_warnings() -> None:
    """Forget the warnings given (tests: a new environment)."""
    _warned.clear()


def warn_once(message: str) -> None:
    """One ``RuntimeWarning`` per distinct message in a process."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"collage: {message}", RuntimeWarning, stacklevel=3)


def cache_root() -> Path:
    """Where collage caches: ``$COLLAGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/collage``
    (default ``~/.cache/collage``)."""
    root = os.environ.get("COLLAGE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "collage"


def not_ours(path: Path | str, info: os.stat_result) -> str | None:
    """Why a file or directory with status ``info`` may hold another user's writing."""
    uid = os.getuid()
    if info.st_uid != uid:
        return f"{path} is owned by uid {info.st_uid}, not by you (uid {uid})"
    if info.st_mode & _WRITABLE_BY_OTHERS:
        mode = oct(stat.S_IMODE(info.st_mode))
        return f"{path} is writable by group or others (mode {mode})"
    return None


def not_private_dir(path: Path) -> str | None:
    """Why another user could change what directory ``path`` holds (a link, not ours,
    writable by others, or a directory above it is), or None."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    reason = not_ours(path, info)
    if reason is not None:
        return reason
    for parent in Path(os.path.realpath(path)).parents:
        above = os.lstat(parent)
        if above.st_uid not in (os.getuid(), 0):
            return f"{parent}, above {path}, is owned by uid {above.st_uid}"
        if above.st_mode & _WRITABLE_BY_OTHERS and not above.st_mode & stat.S_ISVTX:
            return f"{parent}, above {path}, is writable by group or others and not sticky"
    return None


def make_private_dir(path: Path) -> str | None:
    """Create ``path`` and its missing parents with mode 0700; why it is not private
    afterwards (an existing directory or link is checked, never trusted), or None."""
    missing, existing = [], path
    while not os.path.lexists(existing):
        missing.append(existing)
        existing = existing.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made meanwhile: checked below like any other
            pass
    return not_private_dir(path)


def private_dir_problem(path: Path) -> str | None:
    """:func:`make_private_dir`, with a directory that cannot be created as the reason."""
    try:
        return make_private_dir(path)
    except OSError as error:
        return f"{path} cannot be created ({error.strerror})"


def record_of(path: Path) -> Path:
    """Where ``path``'s SHA-256 is recorded."""
    return path.with_name(path.name + ".sha256")


def not_private_file(path: Path) -> str | None:
    """Why ``path`` may hold another user's writing (it must be a regular file, not a link,
    that we own and that neither group nor others can write), or None; None also when it
    does not exist."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    return not_ours(path, info)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_file(directory: Path, prefix: str) -> Path:
    """An empty file of ours in ``directory`` under a temporary name (``.<prefix>...``),
    mode 0600."""
    fd, name = tempfile.mkstemp(prefix="." + prefix, dir=directory)
    os.close(fd)
    return Path(name)


def install(written: Path, target: Path, prefix: str) -> None:
    """Rename ``written`` (a :func:`new_file`) to ``target`` with mode 0600, having
    recorded its SHA-256 beside ``target`` first."""
    os.chmod(written, 0o600)  # a linker makes its output anew, with the umask's mode
    record = new_file(target.parent, prefix)
    try:
        record.write_text(sha256(written) + "\n")
        os.replace(record, record_of(target))
    finally:
        if record.exists():
            record.unlink()
    os.replace(written, target)
