"""Rerun support: reuse an output file only if its bytes equal, one by one, what split would write now."""

from __future__ import annotations

import os
import stat
from typing import Any, Callable

from shardtool.checkpoint._plan_records import OutputFile
from shardtool.checkpoint._writer import OverlappedHasher
from shardtool.checkpoint._stream import CHUNK, Sources, stream


class _Mismatch(Exception):
    pass


class _Comparer:
    """A writer that writes nothing: it checks each chunk against the file already on disk."""

    def __init__(self, fd: int, hasher: OverlappedHasher):
        self._fd, self._hash = fd, hasher
        self._pos = 0
        self._buf = memoryview(bytearray(CHUNK))
        import numpy  # a vectorised comparison; only reruns pay for the import

        self._np = numpy

    def write(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        for start in range(0, len(data), CHUNK):
            part = data[start:start + CHUNK]
            n = os.preadv(self._fd, [self._buf[:len(part)]], self._pos)
            if n != len(part) or not self._np.array_equal(self._np.frombuffer(self._buf[:n], "u1"),
                                                          self._np.frombuffer(part, "u1")):
                raise _Mismatch
            self._pos += n
        self._hash.update(data)


def existing_digest(dir_fd: int, name: str, out: OutputFile, mode: int, sources: Sources,
                    on_bytes: Callable[[int], None], executor: Any = None) -> bytes | None:
    """The digest of the shard `name` in the open output directory `dir_fd` if its bytes and permission bits
    equal what we would write now, else None (then it is rewritten, which replaces whatever is there).

    Safe without trusting mtimes or a journal: every byte is compared with the source-derived stream.
    Costs a read of the old shard instead of a write, and a crash-truncated or stale file simply fails.
    Only a regular file is ever read: the name is opened with O_NOFOLLOW | O_NONBLOCK, relative to a
    directory opened without following links, so a link or FIFO planted in OUT is never read through.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None  # absent, a link, a socket, unreadable: write it anew
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != out.size or stat.S_IMODE(st.st_mode) != mode:
            return None
        hasher = OverlappedHasher(executor)
        done = 0
        try:
            comparer = _Comparer(fd, hasher)
            for chunk in stream(out, sources):
                comparer.write(chunk)
                done += len(chunk)
                on_bytes(len(chunk))
        except (_Mismatch, OSError):
            hasher.digest()  # let a pending hash finish before its buffer is read into again
            on_bytes(-done)
            return None
        return hasher.digest()
    finally:
        os.close(fd)
