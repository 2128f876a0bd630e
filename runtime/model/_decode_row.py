"""One sequence's decode step (one new row) through plain layers, without the batch plumbing.

`forward_batch` serves any mix of sequences and prompt chunks: per step it builds every segment's positions and
masks and an attention closure per layer, and each product of the attention goes through wrappers that check and
convert what they are given. For the step a lone sequence takes while it decodes, that Python costs about as much
as the layer's small products. `step` runs the same operations on that row in the same order, a layer in two
native calls where its weights are packed: `attention_step` (the norm, the attention's products and biases, rotary
embedding, the row's keys and values written into the cache, cached-key attention, the output product, the
residual and the next norm; `_attend`) and `moe_row` (every chosen expert's SwiGLU, their weighted sum, the shared
expert's output and the residual; `_moe`, which routes and fetches the experts as `_layers.moe_layer` does, without
its per-expert thunks and grouping). The result is the same float32 bits as the general path (tests compare them on
every family). What a step needs of a layer's weights besides the arrays (the attention's native arguments, checked;
the router when the row applies it itself) is worked out once per trunk shard (`_LayerPlan`), not at every step.

`applies` says when it may: one segment of one row, the native kernels in use, and plain attention on every layer
(GQA with RoPE; no QK norm, clipping, sinks, MLA or chunked attention; no sliding window the sequence has outgrown).
Anything else takes `forward_batch`'s general path, which stays the definition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import numpy as np

from shardtool.errors import ShardtoolError

from . import _fused, _packed
from ._config import ModelConfig
from ._layers import (ROW0, ExpertUnavailable, expert_mlp, gqa_attention, moe_layer, rms_norm, route, shared_expert,
                      softmax_route, softmax_router)
from ._packed import matmul_t
from ._rope import cos_sin
from ._segment import Segment
from ._view import PackedWeights

_ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight")
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")


def applies(cfg: ModelConfig, segments: Sequence[Segment]) -> bool:
    """True when `segments` is one sequence's one-row step that `step` runs as `forward_batch` would."""
    if len(segments) != 1 or len(segments[0].ids) != 1 or _packed._native is None:
        return False
    keys = segments[0].cache.length + 1  # the keys the row sees
    return (cfg.mla is None and cfg.qk_norm == "none" and cfg.clip_qkv is None and cfg.chunked_nope is None
            and not cfg.attention_sinks and not any(cfg.attention_chunks) and all(cfg.rope_layers or (True,))
            and all(window is None or keys <= window for window in cfg.sliding_windows))


def step(cfg: ModelConfig, weights: PackedWeights, rope: tuple[np.ndarray, float],
         seg: Segment) -> np.ndarray | None:
    """# one segment of one token id -> logits [1, V] (None when the segment asks for none); its keys and values
    appended to its cache, which commits only after the last layer and the head succeeded (as `forward_batch`)."""
    cache = seg.cache
    cache.check_room(1)
    cos, sin = cos_sin(rope[0], rope[1], np.array([cache.length]))  # [1, d] each
    observe = seg.trace.observe if seg.trace is not None else None
    eps = cfg.rms_norm_eps
    x = weights.embed_rows(seg.ids)  # [1, H]
    make_plan = partial(_LayerPlan, cfg)
    for layer in range(cfg.num_layers):
        plan = weights.layer_derived(layer, "decode_row", make_plan)
        h, y = _attend(cfg, plan, x, cos, sin, cache, layer)
        if cfg.moe_layers[layer]:
            x = _moe(cfg, plan, y, h, weights, layer, weights.observer(layer, observe))
        else:
            w = plan.w
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


class _LayerPlan:
    """What `step` takes from one layer's checked weights `w`, worked out once per trunk shard
    (`PackedWeights.layer_derived`) instead of at every step:
    - `attention`: `attention_step`'s weight arguments (norm, the four projections, biases, post-attention norm),
      or None when they are not all packed and plain (`gqa_attention` then runs);
    - `router`: the layer's `softmax_router` (None: `route` runs)."""

    __slots__ = ("w", "attention", "router")

    def __init__(self, cfg: ModelConfig, w: Mapping):
        self.w = w
        norm, post = w["input_layernorm.weight"], w["post_attention_layernorm.weight"]
        projections = tuple(w[name] for name in _ATTENTION)
        biases = tuple(w.get(name) for name in _BIASES)
        self.attention = None
        if (all(type(p) is _packed.Packed for p in projections)
                and all(_fused.plain(a) for a in (norm, post, *(b for b in biases if b is not None)))):
            self.attention = (norm, tuple(p.native for p in projections), biases, post)
        self.router = softmax_router(w, cfg)


def _attend(cfg: ModelConfig, plan: _LayerPlan, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache,
            layer: int) -> tuple[np.ndarray, np.ndarray]:
    """# row [1, H] -> h = x + attention(rms_norm(x)) [1, H], y = rms_norm(h) [1, H] for the MLP:
    `_layers.gqa_attention` on one row that sees every key, with the norms and the residual around it, in one native
    call (`attention_step`: the products, bias additions, rotary embedding, the row's keys and values written into
    the cache's buffers, `attend_row`, in gqa_attention's order). Weights not packed (a provider's own arrays), a
    rotary embedding over part of a head, or arrays in another form take `gqa_attention` itself."""
    eps = cfg.rms_norm_eps
    if (plan.attention is None or cos.shape[-1] != cfg.head_dim
            or not (_fused.plain(x) and _fused.plain(cos) and _fused.plain(sin))):
        w = plan.w
        h = x + gqa_attention(rms_norm(x, w["input_layernorm.weight"], eps), w, cfg, cos, sin, None,
                              partial(cache.append, layer))
        return h, rms_norm(h, w["post_attention_layernorm.weight"], eps)
    norm, (wq, wk, wv, wo), biases, post = plan.attention
    h, y = np.empty(x.shape, np.float32), np.empty(x.shape, np.float32)
    _packed._native.attention_step(x, norm, eps, wq, wk, wv, wo, biases, cos, sin, *cache.row_buffers(layer),
                                   cache.length, cfg.attn_scale, post, h, y, _packed._threads)
    return h, y


def _route(cfg: ModelConfig, plan: _LayerPlan, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """# normed row y [1, H] -> weights [1, k], expert ids [1, k], scores [1, E]: `route`'s result, by
    `softmax_route` for a layer with a softmax router (the same calls, so the same bits); `route` itself for any
    other router, and where the extension declines (a non-finite logit)."""
    if plan.router is not None:
        routed = softmax_route(y, plan.router, cfg)
        if routed is not None:
            return routed  # type: ignore[return-value]
    return route(y, plan.w, cfg)


def _moe(cfg: ModelConfig, plan: _LayerPlan, y: np.ndarray, h: np.ndarray, weights: PackedWeights, layer: int,
         observe) -> np.ndarray:
    """# normed row y [1, H], residual h [1, H] -> h + the MoE block's output [1, H]: `_layers.moe_layer` on one
    row, in its order (route, observe, the experts' loads started, the shared expert, the routed sum in ascending
    expert order, the shared one added), without its batch plumbing: each expert's output weighted as
    `moe_experts` weights a one-row step's. Packed experts go through one native call (`moe_row`: every expert's
    SwiGLU, the weighted sum, the shared output and the residual), others through `expert_mlp` one by one.
    Llama 4's input-scaled experts, gpt-oss's clamped SwiGLU and a cluster's remote experts take `moe_layer`."""
    w = plan.w
    if weights.remote is not None or cfg.router == "sigmoid_input" or cfg.expert_act == "clamped_swiglu":
        return h + moe_layer(y, w, cfg, weights.expert_fetch(layer), observe)
    gate, idx, scores = _route(cfg, plan, y)  # [1, k] each, [1, E]
    if observe is not None:
        observe(idx, scores)
    chosen = idx[0].tolist()
    ids = sorted(chosen)  # distinct: every router's top-k
    got = weights.experts(layer, ids)
    shared = shared_expert(y, w, cfg)
    gates = gate[0, [chosen.index(e) for e in ids]].astype(np.float32, copy=False)  # [k], in ids' order
    projections = []
    for e in ids:
        try:
            projections.append(weights.expert_projections(layer, e, got[e]))
        except ShardtoolError as cause:  # a bug is not caught here: it fails the whole step
            raise ExpertUnavailable(cause, ROW0) from cause
    packed = all(type(p) is _packed.Packed for three in projections for p in three)
    if (packed and len(projections) <= _packed._native.MAX_TOP_K and _fused.plain(y) and _fused.plain(h)
            and (shared is None or _fused.plain(shared))):
        x = np.empty(h.shape, np.float32)
        _packed._native.moe_row(y, tuple(tuple(p.native for p in three) for three in projections), gates,
                                shared, h, x, _packed._threads)
        return x
    out = None
    for three, g in zip(projections, gates):
        try:
            out_e = expert_mlp(y, *three)
        except ShardtoolError as cause:  # (as around the fetch: the general path fails the row the same way)
            raise ExpertUnavailable(cause, ROW0) from cause
        out_e *= g
        if out is None:
            out = out_e
        else:
            out += out_e
    if shared is not None:
        out += shared
    return h + out
