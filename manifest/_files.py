"""Reading model files safely: open beneath the model directory without following links, and hand out
only bytes that were hashed and matched the manifest (no second read, no shared mmap after the check).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from shardtool.errors import DigestMismatchError, StorageError, VerificationError
from shardtool.manifest._records import Entry

if TYPE_CHECKING:
    import numpy as np

CHUNK = 4 * 1024 * 1024  # audit streaming buffer
READ_CHUNK = 1024 * 1024  # verified reads: hash each MiB while it is still in cache
PARALLEL_HASH_MIN = 4 * 1024 * 1024  # below this, BLAKE3's own threads cost more than they save


class NotARegularFileError(VerificationError):
    """Where the manifest lists a file there is a symlink, directory, FIFO, socket or device."""

    def __init__(self, message: str, *, path: str | None = None, finding: str = "not-a-regular-file"):
        self.finding = finding
        super().__init__(message, path=path)


class MissingFileError(VerificationError):
    """A file the manifest lists is not there."""


def open_dir_beneath(root: Path, reldir: str) -> int:
    """Open directory `root/reldir` ("" for root itself), refusing a symlink at any component below root."""
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise StorageError(f"cannot open model directory: {e.strerror}", path=str(root)) from e
    for part in reldir.split("/") if reldir else ():
        try:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            # O_DIRECTORY|O_NOFOLLOW on a symlink fails with ENOTDIR, not ELOOP: name the link for what it is.
            if e.errno == errno.ENOTDIR and _is_symlink_at(dir_fd, part):
                e = OSError(errno.ELOOP, os.strerror(errno.ELOOP))
            os.close(dir_fd)
            _raise_open_error(e, reldir, component=part)
        os.close(dir_fd)
        dir_fd = nxt
    return dir_fd


def _is_symlink_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def open_file_at(dir_fd: int, name: str, relpath: str) -> int:
    """Open regular file `name` in `dir_fd` without following a link; `relpath` is for messages."""
    try:
        # O_NONBLOCK: opening a FIFO planted where a shard should be must not hang us.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        _raise_open_error(e, relpath)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotARegularFileError(f"is a {_describe_mode(st.st_mode)}, expected a regular file", path=relpath)
    return fd  # O_NONBLOCK has no effect on reads of a regular file: no need to clear it


def open_beneath(root: Path, relpath: str) -> int:
    """Open `root/relpath` read-only, refusing a symlink at any component, and return a file descriptor
    of a regular file. `relpath` must already be a checked manifest path (no `..`, not absolute)."""
    reldir, _, name = relpath.rpartition("/")
    try:
        dir_fd = open_dir_beneath(root, reldir)
    except (MissingFileError, NotARegularFileError) as e:
        e.path = relpath
        e.args = (e.one_line(),)
        raise
    try:
        return open_file_at(dir_fd, name, relpath)
    finally:
        os.close(dir_fd)


def _describe_mode(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"


def _raise_open_error(e: OSError, relpath: str, component: str | None = None) -> None:
    where = f" (at {component!r})" if component else ""
    if e.errno == errno.ENOENT:
        raise MissingFileError(f"file is missing{where}", path=relpath) from None
    if e.errno == errno.ELOOP:
        raise NotARegularFileError(f"is a symlink{where}; links are not followed", path=relpath,
                                   finding="symlink") from None
    if e.errno == errno.ENOTDIR:
        raise NotARegularFileError(f"a path component is not a directory{where}", path=relpath) from None
    raise StorageError(f"cannot open: {e.strerror}{where}", path=relpath) from e


def digest_bytes(data: bytes | memoryview) -> bytes:
    threads = blake3.blake3.AUTO if len(data) >= PARALLEL_HASH_MIN else 1
    return blake3.blake3(data, max_threads=threads).digest()


@dataclass(frozen=True)
class VerifiedBytes:
    """Verified bytes of one shard (private, read-only) and where the reading thread spent its time:
    wall seconds (include waiting for a core) and CPU seconds (the work itself)."""

    data: np.ndarray  # uint8 [entry.size]
    read_seconds: float
    hash_seconds: float
    read_cpu_seconds: float = 0.0
    hash_cpu_seconds: float = 0.0


def read_verified_timed(root: Path, entry: Entry) -> VerifiedBytes:
    """Read `entry` into private memory, hashing each chunk as it arrives; return it only if its size and
    BLAKE3 digest are the manifest's. The bytes returned are exactly the bytes hashed: no mmap, no re-read.

    One pass: each chunk is hashed right after it lands in the private buffer, on the calling thread
    only (max_threads=1): the runtime's reader pool already loads several shards at once, and BLAKE3's
    own threads on top would oversubscribe the cores that compute.
    """
    import numpy as np  # here, not at module level: audits never need it, and it costs ~40 ms to import

    read_s = hash_s = read_cpu = hash_cpu = 0.0
    t, c = time.perf_counter(), time.thread_time()
    fd = open_beneath(Path(root), entry.path)
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            raise DigestMismatchError(f"size is {size} bytes, manifest says {entry.size}", path=entry.path,
                                      expected=str(entry.size), actual=str(size))
        data = np.empty(entry.size, np.uint8)  # not zero-filled: every byte is overwritten by the read
        view = memoryview(data)
        hasher = blake3.blake3()
        done = 0
        while done < entry.size:
            n = os.readv(fd, [view[done:done + READ_CHUNK]])
            if n == 0:
                break
            t1, c1 = time.perf_counter(), time.thread_time()
            read_s, read_cpu = read_s + t1 - t, read_cpu + c1 - c
            hasher.update(view[done:done + n])
            t, c = time.perf_counter(), time.thread_time()
            hash_s, hash_cpu = hash_s + t - t1, hash_cpu + c - c1
            done += n
        extra = len(os.read(fd, 1)) if done == entry.size else 0
        read_s, read_cpu = read_s + time.perf_counter() - t, read_cpu + time.thread_time() - c
    except OSError as e:
        raise StorageError(f"read failed: {e.strerror}", path=entry.path) from e
    finally:
        os.close(fd)
    if done != entry.size or extra:
        actual = f"{done}{'+' if extra else ''}"
        raise DigestMismatchError(f"size changed while reading: expected {entry.size} bytes, read {actual}",
                                  path=entry.path, expected=str(entry.size), actual=actual)
    digest = hasher.digest()
    if digest != entry.digest:
        raise DigestMismatchError(f"BLAKE3 is {digest.hex()}, manifest says {entry.digest.hex()}", path=entry.path,
                                  expected=entry.digest.hex(), actual=digest.hex())
    data.flags.writeable = False
    return VerifiedBytes(data, read_s, hash_s, read_cpu, hash_cpu)


def read_verified(root: Path, entry: Entry) -> "np.ndarray":
    """The whole file `entry.path` as a private, read-only uint8 array, returned only if its size and
    BLAKE3 match `entry`. Callers parse and use exactly these bytes, never a fresh read."""
    return read_verified_timed(root, entry).data


@dataclass(frozen=True)
class FileDigest:
    size: int
    digest: bytes
    changed: bool  # size or mtime moved while hashing: the digest describes no single version of the file



def digest_fd(fd: int, buffer: bytearray | None = None, *, parallel: bool = True) -> FileDigest:
    """Hash an open file, for audits, where the bytes are not used afterwards.

    Small files: one read. Large files: streamed through a reusable buffer into BLAKE3, with its own
    threads when `parallel` (callers hashing many files at once give each file one core instead).
    No mmap: a file truncated while mapped raises SIGBUS, and an audit must survive files that change
    under it.
    """
    before = os.fstat(fd)
    if before.st_size < CHUNK:
        data = os.read(fd, before.st_size + 1)
        return FileDigest(len(data), digest_bytes(data), changed=len(data) != before.st_size)
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if parallel else 1)
    buf = buffer if buffer is not None else bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    while True:
        n = os.readv(fd, [view])
        if n == 0:
            break
        hasher.update(view[:n])
        total += n
    after = os.fstat(fd)
    changed = (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or total != after.st_size
    return FileDigest(total, hasher.digest(), changed)


def verify_file(path: Path, entry: Entry) -> FileDigest:
    """Check a file outside any model directory (e.g. a shard received from a peer) against a signed
    entry: a regular file whose size and BLAKE3 are the entry's. Raises; returns the digest on success."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not hang us
    except FileNotFoundError:
        raise MissingFileError("shard file not found", path=str(path)) from None
    except OSError as e:
        raise StorageError(f"cannot open shard: {e.strerror}", path=str(path)) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(f"is a {_describe_mode(mode)}, expected a regular file", path=str(path))
        result = digest_fd(fd)
    except OSError as e:
        raise StorageError(f"read failed: {e.strerror}", path=str(path)) from e
    finally:
        os.close(fd)
    if result.changed:
        raise VerificationError("file changed while it was being hashed", path=str(path))
    if result.size != entry.size:
        raise DigestMismatchError(f"size is {result.size} bytes, the signed entry {entry.path} says {entry.size}",
                                  path=str(path), expected=str(entry.size), actual=str(result.size))
    if result.digest != entry.digest:
        raise DigestMismatchError(f"BLAKE3 is {result.digest.hex()}, the signed entry {entry.path} says "
                                  f"{entry.digest.hex()}", path=str(path), expected=entry.digest.hex(),
                                  actual=result.digest.hex())
    return result
