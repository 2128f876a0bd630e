"""Fill one output file at explicit offsets while hashing (BLAKE3) exactly the bytes that landed in it.

Source byte runs are copied in the kernel (copy_file_range, as `cp` does) and then hashed from the
output file itself through a small read-only window; bytes computed in memory are hashed and written
directly. Hashing runs on one worker thread (BLAKE3 releases the GIL) behind the copying, in a queue shared
by every file of the split (`HashQueue`): a file's last steps are hashed while the next file is copied, so
the copy never waits for the hash unless the hash falls `HashQueue.DEPTH` steps behind.

Why read back what copy_file_range wrote rather than hash the source: the source is untrusted and may be
rewritten while we copy it, so a hash of what we read from it need not be what landed in the shard. The
manifest must name the bytes on disk, and the window maps our own temp file (created O_EXCL, never more
permissive than 0644), which nobody else writes. The bytes were just written, so the window reads the page
cache: no disk read, no copy to user space.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections import deque
from concurrent.futures import Executor, Future
from typing import Any, Callable


WINDOW = 32 * 1024 * 1024  # bytes copied and hashed per step; bounds the mapped window
_INLINE_HASH_MAX = 1 << 20
# copy_file_range failures that mean "not supported here", after which we copy through a buffer.
COPY_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


def _hash_file_window(hasher: Any, fd: int, pos: int, length: int) -> None:
    """Hash bytes [pos, pos+length) of the file `fd` as they are in the file (page cache), not as we meant them."""
    aligned = pos - pos % mmap.ALLOCATIONGRANULARITY
    delta = pos - aligned
    try:
        m = mmap.mmap(fd, delta + length, offset=aligned, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # a filesystem without mmap: read the bytes back instead
        data = os.pread(fd, length, pos)
        if len(data) != length:
            raise OSError(errno.EIO, "short read of the file just written") from None
        hasher.update(data)
        return
    with m, memoryview(m) as view, view[delta:delta + length] as part:
        hasher.update(part)


PREALLOCATE_MIN = 1 << 20
_fallocate: Any = None


def preallocate(fd: int, size: int) -> None:
    """Reserve the blocks of a file about to be written whole (fallocate(2), mode 0), so the filesystem does
    not reserve delayed-allocation space page by page during the copy (ext4: about a quarter less kernel CPU
    in copy_file_range). Where fallocate is unsupported nothing is done: glibc's posix_fallocate is not
    used, as it emulates by writing a byte per block. No space is the only failure reported (OSError ENOSPC)."""
    global _fallocate
    if size < PREALLOCATE_MIN:
        return
    if _fallocate is None:
        import ctypes

        try:
            fn = ctypes.CDLL(None, use_errno=True).fallocate
            fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
            fn.restype = ctypes.c_int
            _fallocate = (fn, ctypes)
        except (AttributeError, OSError):
            _fallocate = False
    if not _fallocate:
        return
    fn, ctypes = _fallocate
    if fn(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(err, os.strerror(err))


class HashQueue:
    """Hash steps of every file being written, run in submission order on one worker thread (or at once,
    without an executor), at most DEPTH steps behind the writer.

    A failed step makes every digest after it moot (the split cannot finish), so the queue keeps the first
    failure and raises it from the next `submit`: the writer stops within DEPTH steps, whichever file the
    step belonged to. The owner's digest future (`HashingFileWriter.finish`) fails with the same error."""

    DEPTH = 16  # steps of at most WINDOW bytes, all of them just written and still in the page cache

    def __init__(self, executor: Executor | None):
        self._executor = executor
        self._pending: deque[Future] = deque()
        self.failure: BaseException | None = None  # the first step that failed, if any

    def _settle(self, future: Future) -> None:
        error = future.exception()  # waits
        if error is not None and self.failure is None:
            self.failure = error

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue a step; raises the first earlier failure instead (no more work once a digest is lost)."""
        while self._pending and (self._pending[0].done() or len(self._pending) >= self.DEPTH):
            self._settle(self._pending.popleft())
        if self.failure is not None:
            raise self.failure
        if self._executor is None:
            done: Future = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the result
                done.set_exception(e)
            self._pending.append(done)
            return done
        future = self._executor.submit(fn, *args)
        self._pending.append(future)
        return future


class HashingFileWriter:
    """Writes a file front to back by offset; `finish()` gives the BLAKE3 of its final contents.

    The hash steps read the file through a descriptor of their own, so they may still run after the file
    was closed and renamed into place; `finish()` returns a future of the digest that is resolved only
    when every step of this file succeeded.
    """

    def __init__(self, fd: int, queue: HashQueue | Executor | None, *, use_copy_file_range: bool = True):
        import blake3

        self.fd = fd
        self.pos = 0
        self._hash = blake3.blake3()
        self._queue = queue if isinstance(queue, HashQueue) else HashQueue(queue)
        self._hash_fd = os.dup(fd)
        self._last: Future | None = None        # this file's latest hash step
        self._memory: Future | None = None      # its latest step hashing a caller's buffer
        self._error: BaseException | None = None
        self._finished = False
        self.copy_file_range_ok = use_copy_file_range and hasattr(os, "copy_file_range")

    def _step(self, fn: Callable[..., Any], *args: Any) -> Future:
        def run() -> None:
            if self._error is None:  # after a failed step the digest is void: do no more work for it
                try:
                    fn(*args)
                except BaseException as e:
                    self._error = e
                    raise
        self._last = self._queue.submit(run)
        return self._last

    def _wait_own(self) -> None:
        if self._last is not None:
            self._last.exception()
        if self._error is not None:
            raise self._error

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from memory. The caller keeps `data` unchanged until the next call (it may still be hashing)."""
        view = memoryview(data).cast("B")
        self._wait_own()  # this file's earlier steps first: the hash takes bytes in file order
        if len(view) <= _INLINE_HASH_MAX:
            self._hash.update(view)
        else:
            self._memory = self._step(self._hash.update, view)
        start = 0
        while start < len(view):
            start += os.pwrite(self.fd, view[start:], self.pos + start)
        self.pos += len(view)

    def copy(self, src_fd: int, offset: int, length: int) -> int:
        """Copy a source run in the kernel; returns the bytes copied (fewer only if the source ended early)."""
        done = 0
        while done < length:
            n = os.copy_file_range(src_fd, self.fd, min(length - done, WINDOW), offset + done, self.pos)
            if n == 0:
                break
            self._step(_hash_file_window, self._hash, self._hash_fd, self.pos, n)
            self.pos += n
            done += n
        return done

    def finish(self) -> Future:
        """The future digest of everything written; the writer takes no more bytes. Returns once no step
        still reads a caller's buffer (the next file may reuse it). Raises the queue's first failure instead,
        like every step (then call `abandon`)."""

        def final() -> bytes:
            os.close(self._hash_fd)
            if self._error is not None:
                raise self._error
            return self._hash.digest()
        future = self._queue.submit(final)
        self._finished = True
        if self._memory is not None:
            self._memory.exception()
        return future

    def digest(self) -> bytes:
        return self.finish().result()

    def abandon(self) -> None:
        """Let this file's outstanding hash steps finish (they may read a buffer the caller will reuse)."""
        if self._finished:
            return
        self._finished = True
        if self._last is not None:
            self._last.exception()
        os.close(self._hash_fd)
