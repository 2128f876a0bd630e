"""The decode step's cheap forms of the rotary and routing helpers give exactly the values of their plain
definitions (bit for bit), on one row and on several, contiguous or strided."""

from __future__ import annotations

import numpy as np
import pytest

from shardtool.runtime.model._layers import _top_k, expert_groups, picked
from shardtool.runtime.model._rope import apply_rope, cos_sin


def _rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """transformers' x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1)"""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("t, h, d", [(1, 8, 64), (1, 2, 16), (5, 3, 8), (3, 1, 128)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("scaling", [1.0, 1.2345])
def test_apply_rope_equals_rotate_half_bit_for_bit(t, h, d, strided, scaling):
    rng = np.random.default_rng(d + t)
    x = rng.standard_normal((t, h, d + 5)).astype(np.float32)
    x = x[..., 3:3 + d] if strided else np.ascontiguousarray(x[..., :d])
    x[0, 0, :2] = 0.0
    x[0, -1, -2:] = -0.0
    x[-1, 0, d // 2] = np.inf
    cos, sin = cos_sin(rng.random(d // 2).astype(np.float32), scaling, np.arange(t) + 17)
    with np.errstate(invalid="ignore"):
        expected, got = _rope_reference(x, cos, sin), apply_rope(x, cos, sin)
    assert got.dtype == np.float32 and got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("freqs_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scaling", [1.0, 0.7, 1.2345678])
def test_cos_sin_equals_scaled_table_bit_for_bit(freqs_dtype, scaling):
    freqs = np.random.default_rng(3).random(16).astype(freqs_dtype)
    positions = np.arange(0, 3000, 7)
    angles = positions.astype(np.float32)[:, None] * freqs[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = cos_sin(freqs, scaling, positions)
    for got, f in ((cos, np.cos), (sin, np.sin)):
        assert got.dtype == np.float32
        assert got.tobytes() == (f(emb) * np.float32(scaling)).astype(np.float32).tobytes()


def test_one_row_routing_equals_the_batch_path():
    rng = np.random.default_rng(5)
    scores = rng.random((6, 16)).astype(np.float32)
    scores[2, 3] = scores[2, 9]  # a tie
    idx = _top_k(scores, 4)
    assert idx.tolist() == np.argpartition(-scores, 3, axis=-1)[:, :4].tolist()
    for r in range(len(scores)):
        row, ids = scores[r:r + 1], idx[r:r + 1]
        assert picked(row, ids).tobytes() == np.take_along_axis(row, ids, axis=1).tobytes()
        one = expert_groups(ids)
        assert list(one) == sorted(ids[0].tolist())
        for e, (tokens, slots) in one.items():  # the general path's (rows, slots), as np.nonzero gives them
            want_tokens, want_slots = np.nonzero(ids == e)
            assert tokens.tolist() == want_tokens.tolist() and slots.tolist() == want_slots.tolist()
    assert picked(scores, idx).tobytes() == np.take_along_axis(scores, idx, axis=1).tobytes()
