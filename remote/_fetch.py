"""Fetch one listed file from untrusted mirrors into a directory: the bounded, verified download.

The order for each file (python-tuf's updater is the model: only listed targets, each bounded by its signed
length and checked against its signed hash before it is trusted):

1. A file already under its final name is hashed; if size and BLAKE3 are the entry's it is kept.
2. Otherwise the bytes go into `.NAME.partial` beside it (created without following links), hashed as they are
   written. A partial file left by an earlier run is re-hashed and continued from its end with a range request
   (or restarted when the mirror cannot start there).
3. A mirror may never write past the signed size: a longer answer is cut off there and is that mirror's fault.
   A short answer, an error or a stall keeps what arrived and the next mirror continues it.
4. Only when size and BLAKE3 match is the partial file renamed to the final name. Wrong bytes are blamed on
   the mirror that served the whole file; bytes assembled from several attempts are fetched again whole from
   the mirror that finished them before anyone is blamed.

Disk use per file never exceeds its signed size. Nothing here parses a fetched byte.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import blake3

from shardtool.errors import (DigestMismatchError, ShardtoolError, StorageError, UnreadableFileError,
                              VerificationError)
from shardtool.manifest import Entry, FileDigest, check_entry, verify_open_file
from shardtool.outdir import OutDir
from shardtool.remote._mirror import MIN_RATE, READ_CHUNK, Mirror, MirrorFault
from shardtool.safeio import open_file_at
from shardtool.text import printable

PARTIAL_SUFFIX = ".partial"


class _RateGuard:
    """A store that answers every read just inside the per-request time-out (a trickle of a byte each time) is
    a stall too: over each window of `timeout` seconds it must send at least MIN_RATE bytes a second."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.start = time.monotonic()
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n
        now = time.monotonic()
        elapsed = now - self.start
        if elapsed >= self.timeout:
            if self.count < MIN_RATE * elapsed:
                raise MirrorFault(f"sent {self.count} bytes in {elapsed:.0f}s, slower than {MIN_RATE} bytes/s")
            self.start, self.count = now, 0


@dataclass(frozen=True)
class Fault:
    """A mirror that did not serve a file right, and how."""

    mirror: str
    path: str
    reason: str

    def line(self) -> str:
        return f"{printable(self.mirror)}: {printable(self.reason, backslash=False)}"


@dataclass
class Outcome:
    """What fetching one entry did. `status`: "kept" (already present and verified), "downloaded" or
    "resumed" (continued a partial file)."""

    entry: Entry
    status: str
    downloaded: int = 0  # bytes received and written this run
    mirror: str | None = None  # the mirror that completed it
    faults: list[Fault] = field(default_factory=list)


class FetchFailed(VerificationError):
    """No mirror served a listed file with its signed bytes (exit 1). `faults`: each mirror's failure."""

    def __init__(self, entry: Entry, faults: list[Fault]):
        reasons = "; ".join(f.line() for f in faults[-4:]) or "no mirror to ask"
        more = f" (and {len(faults) - 4} earlier faults)" if len(faults) > 4 else ""
        super().__init__(f"no mirror served its signed bytes ({entry.size} bytes, BLAKE3 "
                         f"{entry.digest.hex()[:16]}…): {reasons}{more}", path=entry.path)
        self.entry, self.faults = entry, faults


def partial_name(name: str) -> str:
    """`.NAME.partial`, or `.DIGEST.partial` (a digest of the name) where NAME's UTF-8 bytes are too long to take
    the affixes within the 255-byte limit of a file name."""
    if len(name.encode()) <= 255 - len("." + PARTIAL_SUFFIX):
        return f".{name}{PARTIAL_SUFFIX}"
    return f".{blake3.blake3(name.encode()).hexdigest()[:40]}{PARTIAL_SUFFIX}"


def _storage(e: OSError, where: str, doing: str) -> StorageError:
    reason = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return StorageError(f"{doing} failed: {reason}", path=where)


def _hash_prefix(fd: int, length: int, hasher: "blake3.blake3", where: str) -> int:
    """Re-hash the first `length` bytes of a partial file; returns how many it really holds."""
    done = 0
    buf = bytearray(min(READ_CHUNK, max(length, 1)))
    view = memoryview(buf)
    try:
        while done < length:
            n = os.preadv(fd, [view[:min(len(view), length - done)]], done)
            if n == 0:
                break
            hasher.update(view[:n])
            done += n
    except OSError as e:
        raise _storage(e, where, "reading the partial file") from e
    return done


def _write_all(fd: int, data: bytes, pos: int, where: str) -> None:
    view = memoryview(data)
    try:
        while view:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n
    except OSError as e:
        raise _storage(e, where, "write") from e


class _Partial:
    """`.NAME.partial` opened (created) link-free in its directory, with the hash of what it holds."""

    def __init__(self, dir_fd: int, name: str, entry: Entry, where: str):
        self.dir_fd, self.name, self.entry, self.where = dir_fd, partial_name(name), entry, where
        self.fd = self._open_kept()
        if self.fd is None:
            self.fd = self._create()
        try:
            st = os.fstat(self.fd)
            self.hasher = blake3.blake3()
            self.size = 0
            if 0 < st.st_size <= entry.size:
                self.size = _hash_prefix(self.fd, st.st_size, self.hasher, where)
            if self.size != st.st_size:
                self.truncate()
        except BaseException:
            os.close(self.fd)
            raise

    def _open_kept(self) -> int | None:
        """A partial file an earlier run of ours left, or None. Anything else under the name (a link, a FIFO, a
        hard link to a file elsewhere, a file of another owner or writable by others) is removed, never written
        through: a rename then gives the final name our own fresh inode."""
        try:
            fd = os.open(self.name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return None
        except OSError:
            fd = None
        if fd is not None:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid() \
                    and not st.st_mode & 0o022:
                return fd
            os.close(fd)
        try:
            os.unlink(self.name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot remove what lies at the partial file's name: {e.strerror}", path=self.where,
                               hint=f"remove {self.name}") from None
        return None

    def _create(self) -> int:
        try:
            fd = os.open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=self.dir_fd)
        except OSError as e:
            raise _storage(e, self.where, "creating the partial file") from e
        os.fchmod(fd, 0o644)  # exactly this mode, whatever the umask
        return fd

    def truncate(self) -> None:
        try:
            os.ftruncate(self.fd, 0)
        except OSError as e:
            raise _storage(e, self.where, "truncating the partial file") from e
        self.hasher, self.size = blake3.blake3(), 0

    def append(self, data: bytes) -> None:
        _write_all(self.fd, data, self.size, self.where)
        self.hasher.update(data)
        self.size += len(data)

    def check(self) -> None:
        """The entry check over what the partial file holds (hashed as it was written): DigestMismatchError
        unless it is the entry's size and BLAKE3."""
        check_entry(self.entry, FileDigest(self.size, self.hasher.digest()), self.where)

    def promote(self, final_name: str) -> None:
        """Rename over the final name (replacing a file or link of that name, never writing through it), once the
        partial name still holds the file we hashed (someone else writing in DEST may have swapped it)."""
        try:
            here = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError as e:
            raise _storage(e, self.where, "checking the partial file") from e
        ours = os.fstat(self.fd)
        if (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino):
            raise StorageError("the partial file was replaced while it was written (another writer in this "
                               "directory)", path=self.where)
        try:
            os.replace(self.name, final_name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError as e:
            raise _storage(e, self.where, "renaming the verified file into place") from e

    def close(self) -> None:
        os.close(self.fd)


def _check_in_place(dir_fd: int, name: str, entry: Entry, where: str) -> None:
    """The entry check over the file under the final name: a VerificationError unless it is a regular file with
    the entry's size and BLAKE3 (MissingFileError; NotARegularFileError for a link, a FIFO, a directory;
    DigestMismatchError; UnreadableFileError when reading it fails). Trouble opening it on our side (no
    descriptor left) stays a StorageError."""
    fd = open_file_at(dir_fd, name, entry.path)
    try:
        verify_open_file(fd, entry, where=where)
    except StorageError as e:  # a read error: a file to replace like any other wrong one
        raise UnreadableFileError(e.message, path=where) from e
    finally:
        os.close(fd)


def _attempt(mirror: Mirror, partial: _Partial, entry: Entry, outcome: Outcome,
             progress: Callable[[int], None] | None) -> None:
    """Continue `partial` from `mirror` up to the signed size, counting what is written in `outcome.downloaded` as
    it is written. MirrorFault on any misbehaviour (what arrived before it stays in the partial file, and counted)."""
    stream = mirror.open(entry.path, partial.size, entry.size)
    pace = _RateGuard(mirror.timeout)
    try:
        if stream.offset != partial.size:  # the store starts from 0: what we hold is dropped
            partial.truncate()
        while partial.size <= entry.size:
            want = min(READ_CHUNK, entry.size - partial.size + 1)  # one byte past the signed size notices more
            data = stream.read(want)
            if not data:
                break
            pace.add(len(data))
            if partial.size + len(data) > entry.size:
                keep = entry.size - partial.size
                partial.append(data[:keep])
                outcome.downloaded += keep
                if progress:
                    progress(keep)
                raise MirrorFault(f"serves more than the signed {entry.size} bytes")
            partial.append(data)
            outcome.downloaded += len(data)
            if progress:
                progress(len(data))
    finally:
        stream.close()
    if partial.size < entry.size:
        raise MirrorFault(f"ended after {partial.size} of the signed {entry.size} bytes")


def fetch_entry(dest: OutDir, entry: Entry, mirrors: Sequence[Mirror], *,
                progress: Callable[[int], None] | None = None, keep_existing: bool = True) -> Outcome:
    """Make DEST/entry.path the entry's verified bytes, from the first mirror that serves them."""
    where = str(dest.path / entry.path)
    dir_fd, name = dest.locate(entry.path)
    if keep_existing:
        try:
            _check_in_place(dir_fd, name, entry, where)
            return Outcome(entry, "kept")
        except VerificationError:
            pass  # absent, a link, other bytes, unreadable: fetched, and the verified file renamed over it
    if dest.is_directory(entry.path):  # the rename could never replace it: say so before fetching a byte
        raise StorageError("a directory lies where this listed file belongs", path=where)
    partial = _Partial(dir_fd, name, entry, where)
    outcome = Outcome(entry, "resumed" if partial.size else "downloaded")
    try:
        for mirror in mirrors:
            fresh_retry = False
            while True:
                started_at = partial.size
                try:
                    if partial.size < entry.size:
                        _attempt(mirror, partial, entry, outcome, progress)
                except MirrorFault as fault:
                    outcome.faults.append(Fault(mirror.label, entry.path, fault.reason))
                    if partial.size < entry.size:
                        break  # a prefix: the next mirror continues it, the digest decides at the end
                    try:
                        partial.check()
                    except DigestMismatchError:
                        partial.truncate()  # the signed size, cut off, and wrong: nothing in it worth keeping
                        break
                    # The signed bytes all arrived before the fault (an endless body cut off at the signed size):
                    # they are verified, so they are kept; the fault stays on the record.
                try:
                    partial.check()
                except DigestMismatchError as wrong:
                    found = wrong.actual
                else:
                    partial.promote(name)
                    outcome.mirror = mirror.label
                    return outcome
                partial.truncate()
                if started_at and not fresh_retry:
                    fresh_retry = True  # a prefix from earlier attempts may be the bad part: ask this mirror whole
                    continue
                outcome.faults.append(Fault(mirror.label, entry.path,
                                            f"served wrong bytes (BLAKE3 {found}, signed {entry.digest.hex()})"))
                break
    finally:
        partial.close()
    raise FetchFailed(entry, outcome.faults)


def fetch_bytes(mirrors: Sequence[Mirror], relpath: str, cap: int,
                accept: Callable[[bytes, Mirror], object]) -> tuple[object, Mirror, list[Fault]]:
    """The first mirror's copy of a small unlisted file (the manifest) that `accept` takes: read at most `cap`
    bytes into memory, then `accept(data, mirror)` verifies it and returns what it yields or raises a
    VerificationError, after which the next mirror is asked. Raises the last refusal (or FetchFailed-like
    VerificationError) when no mirror had an acceptable copy."""
    faults: list[Fault] = []
    last: ShardtoolError | None = None
    for mirror in mirrors:
        try:
            stream = mirror.open(relpath, 0, None, cap)
            buf = bytearray()  # grows with what arrives (one copy, never a list of chunks joined), at most cap + 1
            pace = _RateGuard(mirror.timeout)
            try:
                while len(buf) <= cap:
                    data = stream.read(min(READ_CHUNK, cap + 1 - len(buf)))
                    if not data:
                        break
                    pace.add(len(data))
                    buf += data
            finally:
                stream.close()
            if len(buf) > cap:
                raise MirrorFault(f"serves more than the cap of {cap} bytes")
        except MirrorFault as fault:
            faults.append(Fault(mirror.label, relpath, fault.reason))
            continue
        try:
            return accept(bytes(buf), mirror), mirror, faults
        except VerificationError as e:
            faults.append(Fault(mirror.label, relpath, e.message))
            last = e
    if last is not None and len(faults) == 1:
        raise last
    reasons = "; ".join(f.line() for f in faults[-4:])
    raise VerificationError(f"no mirror served an acceptable {relpath}: {reasons}")


class PathLocks:
    """One lock per path, so two threads asking for the same missing shard fetch it once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    @contextlib.contextmanager
    def hold(self, path: str):
        with self._lock:
            lock = self._locks.setdefault(path, threading.Lock())
        with lock:
            yield
