"""Fused native steps of a decoder layer: one extension call where the numpy definition takes several.

Each function returns its result, or None when the native kernels are not in use (not built, SHARDTOOL_KERNELS=0)
or the arguments are not in the form the kernel takes; the caller then runs the numpy definition in `_layers`,
which stays the reference each of these must agree with (up to float32 rounding: the sums run in another order).
"""

from __future__ import annotations

import numpy as np

from . import _packed

_F32 = np.dtype(np.float32)


def plain(a: np.ndarray) -> bool:
    """float32, C-contiguous and aligned: what the extension reads without a copy."""
    f = a.flags
    return a.dtype == _F32 and f.c_contiguous and f.aligned


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray | None:
    """# [..., d], [d] -> [..., d]  (`_layers.rms_norm`)"""
    native = _packed._native
    if native is None or w.ndim != 1 or x.shape[-1] != w.shape[0] or not x.size or not (plain(x) and plain(w)):
        return None
    y = np.empty(x.shape, _F32)
    native.rms_norm(x, w, eps, y)
    return y


def rope_row(q: np.ndarray, k: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> bool:
    """# q [1, nh, d], k [1, kvh, d], cos, sin [1, d]: both rotated in place (`_rope.apply_rope` on one position);
    False (nothing changed) where the extension cannot take them."""
    native = _packed._native
    if (native is None or not (plain(q) and plain(k) and plain(cos) and plain(sin)) or cos.shape[0] != 1
            or not q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]
            or not (q.flags.writeable and k.flags.writeable)):
        return False
    native.rope(q, cos, sin)
    native.rope(k, cos, sin)
    return True


def _cache_view(a: np.ndarray) -> bool:
    """float32 [heads, S >= 1, d] with contiguous rows and evenly strided heads: what `attend_row` reads (a KV cache's
    view); anything else takes the numpy path."""
    return (a.dtype == _F32 and a.ndim == 3 and a.shape[1] >= 1 and a.strides[2] == 4 and a.strides[1] == 4 * a.shape[2]
            and a.strides[0] >= a.strides[1] * a.shape[1] and a.flags.aligned)


def attend_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray | None:
    """# [1, nh, d], [kvh, S, d], [kvh, S, dv] -> [1, nh, dv]  (`_layers.attention_row`: one decode row that sees
    every key; k and v may be a KV cache's strided views)"""
    native = _packed._native
    if native is None or not plain(q) or q.ndim != 3 or not (_cache_view(k) and _cache_view(v)):
        return None
    out = np.empty((1, q.shape[1], v.shape[2]), np.float32)
    native.attend_row(q, k, v, scale, out)
    return out


def route_softmax_takes(experts: int, k: int) -> bool:
    """Whether the extension's `route_softmax` routes `experts` logits a row to their top `k` (its limits:
    k <= MAX_TOP_K, E <= 2^20); False when the native kernels are not in use."""
    native = _packed._native
    return (native is not None and isinstance(k, (int, np.integer)) and 1 <= k <= min(experts, native.MAX_TOP_K)
            and experts <= 1 << 20)


def route_softmax_topk(logits: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, ...] | None:
    """# [T, E] -> weights [T, k], expert ids [T, k] (largest first), probabilities [T, E]  (`_layers`'
    `_route_softmax_topk`: the softmax, its top k and their weights in one call; a decode step's numpy route took
    about as long as an expert's product). None for a non-finite logit, whose numpy result defines it."""
    native = _packed._native
    if logits.ndim != 2 or not plain(logits) or not 1 <= logits.shape[0] or not route_softmax_takes(logits.shape[1], k):
        return None
    t, e, k = *logits.shape, int(k)
    probs, weights, ids = np.empty((t, e), _F32), np.empty((t, k), _F32), np.empty((t, k), np.int64)
    if not native.route_softmax(logits, k, bool(norm_topk_prob), probs, weights, ids):
        return None
    return weights, ids, probs


def swiglu(x: np.ndarray, gate: _packed.Packed, up: _packed.Packed, down: _packed.Packed) -> np.ndarray | None:
    """# [m, H], [I, H], [I, H], [H, I] -> [m, H]  (`_layers.expert_mlp`: down(silu(gate x) * up x) in one call)"""
    native = _packed._native
    if native is None or not x.size:
        return None
    x = _packed._float32_rows(x)
    y = np.empty((x.shape[0], down.shape[0]), np.float32)
    native.swiglu(gate.native, up.native, down.native, x, y, _packed._threads)
    return y
