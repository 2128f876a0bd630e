"""The records a split plan is made of: output files, the tensors in each, and how each is cut from the source
(the planner that makes them: `_split_plan.py`).

Pure data and arithmetic; no I/O. `Cut` is the one transform between a fused source tensor and a
canonical per-expert tensor (`cut`), and `paste` is its exact inverse (a byte permutation, so dtype-agnostic).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from shardtool.safetensors_format import DTYPE_SIZES, TensorInfo
from shardtool.errors import CheckpointFormatError

if TYPE_CHECKING:  # numpy is imported where bytes are actually cut, so a plain split never loads it
    import numpy as np


@dataclass(frozen=True)
class Cut:
    """Canonical tensor = transpose?(S[..., start : start + count*step : step, ...]) with S = fused[expert].

    `axis` indexes S (the per-expert slice, i.e. the fused shape without its leading E axis).
    """

    axis: int
    start: int
    step: int
    count: int
    transpose: bool = False

    def out_shape(self, slice_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not 0 <= self.axis < len(slice_shape):
            raise CheckpointFormatError(f"cut axis {self.axis} is outside a slice of shape {list(slice_shape)}")
        if self.count < 1 or self.step < 1 or self.start < 0 or \
                self.start + (self.count - 1) * self.step >= slice_shape[self.axis]:
            raise CheckpointFormatError(f"cut {self} does not fit a slice of shape {list(slice_shape)}")
        shape = list(slice_shape)
        shape[self.axis] = self.count
        if self.transpose:
            if len(shape) != 2:
                raise CheckpointFormatError(f"only 2-D slices can be transposed, got shape {shape}")
            shape.reverse()
        return tuple(shape)

    @property
    def contiguous(self) -> bool:
        """True when the cut is one byte range of S (rows of the leading axis, in order)."""
        return self.axis == 0 and (self.step == 1 or self.count == 1) and not self.transpose

    def to_json(self) -> dict:
        return {"axis": self.axis, "start": self.start, "step": self.step, "count": self.count,
                "transpose": self.transpose}

    @classmethod
    def from_json(cls, raw: dict) -> "Cut":
        try:
            fields = {k: raw[k] for k in ("axis", "start", "step", "count", "transpose")}
        except (KeyError, TypeError):
            raise CheckpointFormatError(f"malformed cut record {raw!r:.120}") from None
        if not all(isinstance(fields[k], int) and not isinstance(fields[k], bool)
                   for k in ("axis", "start", "step", "count")) or not isinstance(fields["transpose"], bool):
            raise CheckpointFormatError(f"malformed cut record {raw!r:.120}")
        return cls(**fields)


@dataclass(frozen=True)
class Piece:
    """One tensor of an output shard and where its bytes come from."""

    name: str                    # name inside the output shard
    dtype: str
    shape: tuple[int, ...]       # output shape
    source: TensorInfo           # the source tensor (the fused one for fused pieces)
    file: str                    # source file, relative to the checkpoint directory
    expert: int | None = None    # fused pieces: index along the source's leading axis
    cut: Cut | None = None
    # split --quantize: (method, part) when this tensor is computed from the float source tensor rather than
    # copied: part "data" (`weight` I8 / `weight_q4` U8) or "scale" (`weight_scale` F16); see _quantize.py
    quant: tuple[str, str] | None = None

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]

    def byte_range(self) -> tuple[int, int] | None:
        """(absolute offset, length) in the source file when the bytes are one run, else None."""
        src = self.source
        if self.quant is not None:
            return None
        if self.cut is None:
            return src.start, src.nbytes
        if not self.cut.contiguous:
            return None
        slice_bytes = src.nbytes // src.shape[0]
        row_bytes = slice_bytes // src.shape[1] if src.shape[1] else 0
        return src.start + self.expert * slice_bytes + self.cut.start * row_bytes, self.nbytes

    def slice_range(self) -> tuple[int, int]:
        """(absolute offset, length) of the whole per-expert slice S this piece is cut from."""
        slice_bytes = self.source.nbytes // self.source.shape[0]
        return self.source.start + self.expert * slice_bytes, slice_bytes


@dataclass(frozen=True)
class ShardPlan:
    """One output file: its manifest identity and the tensors it holds, in write order."""

    path: str
    kind: str
    layer: int | None
    expert: int | None
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class OutputFile:
    """A file split will write: a shard (header + pieces) or a side file copied whole (`copy_from`)."""

    path: str
    kind: str
    layer: int | None
    expert: int | None
    header: bytes            # b"" for side files
    pieces: tuple[Piece, ...]
    copy_from: str | None    # side files: name in the checkpoint directory
    size: int


def uint_view(dtype: str) -> np.dtype:
    """An unsigned integer dtype of the same width: cutting and pasting only moves bytes."""
    import numpy as np

    return np.dtype(f"<u{DTYPE_SIZES[dtype]}") if DTYPE_SIZES[dtype] > 1 else np.dtype("u1")


def cut(slice_bytes: bytes | memoryview, dtype: str, slice_shape: tuple[int, ...], c: Cut) -> np.ndarray:
    """S bytes -> the canonical tensor (C-contiguous, same-width uint dtype)."""  # S -> out_shape(S)
    import numpy as np

    s = np.frombuffer(slice_bytes, dtype=uint_view(dtype)).reshape(slice_shape)
    index = [slice(None)] * len(slice_shape)
    index[c.axis] = slice(c.start, c.start + c.count * c.step, c.step)
    part = s[tuple(index)]
    return np.ascontiguousarray(part.T if c.transpose else part)


def paste(target: np.ndarray, cover: np.ndarray, data: bytes | memoryview, c: Cut) -> None:
    """Inverse of `cut`: write a canonical tensor back into S (uint view), counting coverage."""
    import numpy as np

    out_shape = c.out_shape(target.shape)
    part = np.frombuffer(data, dtype=target.dtype).reshape(out_shape)
    if c.transpose:
        part = part.T
    index = [slice(None)] * target.ndim
    index[c.axis] = slice(c.start, c.start + c.count * c.step, c.step)
    target[tuple(index)] = part
    cover[tuple(index)] += 1
