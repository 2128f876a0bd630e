"""Writing safetensors shards (the producer's side): header encoding in the reference writer's form, and a
hasher that overlaps BLAKE3 with the writer's next step. Parsing lives in `shardtool.safetensors_format`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from typing import Any, Mapping, Sequence

from shardtool.errors import CheckpointFormatError
from shardtool.safetensors_format import DTYPE_SIZES, METADATA_KEY


@dataclass(frozen=True)
class TensorSpec:
    """What the writer needs to lay out one tensor before its bytes arrive."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]


def encode_header(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """Length prefix + JSON header for tensors stored in the given order.

    Same form as the reference writer (compact JSON, `__metadata__` first, tensors in data order, space
    padding to a multiple of 8), so a file it wrote and a file we rebuild from its tensors match byte
    for byte when the order is the same.
    """
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc[METADATA_KEY] = dict(metadata)
    offset = 0
    for spec in specs:
        if spec.name in doc:
            raise CheckpointFormatError(f"tensor {spec.name!r} would be written twice")
        if spec.dtype not in DTYPE_SIZES:
            raise CheckpointFormatError(f"tensor {spec.name!r} has unsupported dtype {spec.dtype!r}")
        end = offset + spec.nbytes
        doc[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


class OverlappedHasher:
    """BLAKE3 of a stream of chunks. With an executor, hashing a chunk overlaps with whatever the caller does
    next (BLAKE3 releases the GIL); the caller keeps a chunk's buffer unchanged until the next `update` or
    `digest`, which wait for its hash."""

    PARALLEL_MIN = 1 << 20

    def __init__(self, executor: Any = None):
        import blake3

        self._hash = blake3.blake3()
        self._executor = executor
        self._pending: Any = None

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._wait()
        if self._executor is not None and len(data) >= self.PARALLEL_MIN:
            self._pending = self._executor.submit(self._hash.update, data)
        else:
            self._hash.update(data)

    def digest(self) -> bytes:
        self._wait()
        return self._hash.digest()
