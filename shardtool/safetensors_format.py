"""Strict safetensors parsing, shared by the producer (split, join) and the runtime: a header parser for
untrusted files and a parser for whole verified shards. (Writing shards is the producer's: checkpoint.)

Format (safetensors README, "Format"): 8-byte little-endian header length N, N bytes of UTF-8 JSON, then
the data buffer. Every tensor's `data_offsets` are relative to the buffer; together they must tile it
exactly, as the reference Rust implementation requires.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from shardtool.errors import CheckpointFormatError, StorageError
from shardtool.strict_json import reject_json_constant, strict_json_object

if TYPE_CHECKING:  # imported where arrays are built: reading headers needs no numpy
    import numpy as np

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own cap
MAX_TENSORS = 1_000_000
MAX_RANK = 16
MAX_NAME_BYTES = 1024
METADATA_KEY = "__metadata__"

# safetensors dtype name -> element size in bytes. Sub-byte types (F4, F6_*) are not supported.
DTYPE_SIZES: Mapping[str, int] = MappingProxyType({
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
})


def numpy_dtype(dtype: str) -> np.dtype:
    """The little-endian numpy dtype for a safetensors dtype name (ml_dtypes for BF16 and FP8)."""
    table = _dtype_table()
    if dtype not in table:
        raise CheckpointFormatError(f"unsupported dtype {dtype!r}")
    return table[dtype]


@functools.cache
def _dtype_table() -> Mapping[str, np.dtype]:
    """Built once (numpy and ml_dtypes are imported at first use): every shard the runtime loads asks for it."""
    import ml_dtypes
    import numpy as np

    return MappingProxyType({
        "BOOL": np.dtype(np.bool_), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
        "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"),
        "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
        "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
        "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    })


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; `start`/`end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A parsed, validated header. `tensors` are in data order; `data_start` = 8 + N."""

    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str] | None
    data_start: int
    file_size: int

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise CheckpointFormatError(f"{what} must be a list of integers, got {value!r:.80}")
    return value


def parse_header(header: bytes, *, file_size: int) -> Header:
    """Validate the JSON header of a file of `file_size` bytes (header = the N bytes after the length)."""
    data_start = 8 + len(header)
    if data_start > file_size:
        raise CheckpointFormatError(f"header of {len(header)} bytes does not fit in a {file_size}-byte file")
    if not header.startswith(b"{"):
        raise CheckpointFormatError("header does not start with '{'")
    try:
        text = header.decode("utf-8")
        raw = json.loads(text, object_pairs_hook=strict_json_object, parse_constant=reject_json_constant)
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"header is not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"header is not JSON: {e.msg} at byte {e.pos}") from None
    except RecursionError:
        raise CheckpointFormatError("header JSON is nested too deeply") from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"header must be a JSON object, got {type(raw).__name__}")

    metadata = raw.pop(METADATA_KEY, None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            raise CheckpointFormatError("__metadata__ must map strings to strings")
        metadata = MappingProxyType(metadata)
    if len(raw) > MAX_TENSORS:
        raise CheckpointFormatError(f"header lists {len(raw)} tensors, more than {MAX_TENSORS}")

    tensors = [_tensor(name, spec, data_start) for name, spec in raw.items()]
    # Sort by (start, end) so zero-size tensors sit before a real tensor at the same offset.
    tensors.sort(key=lambda t: (t.start, t.end))
    cursor = data_start
    for t in tensors:
        if t.start != cursor:
            what = "overlaps the previous tensor" if t.start < cursor else "leaves a gap before it"
            raise CheckpointFormatError(f"tensor {t.name!r} at offset {t.start - data_start} {what} "
                                        f"(expected offset {cursor - data_start})")
        cursor = t.end
    if cursor != file_size:
        if cursor > file_size:
            raise CheckpointFormatError(f"tensor data ends at byte {cursor}, beyond the end of the "
                                        f"{file_size}-byte file (truncated?)")
        raise CheckpointFormatError(f"{file_size - cursor} bytes after the last tensor are not described "
                                    "by the header")
    return Header(tuple(tensors), metadata, data_start, file_size)


MAX_ELEMENTS = 2**50  # elements per tensor: far above any real tensor, far below numpy's int64 limits


def _tensor(name: str, spec: Any, data_start: int) -> TensorInfo:
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise CheckpointFormatError(f"tensor name {name[:64]!r} is empty or longer than {MAX_NAME_BYTES} bytes")
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        keys = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise CheckpointFormatError(f"tensor {name!r} must have exactly dtype, shape, data_offsets; got {keys}")
    dtype = spec["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CheckpointFormatError(f"tensor {name!r} has unknown dtype {dtype!r:.40} "
                                    f"(supported: {', '.join(DTYPE_SIZES)})")
    shape = _int_list(spec["shape"], f"tensor {name!r} shape")
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise CheckpointFormatError(f"tensor {name!r} has an invalid shape {shape!r:.80}")
    # A zero-size tensor of shape [2^62, 0] matches its empty byte range, yet numpy cannot build that
    # shape: the product of the non-zero dimensions must stay far inside int64 as well.
    if prod(d for d in shape if d) > MAX_ELEMENTS:
        raise CheckpointFormatError(f"tensor {name!r} has an invalid shape {shape!r:.80} "
                                    f"(more than 2^50 elements along its non-zero dimensions)")
    offsets = _int_list(spec["data_offsets"], f"tensor {name!r} data_offsets")
    if len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise CheckpointFormatError(f"tensor {name!r} has invalid data_offsets {offsets!r:.80}")
    nbytes = prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointFormatError(f"tensor {name!r}: {dtype}{shape} needs {nbytes} bytes but data_offsets "
                                    f"span {offsets[1] - offsets[0]}")
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def header_length(prefix: bytes, file_size: int) -> int:
    if len(prefix) < 8:
        raise CheckpointFormatError(f"file of {file_size} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n < 2:
        raise CheckpointFormatError(f"header length {n} is too small for a JSON object")
    if 8 + n > file_size:
        raise CheckpointFormatError(f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def read_header_fd(fd: int, where: str) -> Header:
    """`read_header` for a file already open (split opens checkpoint files through its own safe open)."""
    try:
        size = os.fstat(fd).st_size
        n = header_length(_pread_exact(fd, 8, 0), size)
        header = _pread_exact(fd, n, 8)
        if len(header) != n:
            raise CheckpointFormatError("file shrank while its header was read")
        return parse_header(header, file_size=size)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(e.message, path=where, hint=e.hint) from None
    except OSError as e:
        raise StorageError(f"cannot read: {e.strerror or e}", path=where) from e


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes at `offset`; fewer only at end of file."""
    parts, got = [], 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class HeaderMemo:
    """Headers already parsed, by their exact bytes and file size: a shard read again (evicted from a cache, then
    needed again) skips the JSON and its checks, which cost about as much as hashing a quarter of a small expert.

    Sound because `parse_header` is a pure function of those two: a remembered `Header` (frozen, its metadata a
    read-only view) is what parsing the same bytes again would return, and an error is never remembered. Bounded:
    the objects it keeps (`cost`: the key's bytes and every object of the parsed header) stay at most `max_bytes`,
    least recently used dropped first; a header costing over 1/64 of the bound is parsed every time. Thread-safe (a
    store's reader threads share one)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0
        self._lock = threading.Lock()
        self._headers: OrderedDict[tuple[bytes, int], tuple[Header, int]] = OrderedDict()

    @staticmethod
    def cost(header: bytes, parsed: Header) -> int:
        """Bytes held for one remembered header, an upper bound: Python's own sizes of the key and of the strings,
        containers and numbers of the parsed header (each object's allocator rounding included)."""
        size = _held(header) + _ENTRY_BYTES + _held(parsed.tensors)
        for t in parsed.tensors:
            size += _TENSOR_BYTES + _held(t.name) + _held(t.dtype) + _held(t.shape) + _INT_BYTES * (len(t.shape) + 2)
        if parsed.metadata is not None:
            size += _held(dict(parsed.metadata)) + sum(_held(k) + _held(v) for k, v in parsed.metadata.items())
        return size

    def parse(self, header: bytes, *, file_size: int) -> Header:
        key = (header, file_size)
        with self._lock:
            hit = self._headers.get(key)
            if hit is not None:
                self._headers.move_to_end(key)
                return hit[0]
        parsed = parse_header(header, file_size=file_size)
        cost = self.cost(header, parsed)
        if cost * 64 <= self.max_bytes:
            with self._lock:
                if key not in self._headers:
                    self._headers[key] = (parsed, cost)
                    self.used += cost
                    while self.used > self.max_bytes:
                        _, (_, dropped) = self._headers.popitem(last=False)
                        self.used -= dropped
        return parsed


def _held(obj: object) -> int:
    """`sys.getsizeof(obj)` rounded up to the allocator's 16-byte blocks, plus a block of slack."""
    return (sys.getsizeof(obj) + 31) // 16 * 16


# Per remembered header: the key tuple, the file size, the memo's entry (ordered-dict node, value tuple, cost) and
# the Header with its __dict__ and metadata view. Per tensor: the TensorInfo with its __dict__. Per number: an int.
_ENTRY_BYTES = 640
_TENSOR_BYTES = 384
_INT_BYTES = 48


def parse_safetensors(data: bytes | bytearray | memoryview, *, headers: HeaderMemo | None = None
                      ) -> tuple[dict[str, np.ndarray], Mapping[str, str] | None]:
    """Parse a whole file held in memory (already verified) into zero-copy, read-only numpy views. `headers`:
    where a header parsed before is found (its views are made again on these bytes)."""
    import numpy as np

    view = memoryview(data).cast("B")
    n = header_length(bytes(view[:8]), len(view))
    raw = bytes(view[8:8 + n])
    header = headers.parse(raw, file_size=len(view)) if headers is not None else parse_header(raw, file_size=len(view))
    arrays: dict[str, np.ndarray] = {}
    for t in header.tensors:
        arr = np.frombuffer(view[t.start:t.end], dtype=numpy_dtype(t.dtype)).reshape(t.shape)
        arr.flags.writeable = False
        arrays[t.name] = arr
    return arrays, header.metadata




def read_header(path: str | os.PathLike) -> Header:
    """Read and validate only the header of a regular file (through the one safe-open); the tensor bytes
    are not touched."""
    from shardtool.safeio import open_regular

    fd = open_regular(path)
    try:
        return read_header_fd(fd, str(path))
    finally:
        os.close(fd)
