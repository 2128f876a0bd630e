"""Reading model files safely: open beneath the model directory without following links, and hand out
only bytes that were hashed and matched the manifest (no second read, no shared mmap after the check).
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import blake3

from shardtool.safeio import open_beneath, open_regular
from shardtool.errors import DigestMismatchError, StorageError
from shardtool.manifest._records import Entry

if TYPE_CHECKING:
    import numpy as np

CHUNK = 4 * 1024 * 1024  # audit streaming buffer
READ_CHUNK = 1024 * 1024  # verified reads: hash each MiB while it is still in cache
PARALLEL_HASH_MIN = 4 * 1024 * 1024  # below this, BLAKE3's own threads cost more than they save
MAP_MIN = 256 * 1024  # audit workers map files from this size on (below it one read costs less than a mapping)
HUGE_PAGE = 2 * 1024 * 1024  # x86-64 transparent huge page
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


@dataclass(frozen=True)
class FileDigest:
    """What reading a file measured, for the entry check (`check_entry`)."""

    size: int  # bytes hashed; without a digest, the size fstat gave
    digest: bytes | None  # None: not hashed (the size already differs from the one expected, or it changed)
    changed: bool = False  # the file changed while it was hashed: the digest describes no single version of it
    grew: bool = False  # a byte lay past `size` when the read ended (the file grew while it was read)


def check_size(entry: Entry, size: int, where: str | None = None) -> None:
    """The entry check's first half, on its own where no byte is read yet (a descriptor's fstat size): raise
    DigestMismatchError unless `size` is the entry's."""
    if size != entry.size:
        raise DigestMismatchError(f"size is {size} bytes, manifest says {entry.size}", path=where or entry.path,
                                  expected=str(entry.size), actual=str(size), finding="size-mismatch")


def check_entry(entry: Entry, found: FileDigest, where: str | None = None) -> None:
    """The entry check: raise DigestMismatchError unless `found`, what reading the file (or receiving its bytes)
    measured, is `entry`: a file that held still while it was hashed, then its size, then its BLAKE3. `where`
    names the file in the error (default: its path in the manifest). Raising is the only verdict; audit's
    finding form (`manifest.audit`) catches this error and reports it, a caller that needs a yes or no
    (pull's "already there?") catches it at its call site."""
    path = where or entry.path
    if found.changed:
        read = f"{found.size}{'+' if found.grew else ''}"
        sizes = "" if read == str(entry.size) else f" ({read} bytes, manifest says {entry.size})"
        raise DigestMismatchError(f"file changed while it was being hashed{sizes}", path=path,
                                  expected=str(entry.size), actual=read, finding="unreadable")
    check_size(entry, found.size, where)
    if found.digest is None:
        raise ValueError(f"{path}: the entry check needs the file's digest")  # a caller's bug, never a verdict
    if found.digest != entry.digest:
        raise DigestMismatchError(f"BLAKE3 is {found.digest.hex()}, manifest says {entry.digest.hex()}", path=path,
                                  expected=entry.digest.hex(), actual=found.digest.hex(), finding="digest-mismatch")


def check_listed_digest(path: str, algorithm: str, expected: bytes, found: bytes) -> None:
    """The entry check for a file listed by digest alone (an OpenSSF Model Signing statement's resource: no size,
    any of its digest algorithms): raise DigestMismatchError unless `found` is `expected`. It lives beside
    `check_entry` so that every comparison of a file's digest has one home."""
    if found != expected:
        raise DigestMismatchError(f"{algorithm} is {found.hex()}, the OMS statement says {expected.hex()}", path=path,
                                  expected=expected.hex(), actual=found.hex(), finding="digest-mismatch")


def _read_result(entry: Entry, done: int, hasher: "blake3.blake3", extra: int = 0) -> FileDigest:
    """What a front-to-back read of a file opened at the entry's size (`check_size` on its fstat) found: `done`
    bytes hashed into `hasher`, `extra` bytes found past them. Any other count than the size it had when
    opened means the file changed while it was read."""
    return FileDigest(done, hasher.digest(), changed=done != entry.size or extra > 0, grew=extra > 0)


def digest_bytes(data: bytes | memoryview, threads: int | None = None) -> bytes:
    """BLAKE3 of `data`, with BLAKE3's own threads for large inputs: its shared pool, or `threads` of a
    pool of the hasher's own."""
    if len(data) < PARALLEL_HASH_MIN:
        threads = 1
    elif threads is None:
        threads = blake3.blake3.AUTO
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


class _Stopwatch:
    """Wall and thread-CPU seconds spent inside the calls it wraps: instruments the verified read from the
    outside, so the read loop itself holds nothing but reading and hashing."""

    def __init__(self, fn: Callable):
        self._fn = fn
        self.wall = self.cpu = 0.0

    def __call__(self, *args):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return self._fn(*args)
        finally:
            self.wall += time.perf_counter() - t
            self.cpu += time.thread_time() - c


def _open_signed_size(root: Path, entry: Entry) -> int:
    """`entry` opened beneath `root` (the one safe-open), its size compared with the signed one before a byte is
    read; the caller closes the descriptor."""
    fd = open_beneath(Path(root), entry.path)
    try:
        size = os.fstat(fd).st_size
    except OSError as e:
        os.close(fd)
        raise StorageError(f"cannot stat: {e.strerror}", path=entry.path) from e
    try:
        check_size(entry, size)
    except DigestMismatchError:
        os.close(fd)
        raise
    return fd


def _read_and_hash(fd: int, view: memoryview, size: int, read: Callable, update: Callable) -> tuple[int, int]:
    """The verified read's loop: fill `view` ([size] bytes) from `fd`, hashing each chunk as it lands.
    Returns (bytes read, bytes found past `size`: 0 or 1)."""
    done = 0
    while done < size:
        n = read(fd, [view[done:done + READ_CHUNK]])
        if n == 0:
            break
        update(view[done:done + n])
        done += n
    extra = len(os.read(fd, 1)) if done == size else 0  # one byte past the signed size: the file grew
    return done, extra


@functools.cache
def _madvise():
    """libc's madvise(2), or None where there is none to call (not Linux, no C library)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here: only the runtime's verified reads advise, and it already loads ctypes (mallopt)

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _private_buffer(size: int) -> np.ndarray:
    """An uninitialised uint8 array of `size` bytes for a verified read. Where THP is "madvise" (the common
    default), the 2 MiB pages that lie wholly inside it are advised as huge pages (numpy advises only from
    4 MiB): a buffer on memory the process never touched then costs one page fault per 2 MiB instead of one
    per 4 KiB (a bf16 expert of 3 MB: measured in benchmarks/bench_runtime.py). Memory reused from a freed
    shard is already there; the advice changes nothing for it. Advice only: a kernel that refuses it loses
    nothing."""
    import numpy as np

    data = np.empty(size, np.uint8)  # not zero-filled: the caller overwrites every byte
    madvise = _madvise() if size >= HUGE_PAGE else None
    if madvise is not None:
        address = data.ctypes.data
        start, end = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + size) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)
    return data


# What a verified read leaves in the kernel's page cache. "keep": plain reads, the pages stay (a model read again by the
# next process comes from memory). "drop": plain reads, then the file's cached pages are dropped (POSIX_FADV_DONTNEED):
# under a memory cap that charges the page cache, the shard cache, not the kernel's, decides what stays, and a byte
# is held once, not twice. "direct": O_DIRECT into an aligned private buffer: no page is cached at all (a filesystem
# that refuses O_DIRECT is read as "drop").
PAGE_CACHE_MODES = ("keep", "drop", "direct")
PAGE_CACHE_CHOICES = ("auto", *PAGE_CACHE_MODES)  # "auto": the runtime picks per model (runtime.store.page_cache_mode)
DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in multiples of the logical block (<= 4 KiB)


def read_verified_timed(root: Path, entry: Entry, page_cache: str = "keep") -> VerifiedBytes:
    """Read `entry` into private memory, hashing each chunk as it arrives; return it only if its size and
    BLAKE3 digest are the manifest's. The bytes returned are exactly the bytes hashed: no mmap, no re-read.
    `page_cache`: one of PAGE_CACHE_MODES.

    One pass: each chunk is hashed right after it lands in the private buffer, on the calling thread
    only (max_threads=1): the runtime's reader pool already loads several shards at once, and BLAKE3's
    own threads on top would oversubscribe the cores that compute. The time spent reading and hashing is
    measured around the calls (`_Stopwatch`), not inside the loop.
    """
    if page_cache not in PAGE_CACHE_MODES:
        raise ValueError(f"page_cache must be one of {PAGE_CACHE_MODES}, got {page_cache!r}")  # a caller's bug
    opening = _Stopwatch(_open_signed_size)
    fd = opening(root, entry)
    hasher = blake3.blake3()
    reading, hashing = _Stopwatch(os.readv), _Stopwatch(hasher.update)
    try:
        if page_cache == "direct" and _set_direct(fd):
            data, done, extra = _read_and_hash_direct(fd, entry.size, reading, hashing)
        else:
            data = _private_buffer(entry.size)  # numpy is imported there, not at module level: audits never need it
            done, extra = _read_and_hash(fd, memoryview(data), entry.size, reading, hashing)
        if page_cache != "keep":  # also after a direct read that went on with plain reads
            _drop_cached_pages(fd)
    except OSError as e:
        raise StorageError(f"read failed: {e.strerror}", path=entry.path) from e
    finally:
        os.close(fd)
    check_entry(entry, _read_result(entry, done, hasher, extra))
    data.flags.writeable = False
    return VerifiedBytes(data, opening.wall + reading.wall, hashing.wall, opening.cpu + reading.cpu, hashing.cpu)


def _drop_cached_pages(fd: int) -> None:
    """Advise the kernel to drop `fd`'s cached pages (clean ones go at once). Advice only: a refusal loses nothing."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def _set_direct(fd: int, on: bool = True) -> bool:
    """Turn O_DIRECT on (or off) for `fd`; False where the filesystem refuses it."""
    import fcntl  # here: only direct reads need it

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True


def _read_and_hash_direct(fd: int, size: int, read: Callable, update: Callable) -> tuple[np.ndarray, int, int]:
    """The verified read's loop under O_DIRECT: whole aligned blocks into an aligned buffer with room for one block
    past `size` (a file that grew shows there), hashing only the first `size` bytes. As in the plain loop, only a read
    of 0 bytes ends the file before `size` (FUSE, NFS and CIFS may return short reads mid-file); a short read that
    leaves the offset unaligned, or a filesystem that took the flag but refuses the reads (EINVAL), turns O_DIRECT off
    and the same loop goes on with plain reads. Returns (the buffer's first `size` bytes, bytes read up to `size`,
    bytes found past it); nothing reachable from the bytes returned is writeable."""
    capacity = -(-(size + 1) // DIRECT_ALIGN) * DIRECT_ALIGN
    base = _private_buffer(capacity + DIRECT_ALIGN)
    start = -base.ctypes.data % DIRECT_ALIGN
    buffer = base[start:start + capacity]  # [capacity] uint8, its address a multiple of DIRECT_ALIGN
    view = memoryview(buffer)
    done, direct = 0, True
    while done < capacity:
        want = min(READ_CHUNK, capacity - done)
        try:
            n = read(fd, [view[done:done + want]])
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL and _set_direct(fd, False)):
                raise
            direct = False
            continue
        if n == 0:
            break
        if done < size:
            update(view[done:min(done + n, size)])
        done += n
        if n < want and done >= size:  # the end of the file, at or past the signed size
            break
        if direct and done % DIRECT_ALIGN:
            direct = not _set_direct(fd, False)
            if direct:  # O_DIRECT cannot go on from an unaligned offset, and cannot be turned off: a read error
                raise OSError(errno.EINVAL, "a short O_DIRECT read left an unaligned offset")
    base.flags.writeable = False
    return buffer[:size], min(done, size), max(0, done - size)


def read_verified_prefix(root: Path, entry: Entry, prefix_length: Callable[[bytes], int],
                         buffer: bytearray | None = None) -> bytes:
    """Stream the whole of `entry` through the size and BLAKE3 check in bounded memory and return only its
    first bytes: `prefix_length(first_8_bytes)` of them (clamped to the file). The prefix is returned only
    after the whole file matched, so a caller parses nothing it has not verified (join reads shard
    headers this way before it lays out the rebuilt files)."""
    fd = _open_signed_size(root, entry)
    try:
        view = memoryview(buffer if buffer is not None else bytearray(CHUNK))
        hasher = blake3.blake3()
        prefix = bytearray()
        want = 8
        done = 0
        while done <= entry.size:  # one byte past the signed size notices growth
            n = os.readv(fd, [view[:min(len(view), entry.size + 1 - done)]])
            if n == 0:
                break
            chunk = view[:n]
            hasher.update(chunk)
            if len(prefix) < want:  # the prefix holds file bytes [0, len(prefix)); this chunk [done, done + n)
                prefix += chunk[len(prefix) - done:want - done]
                if want == 8 and len(prefix) == 8:
                    want = max(8, min(entry.size, prefix_length(bytes(prefix))))
                    prefix += chunk[len(prefix) - done:want - done]
            done += n
    except OSError as e:
        raise StorageError(f"read failed: {e.strerror}", path=entry.path) from e
    finally:
        os.close(fd)
    check_entry(entry, _read_result(entry, done, hasher))  # a byte past the signed size counts in `done`
    return bytes(prefix[:want])


class VerifyingStream:
    """`entry` read front to back in bounded pieces, each hashed as it is read; `finish()` raises unless the
    whole file had the entry's size and BLAKE3. The size is compared when the stream opens, before a byte is read.

    Nothing read is verified until `finish()` returns: a caller may only put the bytes where they are thrown
    away if it raises (join writes them into temp files that are renamed into place only after every shard
    verified, as `pull` does with `.NAME.partial`), and parses only bytes it verified before (join compares
    the shard's header with the one it verified whole in its first pass). Use as a context manager.
    """

    def __init__(self, root: Path, entry: Entry):
        self.entry = entry
        self.done = 0
        self._hash = blake3.blake3()
        self._fd = _open_signed_size(root, entry)

    def __enter__(self) -> "VerifyingStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def readinto(self, view: memoryview) -> None:
        """Fill `view` with the next bytes of the file, hashing them; the file ending first is an error."""
        if self.done + len(view) > self.entry.size:
            raise ValueError(f"{self.entry.path}: read past the signed size")  # callers stay within it
        filled = 0
        while filled < len(view):
            try:
                n = os.readv(self._fd, [view[filled:]])
            except OSError as e:
                raise StorageError(f"read failed: {e.strerror}", path=self.entry.path) from e
            if n == 0:  # the file ends before the size it had when opened
                check_entry(self.entry, FileDigest(self.done + filled, None, changed=True))
            filled += n
        self._hash.update(view)
        self.done += filled

    def finish(self) -> None:
        """The entry check over everything read: the whole file, no byte more, the signed BLAKE3."""
        try:
            extra = len(os.read(self._fd, 1)) if self.done == self.entry.size else 0
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror}", path=self.entry.path) from e
        check_entry(self.entry, _read_result(self.entry, self.done, self._hash, extra))


def read_verified(root: Path, entry: Entry) -> "np.ndarray":
    """The whole file `entry.path` as a private, read-only uint8 array, returned only if its size and
    BLAKE3 match `entry`. Callers parse and use exactly these bytes, never a fresh read."""
    return read_verified_timed(root, entry).data


def digest_fd(fd: int, buffer: bytearray | None = None, *, parallel: bool = True,
              expected_size: int | None = None, threads: int | None = None,
              before_map: Callable[[], None] | None = None,
              after_map: Callable[[], None] | None = None) -> FileDigest:
    """Hash an open file, for audits, where the bytes are not used afterwards.

    The size comes first: with `expected_size` (the signed size), a file of any other size is reported
    without reading a byte (a 16 TiB sparse file in place of a 4 KiB expert costs one fstat). Reads never
    go past the size `fstat` gave at the start, plus one byte to notice growth.

    Small files: one read. Large files: streamed through a reusable buffer into BLAKE3, with its own
    threads when `parallel` (callers hashing many files at once give each file one core instead).
    `threads`: that many BLAKE3 threads in a pool of this hasher's own instead (a forked process must
    not use the shared pool it inherited: its threads did not survive the fork, and BLAKE3 would wait
    for them forever).

    `before_map`: given only by audit's worker processes (`manifest/_workers.py`): a file of MAP_MIN
    bytes or more is then hashed from a read-only mapping, with no copy, after `before_map()` has named
    it to the supervisor. A file truncated while mapped raises SIGBUS, which kills the process: only a
    supervised worker may map. Without `before_map` nothing is mapped: the file is read. `after_map()`
    follows once the mapping is gone (or was never made), so that a later death is not blamed on this file.
    A file that shrank before it could be mapped (mmap refuses a length past the end) is reported changed;
    a filesystem that cannot map at all is read instead.
    """
    before = os.fstat(fd)
    if expected_size is not None and before.st_size != expected_size:
        return FileDigest(before.st_size, None, changed=False)
    limit = before.st_size + 1
    if threads is None:
        threads = blake3.blake3.AUTO if parallel else 1
    mapped_digest = None
    if before_map is not None and before.st_size >= MAP_MIN:
        mapped_digest = _digest_mapped(fd, before, threads, before_map, after_map)
    if mapped_digest is not None:
        if mapped_digest is _SHRANK:
            return FileDigest(os.fstat(fd).st_size, None, changed=True)
        digest, total = mapped_digest, before.st_size
    elif before.st_size < CHUNK:
        data = os.read(fd, limit)
        return FileDigest(len(data), digest_bytes(data, threads), changed=len(data) != before.st_size)
    else:
        hasher = blake3.blake3(max_threads=threads)
        buf = buffer if buffer is not None else bytearray(CHUNK)
        view = memoryview(buf)
        total = 0
        while total < limit:
            n = os.readv(fd, [view[:min(len(view), limit - total)]])
            if n == 0:
                break
            hasher.update(view[:n])
            total += n
        digest = hasher.digest()
    after = os.fstat(fd)
    changed = (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or total != before.st_size
    return FileDigest(total, digest, changed)


_SHRANK = object()


def _digest_mapped(fd: int, before: os.stat_result, threads: int, before_map: Callable[[], None],
                   after_map: Callable[[], None] | None):
    """The BLAKE3 of `before.st_size` bytes of `fd` hashed from a read-only mapping; `_SHRANK` when the file
    no longer has them (or mmap refused them and the file changed); None when this filesystem cannot map
    (the caller reads instead)."""
    before_map()
    try:
        try:
            mapped = mmap.mmap(fd, before.st_size, prot=mmap.PROT_READ)
        except ValueError:  # "mmap length is greater than file size": it shrank after the fstat
            return _SHRANK
        except OSError:
            now = os.fstat(fd)
            if (now.st_size, now.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                return _SHRANK
            return None
        with mapped:
            if len(mapped) < before.st_size:
                return _SHRANK
            mapped.madvise(mmap.MADV_SEQUENTIAL)  # a cold file: read ahead further
            return blake3.blake3(mapped, max_threads=threads).digest()
    finally:
        if after_map is not None:
            after_map()


def verify_open_file(fd: int, entry: Entry, buffer: bytearray | None = None, *, parallel: bool = True,
                     where: str | None = None) -> FileDigest:
    """Stream an open file through the entry check (the bytes are not kept). Raises; returns the digest."""
    try:
        result = digest_fd(fd, buffer, parallel=parallel, expected_size=entry.size)
    except OSError as e:
        raise StorageError(f"read failed: {e.strerror}", path=where or entry.path) from e
    check_entry(entry, result, where)
    return result


def verify_entry(root: Path, entry: Entry) -> FileDigest:
    """Stream `root/entry.path` through the entry check, for callers that need the verdict, not the bytes
    (`verify-and-run --verify-all-first`). Raises exactly what `read_verified` would."""
    fd = open_beneath(Path(root), entry.path)
    try:
        return verify_open_file(fd, entry)
    finally:
        os.close(fd)


def verify_file(path: Path, entry: Entry) -> FileDigest:
    """Check a file outside any model directory (e.g. a shard received from a peer) against a signed
    entry: a regular file whose size and BLAKE3 are the entry's, the size compared before any read."""
    fd = open_regular(path)
    try:
        return verify_open_file(fd, entry, where=str(path))
    finally:
        os.close(fd)
