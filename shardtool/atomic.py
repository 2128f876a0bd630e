"""Atomic file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader (or a crash) sees either the old file or the complete new one, never a prefix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import BinaryIO, Iterator

from shardtool.errors import StorageError


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path | str, mode: int = 0o644, *, overwrite: bool = True,
                  fsync: bool = True) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it replaces `path` atomically, on error it vanishes.

    With overwrite=False an existing `path` is never replaced (the final step is link(), which
    fails if the name exists, instead of rename()). With fsync=False the caller takes over durability
    (split flushes the whole filesystem once, before the manifest that vouches for its shards).
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        import tempfile  # here: it loads random and hashlib (10 ms), and most runs write nothing

        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise StorageError(f"cannot create a temporary file: {e.strerror}", path=str(directory)) from e
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise StorageError("refusing to overwrite an existing file", path=str(path),
                                   hint="pass --force to replace it") from None
            tmp.unlink()
        if fsync:
            _fsync_dir(directory)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        reason = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise StorageError(f"write failed: {reason}", path=str(path)) from e
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: Path | str, data: bytes, mode: int = 0o644, *, overwrite: bool = True) -> None:
    with atomic_writer(path, mode, overwrite=overwrite) as fh:
        fh.write(data)


@contextlib.contextmanager
def locked_directory(directory: Path | str) -> Iterator[None]:
    """Hold an exclusive flock on `directory` itself: serialises read-modify-write cycles of a file in it
    (two publishers signing at once) without leaving a lock file behind for audit to report."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise StorageError(f"cannot open directory: {e.strerror}", path=str(directory)) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def atomic_writer_at(dir_fd: int, name: str, mode: int = 0o644, *, fsync: bool = True,
                     where: str | None = None) -> Iterator[BinaryIO]:
    """`atomic_writer` for the entry `name` of an open directory: the temp file is created there with
    O_EXCL|O_NOFOLLOW and renamed over `name` (replacing a link of that name, never writing through it), so
    a directory swapped for a link after it was opened cannot redirect the write. `where` names the file in
    messages."""
    where = where or name
    tmp = f".{name[:64]}.{os.urandom(6).hex()}.tmp"  # short enough beside a name of up to 255 bytes
    try:
        # O_RDWR: split hashes what landed in the file by mapping it back (`_copy.HashingFileWriter`).
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        raise StorageError(f"cannot create a temporary file: {e.strerror}", path=where) from e
    try:
        os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if fsync:
            os.fsync(dir_fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        reason = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise StorageError(f"write failed: {reason}", path=where) from e
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def sync_filesystem(directory: Path | int, where: str | None = None) -> None:
    """Flush every dirty page of the filesystem holding `directory` (a path, or a descriptor of an open directory
    that `where` names in messages) with syncfs(2); os.sync() where unavailable."""
    import ctypes
    import ctypes.util

    if isinstance(directory, int):
        fd, owned = directory, False
    else:
        try:
            fd, owned = os.open(directory, os.O_RDONLY | os.O_DIRECTORY), True
        except OSError as e:
            raise StorageError(f"cannot open directory: {e.strerror}", path=str(directory)) from e
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        syncfs = getattr(libc, "syncfs", None)
        if syncfs is None:
            os.sync()
        elif syncfs(fd) != 0:
            err = ctypes.get_errno()
            reason = "disk full" if err == errno.ENOSPC else os.strerror(err)
            raise StorageError(f"flushing to disk failed: {reason}", path=where or str(directory))
    finally:
        if owned:
            os.close(fd)
