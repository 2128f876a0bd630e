"""Llama 4's numerics, as transformers v5's modeling_llama4 computes them; pure functions on float32 arrays.

- The router (Llama4Router, Llama4TextMoe): top-k of the raw logits; each chosen expert's sigmoid score
  multiplies that expert's *input* (the experts are nonlinear, so this is not the usual weighted output).
- Attention (Llama4TextAttention): RoPE layers rotate (x0, x1), (x2, x3)... pairs as complex numbers and then,
  with use_qk_norm, L2-normalise q and k per head (no weight); NoPE layers do neither, and with
  attn_temperature_tuning scale q by 1 + attn_scale * log1p(floor((position + 1) / floor_scale)).
- Chunked attention (create_chunked_causal_mask): a query sees the earlier keys of its own chunk only.

The generic blocks (`_layers.py`) call these where the family's row says so; nothing here imports them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ._config import ChunkedNopeConfig
from ._rope import apply_rope, apply_rope_interleave


def route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """# [T, E] -> weights [T, k] (sigmoid of the chosen logits), expert ids [T, k], selection scores [T, E]
    (the logits: top-k runs on them)."""
    idx = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    chosen = np.take_along_axis(logits, idx, axis=-1)
    weights = np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * chosen))  # sigmoid; never overflows
    return weights.astype(np.float32), idx, logits


def scale_expert_inputs(x: np.ndarray, weights: np.ndarray, groups: Mapping[int, tuple[np.ndarray, np.ndarray]]
                        ) -> tuple[np.ndarray, dict[int, np.ndarray], np.ndarray]:
    """# [T, H], [T, k], {expert: (token rows, slots)} -> (inputs [T*k, H], {expert: its rows of the inputs},
    output weights [T, k] of ones): row t*k + j is token t scaled by its j-th expert's score, so each expert
    runs on its own scaled copy and the outputs are summed unweighted."""
    t, k = weights.shape
    scaled = (x[:, None, :] * weights[:, :, None]).reshape(t * k, x.shape[1])
    rows = {e: tokens * k + slots for e, (tokens, slots) in groups.items()}
    return scaled, rows, np.ones_like(weights)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """# [..., d] -> [..., d]  (Llama4TextL2Norm: x * rsqrt(mean(x^2) + eps), no weight)"""
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)))


def position_qk(q: np.ndarray, k: np.ndarray, cos: np.ndarray | None, sin: np.ndarray | None,
                cfg: ChunkedNopeConfig, eps: float, interleave: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """# [T, nh, d], [T, kvh, d], cos/sin [T, d] (None on a NoPE layer) -> q, k before the cache.

    The complex rotation's output is de-interleaved (evens, then odds) as `apply_rope_interleave` gives it: q
    and k get the same permutation, so their dot products, and the L2 norm over each head, are unchanged."""
    if cos is None:
        return q, k
    rotate = apply_rope_interleave if interleave else apply_rope  # the config says interleave; tests flip it
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if cfg.use_qk_norm:
        q, k = l2_norm(q, eps), l2_norm(k, eps)
    return q, k


def nope_temperature(q: np.ndarray, start: int, cfg: ChunkedNopeConfig) -> np.ndarray:
    """# [T, nh, d] queries at positions start.. -> [T, nh, d]: a NoPE layer's attention-temperature tuning."""
    if not cfg.temperature_tuning:
        return q
    positions = np.arange(start, start + q.shape[0], dtype=np.float32)
    scales = np.log1p(np.floor((positions + np.float32(1.0)) / np.float32(cfg.floor_scale))) \
        * np.float32(cfg.attn_scale) + np.float32(1.0)
    return q * scales.astype(np.float32)[:, None, None]


def chunked_mask(q_pos: np.ndarray, kv_len: int, chunk: int) -> np.ndarray | None:
    """# [T], S -> [T, S] bool (True = may attend), or None when every key is visible: key j is visible from
    query i when j <= i and both lie in the same chunk of `chunk` positions."""
    if len(q_pos) == 1 and kv_len <= chunk:
        return None
    k_pos = np.arange(kv_len)
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] // chunk == q_pos[:, None] // chunk)
