"""Fuzzing the strict safetensors parser (split reads untrusted checkpoints with it; the runtime parses
verified shards with it): random bytes, mutated genuine files, and headers with hostile shapes and offsets.

Contract: only ShardtoolError subclasses (CheckpointFormatError) escape; an accepted file's tensors tile the
data buffer exactly and every array has the shape and dtype the header claims.
"""

from __future__ import annotations

import json
import struct
from math import prod

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save as st_save

from _fuzzkit import INT64, mutated, only_our_errors
from shardtool.checkpoint import DTYPE_SIZES, parse_header, parse_safetensors
from shardtool.errors import ShardtoolError

GENUINE = st_save({"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int16),
                   "c": np.zeros((2, 0, 3), np.float16)}, metadata={"k": "v"})
DTYPES = st.sampled_from(sorted(DTYPE_SIZES)) | st.text(max_size=6)
DIMS = st.integers(-2, 9) | st.sampled_from([0, 2**31, 2**32, 2**40, 2**53, 2**62, 2**63, 2**64])


def _header_of(data: bytes) -> dict | None:
    try:
        (n,) = struct.unpack("<Q", data[:8])
        h = json.loads(data[8:8 + n])
        return h if isinstance(h, dict) else None
    except Exception:  # noqa: BLE001 - only deciding whether the known bug applies
        return None


def _parse(data: bytes):
    got = only_our_errors(parse_safetensors, data)
    if not isinstance(got, ShardtoolError):
        arrays, _ = got
        header = parse_header(data[8:8 + struct.unpack("<Q", data[:8])[0]], file_size=len(data))
        assert sum(t.nbytes for t in header.tensors) == len(data) - header.data_start
        for t in header.tensors:
            assert arrays[t.name].shape == t.shape and arrays[t.name].nbytes == t.nbytes
    return got


@given(st.binary(max_size=512))
def test_fuzz_safetensors_random_bytes(data):
    _parse(data)


@given(mutated(GENUINE, max_ops=3))
def test_fuzz_safetensors_mutated_genuine(data):
    _parse(data)


_TENSOR = st.fixed_dictionaries(
    {"dtype": DTYPES, "shape": st.lists(DIMS, max_size=4) | INT64 | st.none(),
     "data_offsets": st.lists(st.integers(-2, 200) | st.sampled_from([2**63, 2**64]), max_size=3) | st.none()},
    optional={"extra": st.integers()})


@given(st.dictionaries(st.text(max_size=8), _TENSOR | st.integers() | st.text(max_size=3), max_size=5),
       st.integers(0, 200), st.sampled_from([None, {"k": "v"}, {"k": 1}, "x"]), st.integers(-8, 8))
def test_fuzz_safetensors_hostile_header(tensors, body_len, metadata, length_skew):
    doc = dict(tensors)
    if metadata is not None:
        doc["__metadata__"] = metadata
    header = json.dumps(doc).encode()
    data = struct.pack("<Q", max(len(header) + length_skew, 0)) + header + bytes(body_len)
    _parse(data)


@given(st.lists(st.tuples(st.sampled_from(["F32", "I8", "BF16", "F8_E4M3", "U64"]), st.lists(st.integers(0, 5),
                                                                                            max_size=3)),
                min_size=1, max_size=4), st.integers(-3, 3))
def test_fuzz_safetensors_consistent_headers(specs, skew):
    """Well-formed headers laid out back to back, with the body skewed by a few bytes: the parser accepts
    exactly the unskewed ones."""
    doc, offset = {}, 0
    for i, (dtype, shape) in enumerate(specs):
        n = prod(shape) * DTYPE_SIZES[dtype]
        doc[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(doc).encode()
    data = struct.pack("<Q", len(header)) + header + bytes(max(offset + skew, 0))
    got = _parse(data)
    assert isinstance(got, ShardtoolError) == (max(offset + skew, 0) != offset)


def test_fuzz_safetensors_zero_size_huge_shape():
    """A zero-size tensor of shape [2**62, 0] once passed the header checks and numpy's reshape raised."""
    header = json.dumps({"z": {"dtype": "F32", "shape": [2**62, 0], "data_offsets": [0, 0]}}).encode()
    got = only_our_errors(parse_safetensors, struct.pack("<Q", len(header)) + header)
    assert isinstance(got, ShardtoolError) and "invalid shape" in str(got)
