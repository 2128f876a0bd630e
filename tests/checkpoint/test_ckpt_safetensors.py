"""The strict safetensors parser and writer agree with the reference implementation and refuse malformed headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.checkpoint import (TensorSpec, encode_header, numpy_dtype, parse_header,
                                  parse_safetensors, read_header)
from shardtool.safetensors_format import MAX_HEADER_BYTES
from shardtool.errors import CheckpointFormatError

from ckpt_helpers import serialize

ARRAYS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "f16": np.linspace(-2, 2, 6, dtype=np.float16).reshape(2, 3),
    "bf16": np.linspace(-1, 1, 10, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(5, 2),
    "fp8_e4m3": np.linspace(-8, 8, 16, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).reshape(4, 4),
    "fp8_e5m2": np.linspace(-8, 8, 4, dtype=np.float32).astype(ml_dtypes.float8_e5m2),
    "i64": np.array([-1, 2**40], dtype=np.int64),
    "u8": np.arange(7, dtype=np.uint8),
    "bool": np.array([True, False, True]),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "scalar": np.array(3.5, dtype=np.float64),
}


def _file(header: bytes | dict, data: bytes = b"", *, length: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def _t(dtype: str = "F32", shape: list | None = None, offsets: list | None = None) -> dict:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": [0, 8] if offsets is None else offsets}


# Named malformed files. Each must be refused with CheckpointFormatError, by path and by bytes.
MALFORMED = {
    "shorter-than-length-prefix": b"\x01\x00\x00",
    "header-length-over-cap": struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",
    "header-length-past-eof": _file(b"{}", length=50),
    "header-length-zero": _file(b"", length=0),
    "header-not-an-object": _file(b"[1, 2]"),
    "header-leading-space": _file(b' {"a": 1}'),
    "header-not-utf8": _file(b'{"\xff": 1}'),
    "header-not-json": _file(b'{"a": '),
    "header-nan": _file(b'{"a": NaN}'),
    "duplicate-tensor-name": _file(b'{"a":' + json.dumps(_t()).encode() + b',"a":'
                                   + json.dumps(_t(offsets=[8, 16])).encode() + b"}", bytes(16)),
    "duplicate-key-inside-spec": _file(b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
                                       bytes(8)),
    "unknown-dtype": _file({"a": _t(dtype="Q4_K")}, bytes(8)),
    "sub-byte-dtype": _file({"a": _t(dtype="F4")}, bytes(8)),
    "dtype-not-string": _file({"a": _t(dtype=4)}, bytes(8)),
    "spec-missing-offsets": _file({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
    "spec-extra-key": _file({"a": {**_t(), "offset": 0}}, bytes(8)),
    "spec-not-object": _file({"a": [1, 2]}, bytes(8)),
    "negative-dimension": _file({"a": _t(shape=[-2])}, bytes(8)),
    "bool-dimension": _file({"a": _t(shape=[True, 2])}, bytes(8)),
    "float-dimension": _file({"a": _t(shape=[2.0])}, bytes(8)),
    "rank-too-high": _file({"a": _t(shape=[1] * 17 + [2])}, bytes(8)),
    "offsets-three-numbers": _file({"a": _t(offsets=[0, 4, 8])}, bytes(8)),
    "offsets-reversed": _file({"a": _t(offsets=[8, 0])}, bytes(8)),
    "offsets-not-matching-shape": _file({"a": _t(shape=[3])}, bytes(8)),
    "huge-shape-vs-small-offsets": _file({"a": _t(shape=[2**62, 2**62])}, bytes(8)),
    "overlapping-tensors": _file({"a": _t(offsets=[0, 8]), "b": _t(offsets=[4, 12])}, bytes(12)),
    "gap-between-tensors": _file({"a": _t(offsets=[0, 8]), "b": _t(offsets=[12, 20])}, bytes(20)),
    "gap-before-first-tensor": _file({"a": _t(offsets=[4, 12])}, bytes(12)),
    "data-beyond-end-of-file": _file({"a": _t(shape=[4], offsets=[0, 16])}, bytes(8)),
    "trailing-undescribed-bytes": _file({"a": _t()}, bytes(12)),
    "metadata-non-string-value": _file({"__metadata__": {"format": 1}, "a": _t()}, bytes(8)),
    "metadata-not-object": _file({"__metadata__": "pt", "a": _t()}, bytes(8)),
    "empty-tensor-name": _file({"": _t()}, bytes(8)),
    "deeply-nested": _file(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_refused(case: str, tmp_path: Path, raises_exactly) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(MALFORMED[case])
    with raises_exactly(CheckpointFormatError) as info:
        read_header(path)
    assert info.value.path == str(path)
    with raises_exactly(CheckpointFormatError):
        parse_safetensors(MALFORMED[case])


# Where we are deliberately stricter than the reference reader, and why.
STRICTER = {
    "empty-tensor-name": "an empty name cannot be mapped to a module and only serves to confuse",
    "rank-too-high": "no model tensor has rank > 16; a huge rank only costs the parser",
    "spec-extra-key": "an unknown field in untrusted input is refused, never silently ignored",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_reference_implementation_agrees_except_where_we_are_stricter(case: str) -> None:
    if case in STRICTER:
        safetensors.deserialize(MALFORMED[case])  # accepted there: the difference is pinned, not assumed
    else:
        with pytest.raises(safetensors.SafetensorError):
            safetensors.deserialize(MALFORMED[case])


def test_parser_agrees_with_reference_on_valid_file(tmp_path: Path) -> None:
    data = safetensors.numpy.save(ARRAYS, metadata={"format": "pt", "note": "é"})
    arrays, metadata = parse_safetensors(data)
    assert dict(metadata) == {"format": "pt", "note": "é"}
    reference = {name: t for name, t in safetensors.deserialize(data)}
    assert set(arrays) == set(reference) == set(ARRAYS)
    for name, arr in arrays.items():
        assert arr.dtype == ARRAYS[name].dtype and arr.shape == ARRAYS[name].shape
        assert arr.tobytes() == bytes(reference[name]["data"]) == ARRAYS[name].tobytes()
        assert not arr.flags.writeable
    path = tmp_path / "a.safetensors"
    path.write_bytes(data)
    header = read_header(path)
    assert {t.name: (t.dtype, t.shape) for t in header.tensors} == {
        n: (t["dtype"], tuple(t["shape"])) for n, t in reference.items()}
    assert header.file_size == len(data)


def test_writer_output_reads_back_identically_in_reference_implementation(tmp_path: Path) -> None:
    items = [(TensorSpec(n, _st_dtype(a), a.shape), a.tobytes()) for n, a in ARRAYS.items()]
    data = serialize(items, {"k": "v"})
    # safetensors.numpy.load_file knows numpy's own dtypes only, so it reads a file without BF16/FP8.
    plain = {n: a for n, a in ARRAYS.items() if n not in ("bf16", "fp8_e4m3", "fp8_e5m2")}
    path = tmp_path / "ours.safetensors"
    path.write_bytes(serialize([(TensorSpec(n, _st_dtype(a), a.shape), a.tobytes()) for n, a in plain.items()],
                               {"k": "v"}))
    loaded = safetensors.numpy.load_file(path)
    for name, arr in plain.items():
        assert loaded[name].dtype == arr.dtype and loaded[name].shape == arr.shape
        assert np.array_equal(loaded[name], arr)
    with safetensors.safe_open(path, framework="np") as f:
        assert f.metadata() == {"k": "v"}
    for name, t in safetensors.deserialize(data):  # every dtype, including BF16 and FP8
        assert (t["dtype"], tuple(t["shape"]), bytes(t["data"])) == (_st_dtype(ARRAYS[name]), ARRAYS[name].shape,
                                                                     ARRAYS[name].tobytes())


def test_writer_matches_reference_bytes_in_reference_order() -> None:
    """Same tensors in the same data order: our header encoding is byte-identical to the Rust writer's."""
    reference = safetensors.numpy.save(ARRAYS, metadata={"format": "pt"})
    header = parse_header(reference[8:8 + struct.unpack("<Q", reference[:8])[0]], file_size=len(reference))
    ours = serialize([(TensorSpec(t.name, t.dtype, t.shape), reference[t.start:t.end]) for t in header.tensors],
                     {"format": "pt"})
    assert ours == reference


def test_header_is_padded_to_eight_bytes() -> None:
    for n in range(1, 12):
        header = encode_header([TensorSpec("x" * n, "U8", (1,))])
        assert len(header) % 8 == 0


def test_numpy_dtype_refuses_unknown(raises_exactly) -> None:
    with raises_exactly(CheckpointFormatError):
        numpy_dtype("F4")


def _st_dtype(arr: np.ndarray) -> str:
    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
             "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32", "uint8": "U8", "bool": "BOOL",
             "float64": "F64"}
    return names[arr.dtype.name]


_DTYPES = [np.float32, np.float16, np.int32, np.uint8, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12).filter(
        lambda s: s != "__metadata__"),
    st.tuples(st.sampled_from(range(len(_DTYPES))), st.lists(st.integers(0, 4), max_size=3)),
    max_size=6))
def test_round_trip_property(spec: dict) -> None:
    arrays = {name: (np.arange(int(np.prod(shape)), dtype=np.float32) % 7).astype(_DTYPES[d]).reshape(shape)
              for name, (d, shape) in spec.items()}
    reference = safetensors.numpy.save(arrays)
    parsed, _ = parse_safetensors(reference)
    assert {n: a.tobytes() for n, a in parsed.items()} == {n: a.tobytes() for n, a in arrays.items()}
    ours = serialize([(TensorSpec(n, _st_dtype(a), a.shape), a.tobytes()) for n, a in arrays.items()])
    back = {n: (t["dtype"], tuple(t["shape"]), bytes(t["data"])) for n, t in safetensors.deserialize(ours)}
    assert back == {n: (_st_dtype(a), a.shape, a.tobytes()) for n, a in arrays.items()}
