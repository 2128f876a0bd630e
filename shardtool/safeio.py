"""The one safe-open: how every command opens a file it reads.

* Non-blocking open (`O_NONBLOCK`): a FIFO planted where a file belongs cannot hang us in open().
* Regular files only: `fstat` on the open descriptor decides, so what we read is what we checked.
* Beneath a directory: each component opened relative to its parent's descriptor with `O_NOFOLLOW`, so a
  symlink anywhere below the root (file or directory) is refused, and no path is ever longer than one name.
* Size from `fstat` before a byte is read: callers compare it with what they expect (a signed size, a cap).

Errors say what was found, by class (`shardtool.errors`): missing, not a regular file (with what it is),
unreadable. Everything an attacker who can write the directory could arrange is a VerificationError
(exit 1); only trouble on our side (out of descriptors, memory, I/O errors) is a StorageError (exit 3).
A command for which the file is its operator's own input (a key, a passphrase) maps these to usage errors.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from shardtool.errors import (MissingFileError, NotARegularFileError, ShardtoolError, StorageError,
                              UnreadableFileError)

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# Errors that the content of the tree explains (its owner can arrange each): a finding, not our I/O trouble.
# EAGAIN/EWOULDBLOCK: a non-blocking open of a file someone holds a lease on (fcntl F_SETLEASE).
_TREE_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.EOVERFLOW, errno.EFBIG, errno.EAGAIN,
                errno.EWOULDBLOCK}
# Errors open() gives for something that is not a regular file (a socket: ENXIO; some devices: ENODEV).
_SPECIAL_ERRNOS = {errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP, errno.EISDIR, errno.ETXTBSY}


def describe_mode(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"


def _lstat_mode(name: str | os.PathLike, dir_fd: int | None) -> int | None:
    try:
        return os.lstat(name, dir_fd=dir_fd).st_mode
    except OSError:
        return None


def open_error(e: OSError, where: str, *, name: str | os.PathLike | None = None, dir_fd: int | None = None,
               component: str | None = None) -> ShardtoolError:
    """The error to raise for a failed open of `name` (in `dir_fd`), reported as `where`."""
    at = f" (at {component!r})" if component else ""
    if e.errno == errno.ENOENT:
        return MissingFileError(f"file is missing{at}", path=where)
    mode = _lstat_mode(name, dir_fd) if name is not None else None
    if e.errno == errno.ELOOP or (mode is not None and stat.S_ISLNK(mode)):
        return NotARegularFileError(f"is a symlink{at}; links are not followed", path=where, finding="symlink",
                                    found="symlink")
    if e.errno == errno.ENOTDIR:
        return NotARegularFileError(f"a path component is not a directory{at}", path=where)
    if e.errno in _SPECIAL_ERRNOS or (mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)):
        what = describe_mode(mode) if mode is not None else "special file"
        return NotARegularFileError(f"is a {what}{at}, expected a regular file", path=where, found=what)
    if e.errno in _TREE_ERRNOS:
        return UnreadableFileError(f"cannot open: {e.strerror}{at}", path=where)
    return StorageError(f"cannot open: {e.strerror}{at}", path=where)


def _check_regular(fd: int, where: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        what = describe_mode(st.st_mode)
        raise NotARegularFileError(f"is a {what}, expected a regular file", path=where, found=what)
    return st  # O_NONBLOCK has no effect on reads of a regular file: no need to clear it


def open_dir_beneath(root: Path | str, reldir: str) -> int:
    """Descriptor of directory `root/reldir` ("" for root itself), refusing a symlink at any component
    below root. `root` itself is the operator's choice and may be reached through a link."""
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise StorageError(f"cannot open model directory: {e.strerror}", path=str(root)) from e
    for part in reldir.split("/") if reldir else ():
        try:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as e:
            err = open_error(e, reldir, name=part, dir_fd=dir_fd, component=part)
            os.close(dir_fd)
            raise err from None
        os.close(dir_fd)
        dir_fd = nxt
    return dir_fd


def _open_checked(name: str | os.PathLike, where: str, *, dir_fd: int | None = None, follow_link: bool) -> int:
    """The one open of a regular file: its type is checked before the open (`stat`, following a link at
    `name` only when `follow_link`), so a device node is never opened (opening one can have side effects);
    then it is opened non-blocking and must be that same regular file."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=follow_link)
    except OSError as e:
        raise open_error(e, where, name=name, dir_fd=dir_fd) from None
    if not stat.S_ISREG(before.st_mode):
        what = describe_mode(before.st_mode)
        if stat.S_ISLNK(before.st_mode):
            raise NotARegularFileError(f"is a {what}; links are not followed", path=where, finding="symlink",
                                       found=what)
        raise NotARegularFileError(f"is a {what}, expected a regular file", path=where, found=what)
    flags = _READ_FLAGS | os.O_NOCTTY | (0 if follow_link else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        raise open_error(e, where, name=name, dir_fd=dir_fd) from None
    st = _check_regular(fd, where)
    if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise UnreadableFileError("was replaced while it was opened", path=where)
    return fd


def open_file_at(dir_fd: int, name: str, relpath: str) -> int:
    """Descriptor of regular file `name` in directory `dir_fd`, never through a link; `relpath` names it
    in messages."""
    return _open_checked(name, relpath, dir_fd=dir_fd, follow_link=False)


def open_beneath(root: Path | str, relpath: str) -> int:
    """Descriptor of regular file `root/relpath`, no link at any component. `relpath` must be a checked
    manifest path ('/'-separated, no `..`, not absolute)."""
    reldir, _, name = relpath.rpartition("/")
    try:
        dir_fd = open_dir_beneath(root, reldir)
    except (MissingFileError, NotARegularFileError, UnreadableFileError) as e:
        e.path = relpath
        e.args = (e.one_line(),)
        raise
    try:
        return open_file_at(dir_fd, name, relpath)
    finally:
        os.close(dir_fd)


def open_regular(path: Path | str, *, follow_link: bool = True) -> int:
    """Descriptor of the regular file at a path the operator named (`--proof`, `--trust`, a shard received
    from a peer). A link at the path is followed (the operator chose it) unless `follow_link` is False:
    then the last component is opened like a file beneath its directory (a manifest, which sits in the
    model directory that others may write)."""
    if not follow_link:
        parent, name = os.path.split(os.fspath(path))
        try:
            dir_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise open_error(e, str(path), name=parent or ".") from None
        try:
            return open_file_at(dir_fd, name, str(path))
        finally:
            os.close(dir_fd)
    return _open_checked(path, str(path), follow_link=True)


def read_regular(path: Path | str, cap: int, *, what: str, too_large: type[ShardtoolError],
                 check: Callable[[os.stat_result], None] | None = None, follow_link: bool = True) -> bytes:
    """The whole of a small regular file (a manifest, proof, key, config), refused by its `fstat` size
    before a byte is read when over `cap`, and read at most `cap + 1` bytes in any case (it may grow).
    `check(st)`: a further rule on the opened file's own `fstat` (a secret's permissions), so there is no
    gap between the check and the read."""
    fd = open_regular(path, follow_link=follow_link)
    try:
        st = os.fstat(fd)
        if check is not None:
            check(st)
        size = st.st_size
        if size > cap:
            raise too_large(f"{what} is larger than {cap} bytes ({size} bytes; refused before reading)",
                            path=str(path))
        chunks, total = [], 0
        while total <= cap:
            chunk = os.read(fd, cap + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise StorageError(f"cannot read {what}: {e.strerror}", path=str(path)) from e
    finally:
        os.close(fd)
    if total > cap:
        raise too_large(f"{what} is larger than {cap} bytes (it grew while it was read)", path=str(path))
    return b"".join(chunks)
