"""The fused native steps (`_fused`: RMSNorm, one-row attention, the SwiGLU expert) against their numpy definitions in
`_layers` (run with the extension switched off): every stored kind, a KV cache's strided views, both instruction
sets; hostile arguments refused with an exception, never read out of bounds."""

from __future__ import annotations

import numpy as np
import pytest

from shardtool.runtime._model import _fused, _layers, _packed

_kernels = pytest.importorskip("shardtool.runtime._model._kernels", reason="the extension is not built (optional)")
from _isa import isa  # noqa: E402,F401  (the fixture: AVX2 and plain C kernels)


def reference(monkeypatch, fn, *args):
    """`fn(*args)` with the extension off: the numpy definitions."""
    with monkeypatch.context() as m:
        m.setattr(_packed, "_native", None)
        return fn(*args)


def close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


@pytest.mark.parametrize("shape", [(1, 64), (3, 512), (2, 4, 16)])
def test_rms_norm_matches_numpy(isa, monkeypatch, shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    assert _fused.rms_norm(x, w, 1e-5) is not None
    close(_layers.rms_norm(x, w, 1e-5), reference(monkeypatch, _layers.rms_norm, x, w, 1e-5), 1e-6)


def test_rms_norm_takes_only_plain_float32():
    x = np.ones((2, 8), np.float32)
    assert _fused.rms_norm(x[:, ::2], np.ones(4, np.float32), 1e-6) is None  # a strided view: numpy's path
    assert _fused.rms_norm(x.astype(np.float64), np.ones(8), 1e-6) is None
    assert _fused.rms_norm(x, np.ones(4, np.float32), 1e-6) is None  # shapes do not match


@pytest.mark.parametrize("nh,kvh,d,positions", [(8, 2, 64, 1), (8, 2, 64, 37), (4, 4, 32, 5), (6, 1, 16, 200)])
def test_attention_row_on_cache_views_matches_numpy(isa, monkeypatch, nh, kvh, d, positions):
    """Keys and values as the KV cache hands them out: [kvh, S, d] views of a longer buffer (heads strided)."""
    rng = np.random.default_rng(2)
    cache = np.empty((kvh, positions + 9, 2 * d), np.float32)  # capacity beyond S, k and v halves side by side
    cache[...] = rng.standard_normal(cache.shape)
    k, v = cache[:, :positions, :d], cache[:, :positions, d:]
    kc, vc = np.ascontiguousarray(cache[:, :positions, :d]), np.ascontiguousarray(cache[:, :positions, d:])
    q = rng.standard_normal((1, nh, d)).astype(np.float32)
    assert _fused.attend_row(q, k, v, 0.125) is None  # rows of k and v interleaved: not a cache view, numpy's path
    with pytest.raises(ValueError, match="contiguous rows"):  # and the kernel itself refuses it
        _kernels.attend_row(q, k, v, 0.125, np.empty((1, nh, d), np.float32))
    want = reference(monkeypatch, _layers.attention, q, kc, vc, 0.125, None)
    close(_layers.attention(q, kc, vc, 0.125, None), want, 2e-6)
    # a cache's views: [kvh, capacity, d] buffers sliced to S positions
    kbuf = np.zeros((kvh, positions + 9, d), np.float32)
    vbuf = np.zeros((kvh, positions + 9, d), np.float32)
    kbuf[:, :positions], vbuf[:, :positions] = kc, vc
    close(_fused.attend_row(q, kbuf[:, :positions], vbuf[:, :positions], 0.125), want, 2e-6)


def test_attention_row_refuses_mismatched_shapes():
    q = np.ones((1, 8, 16), np.float32)
    k = np.ones((2, 5, 16), np.float32)
    with pytest.raises(ValueError):
        _fused.attend_row(q, k, np.ones((2, 4, 16), np.float32), 1.0)  # S differs
    with pytest.raises(ValueError):
        _fused.attend_row(np.ones((1, 7, 16), np.float32), k, k, 1.0)  # 7 query heads over 2 kv heads
    with pytest.raises(ValueError):
        _fused.attend_row(q, np.ones((2, 5, 8), np.float32), k, 1.0)  # head dims differ
    with pytest.raises(ValueError, match="overlap"):
        _kernels.attend_row(q, k, k, 1.0, q)


SWIGLU_RTOL = {"f32": 2e-5, "f16": 2e-5, "bf16": 2e-5, "fp8": 2e-5, "q8": 2e-3, "q4": 2e-3, "mxfp4": 2e-3}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("i", [160, 288])
@pytest.mark.parametrize("kind", _packed.KINDS)
def test_swiglu_matches_the_three_products(isa, monkeypatch, kind, i, m, threads):
    """Gate and up are one job over the same row chunks (silu(gate) * up chunk by chunk): intermediate sizes whose
    chunks are not a multiple of four rows, one and several x rows, one and two threads."""
    rng = np.random.default_rng(3)
    h = 64
    gate, up = (_packed.from_float(rng.standard_normal((i, h)).astype(np.float32), kind) for _ in range(2))
    down = _packed.from_float(rng.standard_normal((h, i)).astype(np.float32), kind)
    x = rng.standard_normal((m, h)).astype(np.float32)
    _packed.set_threads(threads)
    got = _fused.swiglu(x, gate, up, down)
    assert got is not None
    # the unfused native products, and the numpy reference: the fused call must agree with both
    unfused = _layers.silu(_packed.matmul_t(x, gate)) * _packed.matmul_t(x, up)
    close(got, _packed.matmul_t(unfused, down), SWIGLU_RTOL[kind])
    close(got, reference(monkeypatch, _layers.expert_mlp, x, gate, up, down), SWIGLU_RTOL[kind])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kinds", [("q8", "q4"), ("q4", "mxfp4"), ("f32", "q8"), ("q4", "f16"), ("mxfp4", "bf16")])
@pytest.mark.parametrize("big", [False, True])
def test_swiglu_gate_and_up_of_different_kinds(isa, monkeypatch, kinds, big, threads):
    """Gate and up share one int16 x when either is an integer kind (and none when x is too large for it: the float
    kernels, `big`)."""
    rng = np.random.default_rng(9)
    h, i = 96, 224
    gate = _packed.from_float(rng.standard_normal((i, h)).astype(np.float32), kinds[0])
    up = _packed.from_float(rng.standard_normal((i, h)).astype(np.float32), kinds[1])
    down = _packed.from_float(rng.standard_normal((h, i)).astype(np.float32), "f32")
    x = rng.standard_normal((1, h)).astype(np.float32)
    if big:
        x[0, 5] = 3e5  # beyond quantize_x16's range
    _packed.set_threads(threads)
    got = _fused.swiglu(x, gate, up, down)
    close(got, reference(monkeypatch, _layers.expert_mlp, x, gate, up, down), 2e-3)


def test_swiglu_refuses_shapes_that_do_not_chain_and_overlaps():
    rng = np.random.default_rng(4)
    gate = _packed.from_float(rng.standard_normal((32, 16)).astype(np.float32), "f32")
    down = _packed.from_float(rng.standard_normal((16, 32)).astype(np.float32), "f32")
    x = np.ones((1, 16), np.float32)
    y = np.empty((1, 16), np.float32)
    with pytest.raises(ValueError, match="do not chain"):
        _kernels.swiglu(gate.native, gate.native, gate.native, x, y, 1)
    with pytest.raises(ValueError, match="overlaps"):
        _kernels.swiglu(gate.native, gate.native, down.native, x, x, 1)
    with pytest.raises(TypeError):
        _kernels.swiglu(("f32", gate.data), gate.native, down.native, x, y, 1)
    lying = ("f32", gate.data, None, 64, 16, 0, 0)  # claims 64 rows: more bytes than the buffer holds
    with pytest.raises(ValueError, match="expected 1024 items"):
        _kernels.swiglu(lying, gate.native, down.native, x, y, 1)
    with pytest.raises(ValueError):
        _kernels.swiglu(gate.native, gate.native, down.native, np.ones((1, 15), np.float32), y, 1)


@pytest.mark.parametrize("nh,kvh,d", [(8, 2, 64), (4, 4, 16)])
def test_rope_row_matches_apply_rope(monkeypatch, nh, kvh, d):
    from shardtool.runtime._model._rope import apply_rope, cos_sin

    rng = np.random.default_rng(5)
    cos, sin = cos_sin((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32), 1.0, np.array([37]))
    q = rng.standard_normal((1, nh, d)).astype(np.float32)
    k = rng.standard_normal((1, kvh, d)).astype(np.float32)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert _fused.rope_row(q, k, cos, sin)
    close(q, want_q, 1e-6)
    close(k, want_k, 1e-6)
    half = cos[:, : d // 2].copy()  # a partial rotary table: not this kernel's case, nothing is touched
    before = q.copy()
    assert not _fused.rope_row(q, k, half, half)
    np.testing.assert_array_equal(q, before)
    k.flags.writeable = False  # a read-only k: q is not rotated alone either
    assert not _fused.rope_row(q, k, cos, sin)
    np.testing.assert_array_equal(q, before)
