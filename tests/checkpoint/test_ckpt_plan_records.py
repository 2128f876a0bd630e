"""Cutting a fused expert slice into canonical tensors and pasting them back is an exact byte permutation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.checkpoint._plan_records import Cut, cut, paste, uint_view
from shardtool.errors import CheckpointFormatError


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 6), axis=st.integers(0, 1), interleaved=st.booleans(),
       transpose=st.booleans(), dtype=st.sampled_from(["U8", "BF16", "F32", "F64"]))
def test_gate_up_partition_round_trips(rows: int, cols: int, axis: int, interleaved: bool, transpose: bool,
                                       dtype: str) -> None:
    shape = [rows, cols]
    shape[axis] *= 2  # the fused gate+up axis
    shape = tuple(shape)
    width = np.dtype(uint_view(dtype)).itemsize
    data = np.random.default_rng(rows * 7 + cols).integers(0, 255, int(np.prod(shape)) * width, dtype=np.uint8).tobytes()
    half = shape[axis] // 2
    cuts = ([Cut(axis, 0, 2, half, transpose), Cut(axis, 1, 2, half, transpose)] if interleaved
            else [Cut(axis, 0, 1, half, transpose), Cut(axis, half, 1, half, transpose)])
    target = np.zeros(shape, dtype=uint_view(dtype))
    cover = np.zeros(shape, dtype=np.uint8)
    for c in cuts:
        part = cut(data, dtype, shape, c)
        assert part.shape == c.out_shape(shape) and part.flags.c_contiguous
        paste(target, cover, part.tobytes(), c)
    assert (cover == 1).all()
    assert target.tobytes() == data


@pytest.mark.parametrize("c,shape", [(Cut(2, 0, 1, 1), (4, 4)), (Cut(0, 3, 1, 2), (4, 4)), (Cut(0, 0, 0, 1), (4,)),
                                     (Cut(0, 0, 1, 0), (4,)), (Cut(0, 0, 2, 3), (4,)), (Cut(0, 0, 1, 1, True), (4,))],
                         ids=["axis-out-of-range", "past-the-end", "zero-step", "zero-count", "strided-past-end",
                              "transpose-1d"])
def test_bad_cut_is_refused(c: Cut, shape: tuple, raises_exactly) -> None:
    with raises_exactly(CheckpointFormatError):
        c.out_shape(shape)


@pytest.mark.parametrize("raw", [{}, {"axis": 0, "start": 0, "step": 1, "count": 1}, {"axis": True, "start": 0,
                                 "step": 1, "count": 1, "transpose": False},
                                 {"axis": 0, "start": 0, "step": 1, "count": 1, "transpose": 0}, [1, 2]],
                         ids=["empty", "no-transpose", "bool-axis", "int-transpose", "list"])
def test_malformed_cut_record_is_refused(raw, raises_exactly) -> None:
    with raises_exactly(CheckpointFormatError):
        Cut.from_json(raw)
