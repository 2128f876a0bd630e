"""Reading the source checkpoint for split: open files, bounded offset reads, and each output's byte stream."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from shardtool.checkpoint._plan_records import OutputFile, Piece, cut
from shardtool.checkpoint._quantize import DATA, float_shape, quantize
from shardtool.checkpoint._source import Checkpoint, hash_fd, pin_of
from shardtool.errors import CheckpointFormatError, StorageError, VerificationError

if TYPE_CHECKING:
    import numpy as np

CHUNK = 8 * 1024 * 1024  # bounded read buffer; peak memory is two of these plus one fused expert slice
QUANT_BATCH = 2 * 1024 * 1024  # split --quantize: float32 bytes of rows quantized at once (temporaries ~5x this)


class Sources:
    """Open source files and bounded, offset-addressed reads from them.

    Files are opened through the checkpoint's safe open (`_ckptdir`) and must still be the very files
    (device, inode, size) that were planned from. With a signed statement (`split --oms-signature`), a file is
    read only while it keeps the pin it had when its signed digest was checked through the same fd (weights: when
    planned; other files: here, on opening), and `check_pins` proves after the last read that none moved.
    """

    def __init__(self, ckpt: Checkpoint):
        self.root = ckpt.root
        self.copy_file_range_ok = True
        self._ckpt = ckpt
        self._dir = ckpt.open_dir()
        self._fds: dict[str, int] = {}
        self._pins: dict[str, tuple[int, int, int]] = {}
        # Two buffers, used in turn: a chunk stays intact while the next one is read (see HashingFileWriter.write).
        self._bufs = (bytearray(CHUNK), bytearray(CHUNK))
        self._turn = 0
        self._slice_key: tuple[str, int, int] | None = None
        self._slice: bytes = b""

    def fd(self, file: str) -> int:
        if file not in self._fds:
            fd, _ = self._dir.open(file, expect=self._ckpt.expected(file))
            signed = self._ckpt.signed
            if signed is not None:
                try:
                    self._pins[file] = self._ckpt.pins.get(file) or hash_fd(signed, self.root, file, fd)
                    self._check_pin(file, fd)
                except BaseException:
                    os.close(fd)
                    raise
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._fds[file] = fd
        return self._fds[file]

    def chunks(self, file: str, offset: int, length: int) -> Iterator[memoryview]:
        """Yield views into one reusable buffer; each is valid until the next is requested."""
        fd = self.fd(file)
        while length > 0:
            self._turn ^= 1
            view = memoryview(self._bufs[self._turn])
            try:
                n = os.preadv(fd, [view[:min(length, CHUNK)]], offset)
            except OSError as e:
                raise StorageError(f"read failed: {e.strerror}", path=str(self.root / file)) from e
            if n == 0:
                raise CheckpointFormatError("file ended early (truncated during split?)", path=str(self.root / file))
            yield view[:n]
            offset += n
            length -= n

    def read(self, file: str, offset: int, length: int) -> bytes:
        """A whole fused expert slice, cached so the gate and up halves cut from it read it once."""
        key = (file, offset, length)
        if key != self._slice_key:
            self._slice = b"".join(bytes(c) for c in self.chunks(file, offset, length))
            self._slice_key = key
        return self._slice

    def _check_pin(self, file: str, fd: int) -> None:
        if pin_of(fd) != self._pins[file]:
            raise VerificationError("changed after split checked it against the OMS statement; the bytes read may "
                                    "not be the signed ones", path=str(self.root / file))

    def check_pins(self) -> None:
        """With a signed statement: every file read is still as it was when its digest was checked (raises)."""
        for file, fd in self._fds.items():
            if file in self._pins:
                self._check_pin(file, fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._dir.close()


@dataclass(frozen=True)
class Run:
    """A contiguous byte range of a source file that goes into the output unchanged."""

    file: str
    offset: int
    length: int


def segments(out: OutputFile, sources: Sources) -> Iterator[Run | memoryview | bytes]:
    """The bytes of `out` in order: source runs, or bytes computed in memory (header, cut fused slices, quantized
    projections: a batch of rows at a time, see `_quantized_rows`)."""
    if out.copy_from is not None:
        yield Run(out.copy_from, 0, out.size)
        return
    yield out.header
    scales: tuple[tuple, list] | None = None  # the last projection quantized: its key and its scale rows
    for p in out.pieces:
        if p.quant is not None:
            key = (p.file, p.source.start, p.expert, p.cut)
            if p.quant[1] == DATA:
                scales = key, []
                for q, d in _quantized_rows(p, sources):
                    scales[1].append(d)
                    yield memoryview(q).cast("B")
                continue
            if scales is None or scales[0] != key:  # a scale without its data just before it: compute it again
                scales = key, [d for _, d in _quantized_rows(p, sources)]
            for d in scales[1]:
                yield memoryview(d).cast("B")
            continue
        run = p.byte_range()
        if run is not None:
            yield Run(p.file, *run)
        else:
            start, length = p.slice_range()
            arr = cut(sources.read(p.file, start, length), p.dtype, p.source.shape[1:], p.cut)
            yield memoryview(arr).cast("B")


def _quantized_rows(p: Piece, sources: Sources) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(data, scale) of quantized piece `p`, a batch of rows at a time (rows are independent): at most
    QUANT_BATCH bytes of float32 rows (and their temporaries) at once. A whole projection's tensor is read
    batch by batch; a fused piece is cut from its expert's slice, which is read once (as a plain split does)."""
    import numpy as np

    from shardtool.safetensors_format import numpy_dtype

    rows, cols = float_shape(p)
    batch = max(1, QUANT_BATCH // (cols * 4))
    dtype = numpy_dtype(p.source.dtype)
    if p.cut is None:
        row_bytes = cols * dtype.itemsize
        for r in range(0, rows, batch):
            n = min(batch, rows - r)
            raw = bytearray()
            for chunk in sources.chunks(p.file, p.source.start + r * row_bytes, n * row_bytes):
                raw += chunk
            yield quantize(p, np.frombuffer(raw, dtype=dtype).reshape(n, cols).astype(np.float32))
        return
    start, length = p.slice_range()
    w = cut(sources.read(p.file, start, length), p.source.dtype, p.source.shape[1:], p.cut).view(dtype)
    for r in range(0, rows, batch):
        yield quantize(p, w[r:r + batch].astype(np.float32))


def stream(out: OutputFile, sources: Sources) -> Iterator[memoryview | bytes]:
    """The exact bytes of `out`, in bounded chunks read through our own buffers."""
    for seg in segments(out, sources):
        if isinstance(seg, Run):
            yield from sources.chunks(seg.file, seg.offset, seg.length)
        else:
            yield seg
