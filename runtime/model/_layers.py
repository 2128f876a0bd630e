"""The numerical building blocks of the MoE decoders: pure functions on float32 arrays.

Each mirrors the matching transformers v5 module (named in its docstring); a weight comes in `nn.Linear`
orientation [out, in], either as it is stored (`_packed.Packed`, multiplied in its stored dtype) or as a float32
array; vectors (norms, biases) as float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from shardtool.errors import ShardtoolError

from . import _fused, _llama4
from ._config import ModelConfig
from . import _packed
from ._packed import matmul_t
from ._gpt_oss import route_topk_softmax, sink_softmax
from ._rope import apply_rope, apply_rope_interleave

Weights = Mapping[str, "np.ndarray | _packed.Packed"]
# A step's routed experts: x [T, H] and {expert: its token rows [t_e]} in ascending expert order ->
# {expert: () -> its unweighted output expert_mlp(x[rows]) [t_e, H] float32}. A thunk may block until its expert
# is verified (the local store streams them) or its node answered (a cluster); a ShardtoolError raised there
# fails only that expert's rows. Asked once per MoE layer, before the shared expert runs.
ExpertOutputs = Mapping[int, Callable[[], np.ndarray]]
ExpertFetch = Callable[[np.ndarray, Mapping[int, np.ndarray]], ExpertOutputs]

# [T, H] normed input, the layer's weights -> [T, H]: self-attention over each sequence's own cache
Attend = Callable[[np.ndarray, Mapping[str, np.ndarray]], np.ndarray]
# expert ids [T, k], selection scores [T, E] (what top-k ran on) -> None: sees each MoE layer's routing
ObserveRoute = Callable[[np.ndarray, np.ndarray], None]

MLA_NORM_EPS = 1e-6  # DeepseekV3RMSNorm default; q_a_layernorm / kv_a_layernorm do not get rms_norm_eps


def linear(x: np.ndarray, w: np.ndarray | _packed.Packed, b: np.ndarray | None = None) -> np.ndarray:
    """# [m, in], [out, in], [out] -> [m, out]"""
    y = matmul_t(x, w)
    if b is not None:
        y += b
    return y


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """# [..., d], [d] -> [..., d]  (T5/Llama RMSNorm: weight * x * rsqrt(mean(x^2) + eps))"""
    fused = _fused.rms_norm(x, w, eps)
    if fused is not None:
        return fused
    variance = np.add.reduce(x * x, axis=-1, keepdims=True)  # [..., 1]
    variance /= x.shape[-1]  # np.mean's sum and division, less overhead
    variance += np.float32(eps)
    inv = np.sqrt(variance, out=variance)
    np.divide(1.0, inv, out=inv)  # rsqrt, in place: the same float32 operations, fewer temporaries
    y = x * inv
    y *= w
    return y


def sigmoid(x: np.ndarray) -> np.ndarray:
    """# [...] -> [...]; the tanh form never overflows in exp. One temporary, updated in place."""
    y = np.multiply(x, np.float32(0.5))
    np.tanh(y, out=y)
    y += np.float32(1.0)
    y *= np.float32(0.5)
    return y


def silu(x: np.ndarray) -> np.ndarray:
    """# [...] -> [...]"""
    y = sigmoid(x)
    y *= x
    return y


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """# [..., n] -> [..., n]"""
    e = x - np.maximum.reduce(x, axis=axis, keepdims=True)  # np.max's reduction, without its wrapper
    np.exp(e, out=e)
    e /= np.add.reduce(e, axis=axis, keepdims=True)  # np.sum's reduction, in place
    return e


def expert_mlp(x: np.ndarray, gate: _packed.Packed | np.ndarray, up: _packed.Packed | np.ndarray,
               down: _packed.Packed | np.ndarray) -> np.ndarray:
    """# [m, H], [I, H], [I, H], [H, I] -> [m, H]  (SwiGLU: down(silu(gate x) * up x))"""
    if type(gate) is _packed.Packed and type(up) is _packed.Packed and type(down) is _packed.Packed:
        fused = _fused.swiglu(x, gate, up, down)
        if fused is not None:
            return fused
    hidden = silu(matmul_t(x, gate))  # [m, I]
    hidden *= matmul_t(x, up)
    return matmul_t(hidden, down)


def causal_mask(q_pos: np.ndarray, kv_len: int, window: int | None) -> np.ndarray | None:
    """# [T], S -> [T, S] bool (True = may attend), or None when every key is visible.

    Sliding window as transformers' `sliding_window_overlay`: key j is visible from query i when i - j < window.
    """
    if len(q_pos) == 1 and (window is None or kv_len <= window):
        return None
    k_pos = np.arange(kv_len)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return allowed


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
              mask: np.ndarray | None, sinks: np.ndarray | None = None) -> np.ndarray:
    """# [T, nh, d], [kvh, S, d], [kvh, S, dv], [T, S], [nh] -> [T, nh, dv]

    Grouped-query attention: query head h reads key/value head h // (nh / kvh), as transformers' repeat_kv.
    `sinks` (gpt-oss): one learned logit per head that joins the softmax and is then dropped (`sink_softmax`).
    """
    t, nh, d = q.shape
    kvh, s, dv = v.shape
    g = nh // kvh
    if t == 1 and mask is None and sinks is None:
        return attention_row(q, k, v, scale)
    qg = q.reshape(t, kvh, g, d).transpose(1, 2, 0, 3).reshape(kvh, g * t, d)
    scores = qg @ k.transpose(0, 2, 1)  # [kvh, g*T, S]
    scores *= np.float32(scale)
    if mask is not None:
        scores = np.where(mask[None, None], scores.reshape(kvh, g, t, s), -np.inf).reshape(kvh, g * t, s)
    if sinks is None:
        probs = softmax(scores)
    else:
        probs = sink_softmax(scores.reshape(kvh, g, t, s), sinks.reshape(kvh, g)).reshape(kvh, g * t, s)
    out = probs @ v  # [kvh, g*T, dv]
    return out.reshape(kvh, g, t, dv).transpose(2, 0, 1, 3).reshape(t, nh, dv)


def attention_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """# [1, nh, d], [kvh, S, d], [kvh, S, dv] -> [1, nh, dv]: `attention` for one query row that sees every key
    (a decode step): the same products on the same shapes, without the transposes and the mask."""
    fused = _fused.attend_row(q, k, v, scale)
    if fused is not None:
        return fused
    _, nh, d = q.shape
    kvh, _, dv = v.shape
    scores = q.reshape(kvh, nh // kvh, d) @ k.transpose(0, 2, 1)  # [kvh, g, S]
    scores *= np.float32(scale)
    return (softmax(scores) @ v).reshape(1, nh, dv)


@dataclass(frozen=True)
class AttentionParts:
    """A family's self-attention in the parts a batched step runs apart: `project` on all the step's rows at once
    (products, biases, QK norms, clipping: nothing that depends on a row's sequence), `attend` on each sequence's
    rows against its own cache (rotary embedding at its positions, cache append, scores, mask, softmax, sinks,
    values), `output` on all rows again (the output products). Called as a function, the three in a row: one
    sequence's attention, the definition the batched step splits.

    - project: normed rows [T, H], w, cfg -> (per-row tensors, each [T, ...]; what `output` needs besides them)
    - attend: one sequence's rows [t, ...] of each per-row tensor, w, cfg, cos, sin, mask, append_kv -> [t, ...]
    - output: the sequences' results concatenated [T, ...], w, cfg, what `project` gave besides -> [T, H]
    """

    project: Callable
    attend: Callable
    output: Callable

    def __call__(self, x: np.ndarray, w: Weights, cfg: ModelConfig, cos: np.ndarray | None, sin: np.ndarray | None,
                 mask: np.ndarray | None, append_kv: Callable) -> np.ndarray:
        """# one sequence's normed rows [T, H] -> [T, H]"""
        rows, extra = self.project(x, w, cfg)
        return self.output(self.attend(*rows, w, cfg, cos, sin, mask, append_kv), w, cfg, extra)


def gqa_attention(x: np.ndarray, w: Weights, cfg: ModelConfig, cos: np.ndarray, sin: np.ndarray,
                  mask: np.ndarray | None, append_kv: Callable) -> np.ndarray:
    """# [T, H] -> [T, H]  (Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE/Llama 4/gpt-oss self-attention with a KV cache)

    `append_kv(k [kvh, T, d], v [kvh, T, d])` stores this step's keys/values and returns all of them [kvh, S, d].
    """
    return GQA(x, w, cfg, cos, sin, mask, append_kv)


def _gqa_project(x: np.ndarray, w: Weights, cfg: ModelConfig) -> tuple[tuple[np.ndarray, ...], None]:
    """# normed rows [T, H] -> (q [T, nh, hd], k [T, kvh, hd], v [T, kvh, hd]), None: the projections with their
    biases, OLMoE's whole-projection QK norm, the clip, Qwen3's per-head QK norm"""
    t = x.shape[0]
    nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
    k = linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
    v = linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
    if cfg.qk_norm == "full":  # OLMoE: norm over the whole projection, before the head split
        q = rms_norm(q, w["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:
        q, k, v = (np.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
    q, k, v = q.reshape(t, nh, hd), k.reshape(t, kvh, hd), v.reshape(t, kvh, hd)
    if cfg.qk_norm == "per_head":  # Qwen3: norm over each head's channels
        q = rms_norm(q, w["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    return (q, k, v), None


def _gqa_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, w: Weights, cfg: ModelConfig, cos: np.ndarray | None,
                sin: np.ndarray | None, mask: np.ndarray | None, append_kv: Callable) -> np.ndarray:
    """# one sequence's q [t, nh, hd], k [t, kvh, hd], v [t, kvh, hd] -> [t, nh * hd]: rotary embedding (Llama 4's
    or a NoPE layer's positions), its keys and values appended to its cache, attention over them (mask, sinks)"""
    t = q.shape[0]
    if cfg.chunked_nope is not None:  # Llama 4: interleaved RoPE + L2 norm, or a NoPE layer (cos is None)
        q, k = _llama4.position_qk(q, k, cos, sin, cfg.chunked_nope, cfg.rms_norm_eps,
                                   cfg.rope.interleave)
    elif not (t == 1 and _fused.rope_row(q, k, cos, sin)):  # one decode row: rotated in place, natively
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = append_kv(k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    if cfg.chunked_nope is not None and cos is None:
        q = _llama4.nope_temperature(q, keys.shape[1] - t, cfg.chunked_nope)
    out = attention(q, keys, values, cfg.attn_scale, mask, w.get("self_attn.sinks"))
    return out.reshape(t, cfg.num_heads * cfg.head_dim)


def _gqa_output(out: np.ndarray, w: Weights, cfg: ModelConfig, extra: None) -> np.ndarray:
    """# [T, nh * hd] -> [T, H]"""
    return linear(out, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))


GQA = AttentionParts(_gqa_project, _gqa_attend, _gqa_output)


def mla_attention(x: np.ndarray, w: Weights, cfg: ModelConfig, cos: np.ndarray, sin: np.ndarray,
                  mask: np.ndarray | None, append_kv: Callable) -> np.ndarray:
    """# [T, H] -> [T, H]  (DeepSeek-V3 multi-head latent attention, DeepseekV3Attention)

    The cache holds the compressed latent c [S, r] and the shared rotary key [S, dr] (`append_kv(c, k_rot)`
    returns all of them). Instead of expanding c into per-head keys and values with kv_b_proj for every
    cached token, kv_b_proj is folded into the query and the output ("weight absorption"); the result is
    the same sum of products in a different order.
    """
    return MLA(x, w, cfg, cos, sin, mask, append_kv)


def _mla_project(x: np.ndarray, w: Weights, cfg: ModelConfig) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """# normed rows [T, H] -> (q_latent [T, nh, r], q_pe [T, nh, dr], latent [T, r], k_pe [T, dr]), kv_b_proj
    [nh, dn + dv, r] float32: the low-rank projections and their norms, the query's no-rotary part absorbed into
    the latent space (q_latent), the rotary parts not rotated yet"""
    m = cfg.mla
    t, nh = x.shape[0], cfg.num_heads
    dn, dr, dv, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    if m.q_lora_rank is None:
        q = linear(x, w["self_attn.q_proj.weight"])
    else:
        q_a = linear(x, w["self_attn.q_a_proj.weight"], w.get("self_attn.q_a_proj.bias"))
        q = linear(rms_norm(q_a, w["self_attn.q_a_layernorm.weight"], MLA_NORM_EPS), w["self_attn.q_b_proj.weight"])
    q = q.reshape(t, nh, dn + dr)
    compressed = linear(x, w["self_attn.kv_a_proj_with_mqa.weight"], w.get("self_attn.kv_a_proj_with_mqa.bias"))
    latent = rms_norm(compressed[:, :r], w["self_attn.kv_a_layernorm.weight"], MLA_NORM_EPS)  # [T, r]
    w_kv = _dense(w["self_attn.kv_b_proj.weight"]).reshape(nh, dn + dv, r)
    q_latent = q[:, :, :dn].transpose(1, 0, 2) @ w_kv[:, :dn]  # [nh, T, dn] @ [nh, dn, r] -> [nh, T, r]
    return (q_latent.transpose(1, 0, 2), q[:, :, dn:], latent, compressed[:, r:]), w_kv


def _mla_attend(q_latent: np.ndarray, q_pe: np.ndarray, latent: np.ndarray, k_pe: np.ndarray, w: Weights,
                cfg: ModelConfig, cos: np.ndarray, sin: np.ndarray, mask: np.ndarray | None,
                append_kv: Callable) -> np.ndarray:
    """# one sequence's q_latent [t, nh, r], q_pe [t, nh, dr], latent [t, r], k_pe [t, dr] -> out_latent [t, nh, r]:
    rotary embedding at its positions, its latents and rotary keys appended to its cache, attention over them in
    the latent space"""
    t, nh, r = q_latent.shape
    dr = q_pe.shape[2]
    rope = apply_rope_interleave if cfg.rope.interleave else apply_rope
    q_rot = rope(q_pe, cos, sin)  # [t, nh, dr]
    k_rot = rope(k_pe[:, None], cos, sin)[:, 0]  # [t, dr], one head shared by all
    latents, k_rots = append_kv(latent, k_rot)  # [S, r], [S, dr]
    s = latents.shape[0]
    scores = (q_latent.transpose(1, 0, 2).reshape(nh * t, r) @ latents.T
              + q_rot.transpose(1, 0, 2).reshape(nh * t, dr) @ k_rots.T).reshape(nh, t, s)
    scores *= np.float32(cfg.attn_scale)
    if mask is not None:
        scores = np.where(mask[None], scores, -np.inf)
    out_latent = (softmax(scores).reshape(nh * t, s) @ latents).reshape(nh, t, r)
    return out_latent.transpose(1, 0, 2)


def _mla_output(out_latent: np.ndarray, w: Weights, cfg: ModelConfig, w_kv: np.ndarray) -> np.ndarray:
    """# out_latent [T, nh, r], kv_b_proj [nh, dn + dv, r] -> [T, H]: the latent values back to each head's (the
    absorbed value projection), then the output product"""
    t, nh, _ = out_latent.shape
    dn, dv = cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim
    out = out_latent.transpose(1, 0, 2) @ w_kv[:, dn:].transpose(0, 2, 1)  # [nh, T, r] @ [nh, r, dv] -> [nh, T, dv]
    out = out.transpose(1, 0, 2).reshape(t, nh * dv)
    return linear(out, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))


MLA = AttentionParts(_mla_project, _mla_attend, _mla_output)


def _dense(w: np.ndarray | _packed.Packed) -> np.ndarray:
    """# [out, in] -> float32 [out, in]: MLA's kv_b_proj is split per head, not multiplied whole (a float32 weight
    as it is; another dtype expanded for this use, the one weight the forward pass still expands)."""
    return _packed.to_float32(w) if type(w) is _packed.Packed else w


def picked(scores: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """# [T, n], [T, k] indices -> [T, k]: scores[t, idx[t, j]] (np.take_along_axis's values, less overhead)"""
    if len(idx) == 1 and scores.flags.c_contiguous:  # one decode row: its ids are flat indices, no index grid
        return scores.take(idx)
    return scores[np.arange(len(idx))[:, None], idx]


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """# [T, n] -> [T, k] indices of the k largest (order unspecified, as torch.topk(sorted=False))."""
    return (-scores).argpartition(k - 1, axis=-1)[:, :k]  # np.argpartition's call, without its wrapper


def route_softmax_topk(logits: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """# [T, E] -> weights [T, k], expert ids [T, k]  (Mixtral/Qwen/OLMoE TopKRouter)"""
    return _route_softmax_topk(logits, k, norm_topk_prob)[:2]


def _route_softmax_topk(logits: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, ...]:
    """# -> weights [T, k], expert ids [T, k], selection scores [T, E] (the probabilities)"""
    fused = _fused.route_softmax_topk(logits, k, norm_topk_prob)
    if fused is not None:
        return fused
    probs = softmax(logits)
    idx = _top_k(probs, k)
    weights = picked(probs, idx)
    if norm_topk_prob:
        weights = weights / np.add.reduce(weights, axis=-1, keepdims=True)  # np.sum's reduction
    return weights, idx, probs


def route_deepseek(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int,
                   norm_topk_prob: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """# [T, E], [E] -> weights [T, k], expert ids [T, k]  (DeepseekV3TopkRouter)

    Sigmoid scores; `e_score_correction_bias` only steers selection. Experts are picked from the
    `topk_group` groups whose two best biased scores sum highest; weights are the unbiased scores.
    """
    return _route_deepseek(logits, bias, k, n_group, topk_group, norm_topk_prob, scaling)[:2]


def _route_deepseek(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int,
                    norm_topk_prob: bool, scaling: float) -> tuple[np.ndarray, ...]:
    """# -> weights [T, k], expert ids [T, k], selection scores [T, E] (biased, -inf outside the chosen groups)"""
    t, e = logits.shape
    scores = sigmoid(logits)
    choice = scores + bias
    grouped = choice.reshape(t, n_group, e // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [T, n_group]
    groups = _top_k(group_scores, topk_group)
    group_mask = np.zeros((t, n_group), dtype=bool)
    np.put_along_axis(group_mask, groups, True, axis=-1)
    choice = np.where(np.repeat(group_mask, e // n_group, axis=-1), choice, -np.inf)
    idx = _top_k(choice, k)
    weights = picked(scores, idx)
    if norm_topk_prob:
        weights = weights / (np.sum(weights, axis=-1, keepdims=True) + np.float32(1e-20))
    return weights * np.float32(scaling), idx, choice


# The router's tensors in a layer's trunk: what `route` reads, and all that `predict_experts` needs of a layer.
ROUTER_TENSORS = ("post_attention_layernorm.weight", "mlp.gate.weight", "mlp.gate.bias", "mlp.gate.e_score_correction_bias")


def predict_experts(hidden: np.ndarray, w: Weights, cfg: ModelConfig) -> np.ndarray:
    """# a hidden state [T, H] that has not reached layer l yet, layer l's router tensors -> expert ids [T, k]

    Lookahead (Eliseev & Mazur 2023, "Fast inference of Mixture-of-Experts language models with offloading"): the
    residual stream changes little from one layer to the next, so layer l's router applied to the state entering
    layer l (before its attention) mostly picks the experts it will pick after it. Only a guess for prefetching: the
    layer routes on its real input."""
    return route(rms_norm(hidden, w["post_attention_layernorm.weight"], cfg.rms_norm_eps), w, cfg)[1]


class ExpertUnavailable(Exception):
    """An expert some rows of a step chose could not be had (its shard failed verification or does not fit the
    config). Carries the rows, so a batch can fail only the sequences that need that expert."""

    def __init__(self, cause: ShardtoolError, rows: np.ndarray):
        super().__init__(str(cause))
        self.cause, self.rows = cause, rows


def expert_groups(idx: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """# [T, k] expert ids -> {expert: (token rows [t_e], slots [t_e])} in ascending expert order."""
    if idx.shape[0] == 1:  # a decode step of one sequence: its k distinct experts, each on row 0
        row = idx[0].tolist()
        slots = _slots(len(row))
        return {e: (ROW0, slots[row.index(e)]) for e in sorted(row)}
    groups = {}
    for e in np.unique(idx):
        tokens, slots = np.nonzero(idx == e)
        groups[int(e)] = (tokens, slots)
    return groups


ROW0 = np.zeros(1, np.intp)  # [1]: the token rows of a one-row step (read-only, shared)
ROW0.flags.writeable = False


@functools.cache
def _slots(k: int) -> np.ndarray:
    """# k -> [k, 1]: row j is the one-slot index array [j] (read-only, shared by every decode step)"""
    slots = np.arange(k).reshape(k, 1)
    slots.flags.writeable = False
    return slots


def moe_experts(x: np.ndarray, weights: np.ndarray, groups: Mapping[int, tuple[np.ndarray, np.ndarray]],
                outputs: ExpertOutputs) -> np.ndarray:
    """# [T, H], [T, k], {expert: (rows, slots)}, {expert: () -> [t_e, H]} -> [T, H]: the weighted sum over each
    token's experts. The one place expert outputs are combined, whether they were computed here or by cluster
    nodes: in ascending expert order, `out[rows] += y * weight`, so both give the same float32 result.

    Each expert ran once on all its tokens, whichever sequence of a batch they belong to."""
    out = np.zeros_like(x) if x.shape[0] > 1 else None  # one row: its first weighted output starts the sum
    for e, (tokens, slots) in groups.items():
        try:
            y = outputs[e]()
        except ShardtoolError as cause:  # a bug is not caught here: it fails the whole step
            raise ExpertUnavailable(cause, tokens) from cause
        if out is None:  # (0 + a is a: the same float32 sum, without the zeros and one addition; a zero keeps its sign)
            out = y * weights[0, slots[0]]
        elif tokens is ROW0:  # one decode row: the same float32 sum without fancy indexing
            out += y * weights[0, slots[0]]
        else:
            out[tokens] += y * weights[tokens, slots, None]
    return out if out is not None else np.zeros_like(x)


def route(x: np.ndarray, w: Weights, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """# normed MLP input [T, H], the layer's weights -> weights [T, k], expert ids [T, k], selection scores [T, E]:
    the layer's router on x, as the config's family routes (its router bias, if any, added to the logits).

    The definition of a layer's routing: the MoE layer routes with it, the lookahead predicts with it. A decode row
    whose layer has a `softmax_router` calls `softmax_route` on it directly, the same calls as here."""
    logits = linear(x, w["mlp.gate.weight"], w.get("mlp.gate.bias"))  # [T, E]
    if cfg.router == "topk_softmax":
        return route_topk_softmax(logits, cfg.top_k)
    if cfg.router == "sigmoid_group":
        return _route_deepseek(logits, w["mlp.gate.e_score_correction_bias"], cfg.top_k, cfg.n_group,
                               cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    if cfg.router == "sigmoid_input":
        return _llama4.route(logits, cfg.top_k)
    return _route_softmax_topk(logits, cfg.top_k, cfg.norm_topk_prob)


def softmax_router(w: Weights, cfg: ModelConfig) -> _packed.Packed | None:
    """# the layer's weights -> its packed router [E, H] when `route` routes the layer by the extension's
    `route_softmax` (a softmax router, no router bias, E and k within the extension's limits), else None. Worked out
    once per trunk shard by the decode row, which then routes with `softmax_route`."""
    router = w.get("mlp.gate.weight")
    if (cfg.router == "softmax" and type(router) is _packed.Packed and w.get("mlp.gate.bias") is None
            and _fused.route_softmax_takes(router.shape[0], cfg.top_k)):
        return router
    return None


def softmax_route(x: np.ndarray, router: _packed.Packed, cfg: ModelConfig) -> tuple[np.ndarray, ...] | None:
    """# [T, H], a `softmax_router` [E, H] -> `route`'s result, by the same calls `route` makes for that layer
    (the product, then `route_softmax`), without its dispatch; None where the extension declines (a non-finite
    logit: `route`'s numpy softmax then defines the result)."""
    return _fused.route_softmax_topk(matmul_t(x, router), cfg.top_k, cfg.norm_topk_prob)


def moe_layer(x: np.ndarray, w: Weights, cfg: ModelConfig, fetch: ExpertFetch,
              observe: ObserveRoute | None = None) -> np.ndarray:
    """# [T, H] -> [T, H]: router -> top-k -> selected experts (+ the family's shared expert).

    `observe(idx, scores)`, when given, sees the routing (run receipts record it, their replay checks it)."""
    weights, idx, scores = route(x, w, cfg)
    if observe is not None:
        observe(idx, scores)
    # Ask for the routed experts first: a streaming provider loads them (cluster nodes compute them) while the
    # shared expert computes.
    groups = expert_groups(idx)
    x_in, rows = x, {e: tokens for e, (tokens, _) in groups.items()}
    if cfg.router == "sigmoid_input":  # Llama 4: the scores scale each expert's input; outputs summed unweighted
        x_in, rows, weights = _llama4.scale_expert_inputs(x, weights, groups)
    outputs = fetch(x_in, rows)
    shared = shared_expert(x, w, cfg)
    out = moe_experts(x, weights.astype(np.float32, copy=False), groups, outputs)
    if shared is not None:
        out += shared  # added after the routed sum, as before: the same float32 result
    return out


def shared_expert(x: np.ndarray, w: Weights, cfg: ModelConfig) -> np.ndarray | None:
    """# [T, H] -> [T, H]: the family's shared expert on every row (None: the family has none). `moe_layer` adds it
    after the routed sum."""
    shared = None
    if cfg.shared_expert in ("gated", "one"):  # Qwen2-MoE: behind sigmoid(shared_expert_gate x); Llama 4: plain
        shared = expert_mlp(x, w["mlp.shared_expert.gate_proj.weight"], w["mlp.shared_expert.up_proj.weight"],
                            w["mlp.shared_expert.down_proj.weight"])
    if cfg.shared_expert == "gated":
        shared = sigmoid(matmul_t(x, w["mlp.shared_expert_gate.weight"])) * shared
    elif cfg.shared_expert == "plain":  # DeepSeek-V3: shared experts always run
        shared = expert_mlp(x, w["mlp.shared_experts.gate_proj.weight"], w["mlp.shared_experts.up_proj.weight"],
                            w["mlp.shared_experts.down_proj.weight"])
    return shared


def decoder_layer(x: np.ndarray, w: Weights, cfg: ModelConfig, layer: int, attend: Attend,
                  fetch: ExpertFetch, observe: ObserveRoute | None = None) -> np.ndarray:
    """# [T, H] -> [T, H]  (pre-norm residual block: attention, then MoE or dense MLP)

    The rows may belong to several sequences (a batch): `attend` runs each sequence's rows against its own
    cache; the MLP and the experts run on all rows at once, so each expert is fetched once per step."""
    h = x + attend(rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps), w)
    y = rms_norm(h, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    if cfg.moe_layers[layer]:
        return h + moe_layer(y, w, cfg, fetch, observe)
    return h + expert_mlp(y, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
