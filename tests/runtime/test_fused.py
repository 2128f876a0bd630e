"""The fused native steps (`_fused`: RMSNorm, one-row attention, the SwiGLU expert, the softmax router) against their
numpy definitions in `_layers` (run with the extension switched off): every stored kind, a KV cache's strided views,
both instruction sets; hostile arguments refused with an exception, never read out of bounds."""

from __future__ import annotations

import numpy as np
import pytest

from shardtool.runtime.model import _fused, _layers, _packed

_kernels = pytest.importorskip("shardtool.runtime.model._kernels", reason="the extension is not built (optional)")
from _isa import isa  # noqa: E402,F401  (the fixture: every instruction set the CPU has)


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
    out = np.empty((1, 8, 16), np.float32)
    for bad_k, bad_v in [(np.ones((5, 16), np.float32), k), (k, np.ones((5, 16), np.float32)),
                         (np.ones((0, 5, 16), np.float32), k), (np.ones((2, 5, 0), np.float32), k),
                         (k, np.ones((1, 5, 16), np.float32)), (k, np.ones((2, 0, 16), np.float32))]:
        with pytest.raises(ValueError):  # not [kvh, S, d], no heads or positions, v's heads differ from k's
            _kernels.attend_row(q, bad_k, bad_v, 1.0, out)


def cache_views(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k [kvh, S, d], v [kvh, S, dv] copied into [kvh, capacity, .] buffers and sliced back: a KV cache's views."""
    kvh, s, _ = k.shape
    kbuf = np.zeros((kvh, s + 5, k.shape[2]), np.float32)
    vbuf = np.zeros((kvh, s + 5, v.shape[2]), np.float32)
    kbuf[:, :s], vbuf[:, :s] = k, v
    return kbuf[:, :s], vbuf[:, :s]


@pytest.mark.parametrize("g", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("positions", [1, 7, 8, 300])
@pytest.mark.parametrize("d,dv", [(64, 64), (20, 36), (3, 5)])
def test_attention_row_head_groups_match_numpy(isa, monkeypatch, g, positions, d, dv):
    """Query heads that share a kv head are taken four, two, one at a time: every group size, S below and above a
    vector, head dims with and without a vector tail, dv != d."""
    rng = np.random.default_rng(6)
    kvh = 2
    k = rng.standard_normal((kvh, positions, d)).astype(np.float32)
    v = rng.standard_normal((kvh, positions, dv)).astype(np.float32)
    q = (rng.standard_normal((1, kvh * g, d)) * 2).astype(np.float32)
    want = reference(monkeypatch, _layers.attention, q, k, v, 0.3, None)
    close(_fused.attend_row(q, *cache_views(k, v), 0.3), want, 2e-6)


def one_hot_scores(rng, g: int, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [1, g, 8], k [1, S, 8], v [1, S, S] with q_h . k_t = scores[h, t] exactly (one nonzero term) and v the
    identity: the attention row is each head's softmax itself."""
    s = scores.shape[1]
    q = np.zeros((1, g, 8), np.float32)
    q[0, :, rng.integers(0, 8)] = 1.0
    k = np.zeros((1, s, 8), np.float32)
    k[0, :, :] = 0.0
    col = int(np.flatnonzero(q[0, 0])[0])
    k[0, :, col] = scores[0]
    q[0, :, col] = 1.0
    return q, k, np.eye(s, dtype=np.float32)[None]


@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("positions", [1, 13, 64, 1000])
def test_attention_row_exp_is_accurate_over_its_range(isa, g, positions):
    """Scores from -80 to 0 below the largest: each probability within a few float32 ulp of exp's (float64) of the
    same float32 differences."""
    rng = np.random.default_rng(7)
    scores = np.zeros((1, positions), np.float32)
    scores[0] = rng.uniform(-80.0, 0.0, positions).astype(np.float32) + 3.0
    q, k, v = one_hot_scores(rng, g, scores)
    e = np.exp((scores[0] - scores[0].max()).astype(np.float64))  # the float32 difference, as the kernel takes it
    want = np.broadcast_to(e / e.sum(), (g, positions))
    got = _fused.attend_row(q, *cache_views(k, v), 1.0)
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-37)


@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("positions", [1, 9, 300])
@pytest.mark.parametrize("spread", ["huge", "-huge", "ties"])
def test_attention_row_huge_score_ranges(isa, monkeypatch, g, positions, spread):
    """Scores spread over +-1e4 (nearly every exp underflows to 0), all near -1e30, or all equal: as numpy's."""
    rng = np.random.default_rng(8)
    scores = np.zeros((1, positions), np.float32)
    if spread == "huge":
        scores[0] = rng.uniform(-1e4, 1e4, positions)
        scores[0, rng.integers(0, positions, 3)] = scores[0].max() - rng.uniform(0, 5, 3)
    elif spread == "-huge":
        scores[0] = -1e30 * (1 + rng.uniform(0, 1e-5, positions))
    q, k, v = one_hot_scores(rng, g, scores)
    v = v + rng.standard_normal(v.shape).astype(np.float32)  # every value row counts, not only the identity's
    want = reference(monkeypatch, _layers.attention, q, k, v, 1.0, None)
    got = _fused.attend_row(q, *cache_views(k, v), 1.0)
    assert np.isfinite(got).all()
    close(got, want, 2e-6)


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
    from shardtool.runtime.model._rope import apply_rope, cos_sin

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


def test_route_softmax_takes_only_what_the_extension_routes(monkeypatch):
    """The one statement of route_softmax's limits (k from 1 to min(E, MAX_TOP_K), E <= 2^20, an integer k), which
    both the general path's router and the decode row's plan ask."""
    top = _packed._native.MAX_TOP_K
    assert _fused.route_softmax_takes(8, 2) and _fused.route_softmax_takes(8, np.int64(8))
    assert _fused.route_softmax_takes(1 << 20, top) and _fused.route_softmax_takes(top + 1, top)
    for experts, k in [(8, 0), (8, 9), (top + 1, top + 1), ((1 << 20) + 1, 2), (8, 2.0)]:
        assert not _fused.route_softmax_takes(experts, k), (experts, k)
    assert _fused.route_softmax_topk(np.zeros((1, 8), np.float32), 9, True) is None
    monkeypatch.setattr(_packed, "_native", None)
    assert not _fused.route_softmax_takes(8, 2)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (1, 8, 8), (3, 64, 6), (2, 256, 8), (1, 5, 1)])
def test_route_softmax_topk_matches_numpy(monkeypatch, t, e, k, norm):
    """The native softmax router against numpy's: the same experts (largest first), probabilities and weights
    within float32 rounding."""
    rng = np.random.default_rng(t * 1000 + e + k)
    logits = (rng.standard_normal((t, e)) * 4).astype(np.float32)
    assert _fused.route_softmax_topk(logits, k, norm) is not None
    weights, ids, probs = _layers._route_softmax_topk(logits, k, norm)
    want_w, want_ids, want_p = reference(monkeypatch, _layers._route_softmax_topk, logits, k, norm)
    assert ids.dtype == np.int64 and ids.shape == (t, k)
    order = np.argsort(-want_p, axis=-1, kind="stable")[:, :k]  # numpy's picks, largest first
    np.testing.assert_array_equal(np.sort(ids, axis=-1), np.sort(want_ids, axis=-1))
    np.testing.assert_array_equal(ids, order)
    close(probs, want_p, 1e-6)
    close(weights, np.take_along_axis(want_p, order, -1) / (np.take_along_axis(want_p, order, -1).sum(-1, keepdims=True)
                                                           if norm else 1), 1e-6)


def test_route_softmax_topk_ties_and_non_finite_logits(monkeypatch):
    ids = _fused.route_softmax_topk(np.zeros((1, 6), np.float32), 3, True)[1]
    np.testing.assert_array_equal(ids, [[0, 1, 2]])  # a tie goes to the lower id, whatever the order seen
    tied = np.array([[0.0, 2.0, 1.0, 2.0, 2.0]], np.float32)
    np.testing.assert_array_equal(_fused.route_softmax_topk(tied, 2, False)[1], [[1, 3]])
    for bad in (np.nan, np.inf, -np.inf):
        logits = np.array([[0.5, bad, 1.0, -2.0]], np.float32)
        assert _fused.route_softmax_topk(logits, 2, True) is None  # numpy's path defines it
        with np.errstate(invalid="ignore"):  # (inf - inf in numpy's softmax)
            got = _layers._route_softmax_topk(logits, 2, True)
            want = reference(monkeypatch, _layers._route_softmax_topk, logits, 2, True)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_route_softmax_refuses_hostile_arguments():
    logits = np.zeros((2, 8), np.float32)
    probs, weights, ids = np.empty((2, 8), np.float32), np.empty((2, 2), np.float32), np.empty((2, 2), np.int64)
    assert _kernels.route_softmax(logits, 2, True, probs, weights, ids) is True
    with pytest.raises(ValueError, match="k=0"):
        _kernels.route_softmax(logits, 0, True, probs, weights, ids)
    with pytest.raises(ValueError, match="logits"):  # k larger than the experts
        _kernels.route_softmax(logits[:, :1].copy(), 2, True, probs[:, :1].copy(), weights, ids)
    with pytest.raises(ValueError, match="ids"):
        _kernels.route_softmax(logits, 2, True, probs, weights, ids.astype(np.int32))
    with pytest.raises(ValueError, match="probs"):
        _kernels.route_softmax(logits, 2, True, np.empty((2, 7), np.float32), weights, ids)
    with pytest.raises(ValueError, match="overlaps"):
        _kernels.route_softmax(logits, 2, True, logits, weights, ids)
    with pytest.raises(ValueError, match="overlaps"):
        _kernels.route_softmax(logits, 2, True, probs, probs[0, :4].reshape(2, 2), ids)
    with pytest.raises((ValueError, BufferError, TypeError)):  # a read-only output
        _kernels.route_softmax(logits, 2, True, probs, weights, _readonly(ids))
    with pytest.raises(ValueError, match="overlaps"):
        shared = np.zeros(4, np.int64)  # ids over the bytes of weights
        _kernels.route_softmax(logits, 2, True, probs, shared[:2].view(np.float32).reshape(2, 2), shared.reshape(2, 2))
    with pytest.raises(ValueError, match=r"expected logits and probs \[4, 4\]"):  # flat sizes agree, shapes do not
        _kernels.route_softmax(logits, 2, True, probs, np.empty((4, 2), np.float32), np.empty((4, 2), np.int64))
    with pytest.raises(TypeError):
        _kernels.route_softmax(logits, 2.0, True, probs, weights, ids)
    logits[1, 3] = np.nan  # a non-finite logit: False, and nothing written
    probs[...], weights[...], ids[...] = 7.0, 7.0, 7
    assert _kernels.route_softmax(logits, 2, True, probs, weights, ids) is False
    assert (probs == 7.0).all() and (weights == 7.0).all() and (ids == 7).all()


def test_route_softmax_topk_leaves_to_numpy_what_the_extension_does_not_take(monkeypatch):
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((2, 8)).astype(np.float32)
    assert _fused.route_softmax_topk(logits, np.int64(2), True) is not None  # a numpy integer k is taken
    for args in ((np.empty((0, 8), np.float32), 2), (logits[:, ::2], 2), (logits.astype(np.float64), 2), (logits, 9),
                 (logits, 0), (np.zeros((1, 1025), np.float32), 1025), (np.zeros((1, (1 << 20) + 1), np.float32), 2)):
        assert _fused.route_softmax_topk(*args, True) is None
        got = _layers._route_softmax_topk(*args, True) if args[1] <= args[0].shape[1] and args[1] > 0 else None
        if got is not None:  # numpy's path ran and gave numpy's result
            want = reference(monkeypatch, _layers._route_softmax_topk, *args, True)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)


def _readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def _attention_parts(kind: str, nh=8, kvh=2, d=16, hid=64, capacity=12, biased=True):
    """A layer's attention weights packed as `kind`, its norms, biases, a rotary row and a half-filled cache."""
    rng = np.random.default_rng(11)
    def mat(o, i):
        return _packed.from_float(rng.standard_normal((o, i)).astype(np.float32) / 4, kind)
    w = (mat(nh * d, hid), mat(kvh * d, hid), mat(kvh * d, hid), mat(hid, nh * d))
    biases = tuple(rng.standard_normal(n).astype(np.float32) if biased else None
                   for n in (nh * d, kvh * d, kvh * d, hid))
    norm, post = (rng.standard_normal(hid).astype(np.float32) for _ in range(2))
    angle = rng.standard_normal(d // 2).astype(np.float32)
    cos = np.concatenate([np.cos(angle)] * 2)[None].astype(np.float32)
    sin = np.concatenate([np.sin(angle)] * 2)[None].astype(np.float32)
    kc, vc = (rng.standard_normal((kvh, capacity, d)).astype(np.float32) for _ in range(2))
    return w, biases, norm, post, cos, sin, kc, vc, rng.standard_normal((1, hid)).astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("kind", ["f32", "bf16", "q8", "q4"])
def test_attention_step_is_the_separate_kernels_bit_for_bit(isa, kind, biased, threads):
    """One call = rms_norm, the three products and their biases, rope, the cache write, attend_row over positions
    [0, pos], the output product, its bias, the residual and the next norm, each as its own kernel computes it."""
    w, biases, norm, post, cos, sin, kc, vc, x = _attention_parts(kind, biased=biased)
    pos, eps, scale, (nh, kvh, d) = 5, 1e-5, 0.25, (8, 2, 16)
    _packed.set_threads(threads)
    want_kc, want_vc = kc.copy(), vc.copy()
    xn = np.empty_like(x)
    _kernels.rms_norm(x, norm, eps, xn)
    q, k, v = (np.empty((1, n * d), np.float32) for n in (nh, kvh, kvh))
    for weight, out, b in zip(w, (q, k, v), biases):
        _kernels.product(weight.native, xn, out, threads)
        if b is not None:
            out += b
    _kernels.rope(q, cos, sin)
    _kernels.rope(k, cos, sin)
    want_kc[:, pos], want_vc[:, pos] = k.reshape(kvh, d), v.reshape(kvh, d)
    a = np.empty((1, nh * d), np.float32)
    _kernels.attend_row(q, want_kc[:, :pos + 1], want_vc[:, :pos + 1], scale, a)
    o = np.empty_like(x)
    _kernels.product(w[3].native, a, o, threads)
    if biases[3] is not None:
        o += biases[3]
    want_h = x + o
    want_y = np.empty_like(x)
    _kernels.rms_norm(want_h, post, eps, want_y)

    h, y = np.empty_like(x), np.empty_like(x)
    _kernels.attention_step(x, norm, eps, *(p.native for p in w), biases, cos, sin, kc, vc, pos, scale, post, h, y,
                            threads)
    np.testing.assert_array_equal(h, want_h)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(kc, want_kc)  # position pos written, the others untouched
    np.testing.assert_array_equal(vc, want_vc)


def test_attention_step_refuses_hostile_arguments():
    w, biases, norm, post, cos, sin, kc, vc, x = _attention_parts("f32")
    natives = tuple(p.native for p in w)
    h, y = np.empty_like(x), np.empty_like(x)

    def call(**change):
        args = dict(x=x, norm=norm, eps=1e-5, wq=natives[0], wk=natives[1], wv=natives[2], wo=natives[3],
                    biases=biases, cos=cos, sin=sin, kc=kc, vc=vc, pos=3, scale=0.5, post=post, h=h, y=y, threads=1)
        args.update(change)
        _kernels.attention_step(*args.values())

    call()  # the valid call
    before = kc.copy(), vc.copy(), h.copy(), y.copy()
    for change, message in [
        (dict(pos=12), "do not fit"), (dict(pos=-1), "do not fit"),  # the capacity is 12
        (dict(wq=natives[1]), "do not fit"),  # wk as wq: 2 query heads, and wo wants 8
        (dict(wo=natives[0]), "do not fit"),
        # each shape clause alone: a wo with more outputs than H, a wv or wk of another width or input, a
        # query width that is not whole heads
        (dict(wo=_packed.from_float(np.ones((65, 128), np.float32), "f32").native), "do not fit"),
        (dict(wv=_packed.from_float(np.ones((48, 64), np.float32), "f32").native), "do not fit"),
        (dict(wk=_packed.from_float(np.ones((32, 65), np.float32), "f32").native), "do not fit"),
        (dict(wv=_packed.from_float(np.ones((32, 65), np.float32), "f32").native), "do not fit"),
        (dict(wq=_packed.from_float(np.ones((136, 64), np.float32), "f32").native), "do not fit"),
        (dict(vc=vc[:, :11]), "do not fit"),  # caches of different capacities
        (dict(kc=kc[:1]), r"v_cache: expected float32 \[1, S, 16\]"),  # one kv head in k, two in v
        (dict(cos=cos[:, :8]), "cos: expected 16 items"),
        (dict(biases=(biases[0][:-1], *biases[1:])), "bq: expected 128 items"),
        (dict(biases=biases[:3]), "a tuple of 4"),
        (dict(x=x[:, :63].copy()), "x: expected 64 items"),
        (dict(h=y), "overlaps"), (dict(h=x), "overlaps"), (dict(y=post), "overlaps"),
        (dict(h=kc[0, 0:4].reshape(1, 64)), "overlaps"),  # an output inside the key cache
        (dict(y=vc[1, 4:8].reshape(1, 64)), "overlaps"),  # inside its second head
        (dict(vc=kc), "overlaps"),
        (dict(kc=kc[:, :10], vc=vc[:, :10]), None),  # heads strided beyond the positions given: taken
        (dict(kc=kc.transpose(1, 0, 2).copy().transpose(1, 0, 2)), "k_cache: expected float32"),  # rows strided
        (dict(kc=np.ascontiguousarray(kc[:, :, :8])), r"v_cache: expected float32 \[2, S, 8\]"),  # head widths differ
        (dict(kc=np.ascontiguousarray(kc[:, :, :8]), vc=np.ascontiguousarray(vc[:, :, :8]),
              cos=cos[:, :8].copy(), sin=sin[:, :8].copy()), "do not fit"),  # heads of 8: wk's width is 32
        (dict(threads=0), "threads=0"),
    ]:
        if message is None:
            call(**change)
            continue
        with pytest.raises((ValueError, TypeError), match=message):
            call(**change)
    for name in ("kc", "vc", "h", "y"):  # every output read-only
        readonly = dict(kc=kc, vc=vc, h=h, y=y)[name].copy()
        readonly.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            call(**{name: readonly})
    raw = np.zeros(1024, np.float32)  # heads 769 bytes apart (each 768 long): the second starts unaligned
    unaligned = np.lib.stride_tricks.as_strided(raw, (2, 12, 16), (769, 64, 4))
    with pytest.raises(ValueError, match="k_cache: expected float32"):
        call(kc=unaligned)
    with pytest.raises(ValueError, match="k: expected float32"):  # (attend_row takes its cache views the same way)
        _kernels.attend_row(np.ones((1, 8, 16), np.float32), unaligned, vc, 1.0, np.empty((1, 8, 16), np.float32))
    with pytest.raises(TypeError, match="expects 18 arguments"):
        _kernels.attention_step(x)
    call()
    for a, b in zip(before, (kc, vc, h, y)):  # (the same valid call again: the same results)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["f32", "q8", "q4"])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_row_sums_as_the_numpy_steps_do_bit_for_bit(isa, kind, shared, threads):
    """Each expert's swiglu times its gate, added in the order given to the sum of those before, the shared output,
    the residual: float32 steps whose bits the general path defines."""
    rng = np.random.default_rng(12)
    hid, inter = 64, 96
    experts = [tuple(_packed.from_float(rng.standard_normal(shape).astype(np.float32) / 4, kind)
                     for shape in ((inter, hid), (inter, hid), (hid, inter))) for _ in range(3)]
    gates = rng.random(3).astype(np.float32)
    x, h = (rng.standard_normal((1, hid)).astype(np.float32) for _ in range(2))
    extra = rng.standard_normal((1, hid)).astype(np.float32) if shared else None
    _packed.set_threads(threads)
    total = None
    for three, g in zip(experts, gates):
        y = np.empty_like(x)
        _kernels.swiglu(*(p.native for p in three), x, y, threads)
        y *= g
        total = y if total is None else total + y
    if extra is not None:
        total += extra
    out = np.empty_like(x)
    _kernels.moe_row(x, tuple(tuple(p.native for p in three) for three in experts), gates, extra, h, out, threads)
    np.testing.assert_array_equal(out, h + total)


def test_moe_row_refuses_hostile_arguments():
    rng = np.random.default_rng(13)
    gate = _packed.from_float(rng.standard_normal((32, 16)).astype(np.float32), "f32")
    down = _packed.from_float(rng.standard_normal((16, 32)).astype(np.float32), "f32")
    wide = _packed.from_float(rng.standard_normal((32, 24)).astype(np.float32), "f32")
    one = (gate.native, gate.native, down.native)
    x, h, out = np.ones((1, 16), np.float32), np.ones((1, 16), np.float32), np.empty((1, 16), np.float32)
    gates = np.ones(2, np.float32)
    _kernels.moe_row(x, (one, one), gates, None, h, out, 1)
    long_down = _packed.from_float(rng.standard_normal((24, 32)).astype(np.float32), "f32")
    readonly = out.copy()
    readonly.flags.writeable = False
    for args, message in [
        ((x, (one, (gate.native, gate.native, long_down.native)), gates, None, h, out, 1), "do not chain"),
        ((x, (one, one), gates, None, h, readonly, 1), "out: expected a C-contiguous writable buffer"),
        ((x, (), gates[:0], None, h, out, 1), "a tuple of 1 to 1024"),
        ((x, (one,) * 1025, np.ones(1025, np.float32), None, h, out, 1), "a tuple of 1 to 1024"),
        ((x, (one, one[:2]), gates, None, h, out, 1), r"experts\[1\]: expected a \(gate, up, down\)"),
        ((x, (one, (gate.native, gate.native, gate.native)), gates, None, h, out, 1), "do not chain"),
        ((x, (one, (wide.native, wide.native, _packed.from_float(np.ones((24, 32), np.float32), "f32").native)),
          gates, None, h, out, 1), "do not chain"),  # an expert of another width than the first
        ((x, (one, one), gates[:1], None, h, out, 1), "gates: expected 2 items"),
        ((x, (one, one), gates, np.ones((1, 8), np.float32), h, out, 1), "shared: expected 16 items"),
        ((x, (one, one), gates, None, h, x, 1), "overlaps"),
        ((x, (one, one), gates, None, h, h, 1), "overlaps"),
        ((x, (one, one), gates, None, h, gates.view(np.float32)[:0], 1), "out: expected 16 items"),
        ((x, (one, one), gates, None, h, out, 65), "threads=65"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            _kernels.moe_row(*args)
    lying = ("f32", gate.data, None, 64, 16, 0, 0)  # claims 64 rows: more bytes than the buffer holds
    with pytest.raises(ValueError, match="expected 1024 items"):
        _kernels.moe_row(x, ((lying, gate.native, down.native),), gates[:1], None, h, out, 1)
