"""One sequence's decode step (one new row) through plain layers, without the batch plumbing.

`forward_batch` serves any mix of sequences and prompt chunks: per step it builds every segment's positions and
masks and an attention closure per layer, and each product of the attention goes through wrappers that check and
convert what they are given. For the step a lone sequence takes while it decodes, that Python costs about as much
as the layer's small products. `step` runs the same operations on that row in the same order: the attention's
products, rotary embedding and cached-key attention straight through the native kernels, on arrays it allocated
itself (so they are in the form the kernels take); the routed and shared experts as `_layers.moe_layer` runs them
on one row, without its per-expert thunks and grouping (`_moe`). The result is the same float32 bits as the general
path (tests compare them on every family).

`applies` says when it may: one segment of one row, the native kernels in use, and plain attention on every layer
(GQA with RoPE; no QK norm, clipping, sinks, MLA or chunked attention; no sliding window the sequence has outgrown).
Anything else takes `forward_batch`'s general path, which stays the definition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from shardtool.errors import ShardtoolError

from . import _fused, _packed
from ._config import ModelConfig
from ._layers import (ROW0, ExpertUnavailable, attention_row, expert_mlp, gqa_attention, matmul_t, moe_layer, rms_norm,
                      route, shared_expert)
from ._rope import apply_rope, cos_sin

if TYPE_CHECKING:
    from ._forward import Float32Weights, Segment

_ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight")


def applies(cfg: ModelConfig, segments: "Sequence[Segment]") -> bool:
    """True when `segments` is one sequence's one-row step that `step` runs as `forward_batch` would."""
    if len(segments) != 1 or len(segments[0].ids) != 1 or _packed._native is None:
        return False
    keys = segments[0].cache.length + 1  # the keys the row sees
    return (cfg.mla is None and cfg.qk_norm == "none" and cfg.clip_qkv is None and cfg.chunked_nope is None
            and not cfg.attention_sinks and not any(cfg.attention_chunks) and all(cfg.rope_layers or (True,))
            and all(window is None or keys <= window for window in cfg.sliding_windows))


def step(cfg: ModelConfig, weights: "Float32Weights", rope: tuple[np.ndarray, float],
         seg: "Segment") -> np.ndarray | None:
    """# one segment of one token id -> logits [1, V] (None when the segment asks for none); its keys and values
    appended to its cache, which commits only after the last layer and the head succeeded (as `forward_batch`)."""
    cache = seg.cache
    cache.check_room(1)
    cos, sin = cos_sin(rope[0], rope[1], np.array([cache.length]))  # [1, d] each
    observe = seg.trace.observe if seg.trace is not None else None
    eps = cfg.rms_norm_eps
    x = weights.embed_rows(seg.ids)  # [1, H]
    for layer in range(cfg.num_layers):
        w = weights.layer(layer)
        h = x + _attend(cfg, w, rms_norm(x, w["input_layernorm.weight"], eps), cos, sin, cache, layer)
        y = rms_norm(h, w["post_attention_layernorm.weight"], eps)
        if cfg.moe_layers[layer]:
            x = h + _moe(cfg, w, y, weights, layer, weights.observer(layer, observe))
        else:
            x = h + expert_mlp(y, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
        weights.lookahead(layer + 1, x)
    logits = None
    wanted = seg.logits in ("last", "all")  # (one row: the last is all; anything else asks for none, as there)
    if seg.trace is not None or wanted:
        norm, lm_head = weights.head()
        normed = rms_norm(x, norm, eps)
        if seg.trace is not None:
            seg.trace.hidden = normed
        if wanted:
            logits = matmul_t(normed, lm_head)
    cache.commit(1)
    return logits


def _attend(cfg: ModelConfig, w: Mapping, xn: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache,
            layer: int) -> np.ndarray:
    """# normed row [1, H] -> [1, H]: `_layers.gqa_attention` on one row that sees every key: `linear`'s products
    (native, into arrays made here) and bias additions, `_fused.rope_row`, the cache's append, `attention_row`.
    Weights not packed (a provider's own arrays) take `gqa_attention` itself."""
    nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    wq, wk, wv, wo = (w[name] for name in _ATTENTION)
    if not (type(wq) is type(wk) is type(wv) is type(wo) is _packed.Packed and _fused.plain(xn)):
        return gqa_attention(xn, w, cfg, cos, sin, None, partial(cache.append, layer))
    native, threads = _packed._native, _packed._threads
    q, k, v = np.empty((1, nh, hd), np.float32), np.empty((1, kvh, hd), np.float32), np.empty((1, kvh, hd), np.float32)
    for weight, out, bias in ((wq, q, "self_attn.q_proj.bias"), (wk, k, "self_attn.k_proj.bias"),
                              (wv, v, "self_attn.v_proj.bias")):
        flat = out.reshape(1, -1)  # a view: [1, heads * hd]
        native.product(weight.native, xn, flat, threads)
        b = w.get(bias)
        if b is not None:
            flat += b
    if not _fused.rope_row(q, k, cos, sin):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = cache.append(layer, k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # [kvh, S, hd] each
    attended = np.ascontiguousarray(attention_row(q, keys, values, cfg.attn_scale).reshape(1, nh * hd))
    out = np.empty((1, cfg.hidden_size), np.float32)
    native.product(wo.native, attended, out, threads)
    b = w.get("self_attn.o_proj.bias")
    if b is not None:
        out += b
    return out


def _moe(cfg: ModelConfig, w: Mapping, y: np.ndarray, weights: "Float32Weights", layer: int, observe) -> np.ndarray:
    """# normed row [1, H] -> [1, H]: `_layers.moe_layer` on one row, in its order (route, observe, the experts'
    loads started, the shared expert, the routed sum in ascending expert order, the shared one added), without its
    batch plumbing: each expert's packed weights straight into `expert_mlp`, its output weighted as `moe_experts`
    weights a one-row step's. Llama 4's input-scaled experts, gpt-oss's clamped SwiGLU and a cluster's remote
    experts take `moe_layer` itself."""
    if weights.remote is not None or cfg.router == "sigmoid_input" or cfg.expert_act == "clamped_swiglu":
        return moe_layer(y, w, cfg, weights.expert_fetch(layer), observe)
    gate, idx, scores = route(y, w, cfg)  # [1, k] each, [1, E]
    if observe is not None:
        observe(idx, scores)
    chosen = idx[0].tolist()
    ids = sorted(chosen)  # distinct: every router's top-k
    got = weights.experts(layer, ids)
    shared = shared_expert(y, w, cfg)
    gate = gate.astype(np.float32, copy=False)
    out = None
    for e in ids:
        try:
            out_e = expert_mlp(y, *weights.expert_projections(layer, e, got[e]))
        except ShardtoolError as cause:  # a bug is not caught here: it fails the whole step
            raise ExpertUnavailable(cause, ROW0) from cause
        out_e *= gate[0, chosen.index(e)]
        if out is None:
            out = out_e
        else:
            out += out_e
    if shared is not None:
        out += shared
    return out
