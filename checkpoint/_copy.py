"""Fill one output file at explicit offsets while hashing (BLAKE3) exactly the bytes that landed in it.

Source byte runs are copied in the kernel (copy_file_range, as `cp` does) and then hashed from the
output file itself through a small read-only window; bytes computed in memory are hashed and written
directly. Hashing runs on one worker thread (BLAKE3 releases the GIL), one step behind the copying.
"""

from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import Executor, Future
from typing import Any


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


class HashingFileWriter:
    """Writes a file front to back by offset; `digest()` is the BLAKE3 of its final contents."""

    def __init__(self, fd: int, executor: Executor | None, *, use_copy_file_range: bool = True):
        import blake3

        self.fd = fd
        self.pos = 0
        self._hash = blake3.blake3()
        self._executor = executor
        self._pending: Future | None = None
        self.copy_file_range_ok = use_copy_file_range and hasattr(os, "copy_file_range")

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _hash_later(self, fn: Any, *args: Any) -> None:
        """Hash steps run in order: at most one is outstanding while the caller copies the next run."""
        self._wait()
        if self._executor is None:
            fn(*args)
        else:
            self._pending = self._executor.submit(fn, *args)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from memory. The caller keeps `data` unchanged until the next call (it may still be hashing)."""
        view = memoryview(data).cast("B")
        if len(view) <= _INLINE_HASH_MAX:
            self._wait()
            self._hash.update(view)
        else:
            self._hash_later(self._hash.update, view)
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
            self._hash_later(_hash_file_window, self._hash, self.fd, self.pos, n)
            self.pos += n
            done += n
        return done

    def digest(self) -> bytes:
        self._wait()
        return self._hash.digest()

    def abandon(self) -> None:
        """Let an outstanding hash step finish (it may be reading a buffer the caller will reuse)."""
        try:
            self._wait()
        except Exception:  # noqa: BLE001 - the write already failed; its error is the one to report
            pass
