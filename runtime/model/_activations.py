"""How much scratch memory one forward step takes, and so how many prompt tokens one prefill step may take.

The forward pass allocates temporaries that scale with the number of query tokens T in a step, and
attention scores that scale with T times the keys S it attends to (per head). A whole prompt in one step
is quadratic: a 3,000-token prompt on a 4-head model wants 144 MB per copy of its scores. Prefill therefore
runs in chunks of at most `prefill_chunk` tokens, sized so one step stays inside the activation reserve.

`step_bytes` is an upper estimate, counted from the shapes each building block in `_layers.py` allocates
(float32 unless noted) and how many of them are alive at once; tests/runtime check it against measured
peaks. It depends only on the validated, capped config, never on shard contents.
"""

from __future__ import annotations

from ._cache import bytes_per_token
from ._config import ModelConfig

F32 = 4
# Attention scores [heads, T, S]: the product, the masked copy and softmax's shifted, exponentiated and
# normalised arrays; at most three are alive at once (`attention`, `softmax`), one more for MLA's two
# score products being summed.
SCORE_COPIES = 4
# Mask bytes per (query, key): the bool mask, its sliding-window half, and the int64 position differences
# `causal_mask` computes for a window.
MASK_BYTES = 1 + 1 + 8
# Sampling one token: the float32 logits, float64 scaled / probabilities / sorted / cumulative sums and the
# int64 sort order, a few alive at once.
SAMPLING_BYTES_PER_VOCAB = F32 + 6 * 8
# Python objects, index arrays and other small allocations of one step, whatever its size.
STEP_OVERHEAD = 1 << 20


def _attention_per_query(cfg: ModelConfig) -> int:
    """float32 elements per query token in attention, apart from the scores."""
    nh = cfg.num_heads
    if cfg.mla is None:
        hd, kvh = cfg.head_dim, cfg.num_kv_heads
        # q, k, v; rotary (concatenated halves, two products, their sum); grouped q; output; its transpose;
        # Llama 4's L2 q/k norm or NoPE temperature (a squared copy and the result)
        extra = 2 * (nh + kvh) * hd if cfg.chunked_nope is not None else 0
        return nh * hd * 7 + kvh * hd * 6 + extra
    m = cfg.mla
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    q_in = m.q_lora_rank or 0
    # q (and its low-rank input), the compressed kv row, rotary parts, q absorbed into the latent space,
    # the latent output, the value heads and their transpose.
    return q_in * 3 + nh * dq * 2 + (m.kv_lora_rank + m.qk_rope_head_dim) * 4 + nh * m.qk_rope_head_dim * 4 \
        + nh * m.kv_lora_rank * 3 + nh * m.v_head_dim * 3


def _mlp_per_query(cfg: ModelConfig) -> int:
    """float32 elements per query token in the MLP: the widest of the dense MLP, a routed expert and the
    shared expert (SwiGLU: gate, up, sigmoid's temporaries, the product), the router's scores, and the
    shared expert's output kept beside the routed sum."""
    widths = [cfg.moe_intermediate_size]
    if not all(cfg.moe_layers):
        widths.append(cfg.intermediate_size)
    if cfg.shared_expert != "none":
        widths.append(cfg.shared_intermediate_size)
    # gpt-oss's clamped SwiGLU adds its clamped copies, the scaled gate and (up + 1), and the expert biases
    swiglu = 10 if cfg.expert_act == "clamped_swiglu" else 6
    scaled = cfg.top_k * cfg.hidden_size if cfg.router == "sigmoid_input" else 0  # Llama 4's scaled expert inputs
    return swiglu * max(widths) + 8 * cfg.num_experts + 4 * cfg.hidden_size + scaled


def per_query_bytes(cfg: ModelConfig, keys: int) -> int:
    """Bytes one query token adds to a forward step that attends over `keys` keys."""
    h = cfg.hidden_size
    rotary = 6 * cfg.rope.dim  # cos, sin, the angle table and its doubled copy
    # a row whose logits a step returns (each decoding sequence of a batch) holds a float32 row of the vocabulary
    linear = 8 * h + rotary + _attention_per_query(cfg) + _mlp_per_query(cfg) + cfg.vocab_size
    return F32 * linear + (F32 * SCORE_COPIES * cfg.num_heads + MASK_BYTES) * keys


def fixed_bytes(cfg: ModelConfig, keys: int) -> int:
    """Bytes a step needs whatever its number of queries: the last position's logits and sampling from them,
    and one layer's cached keys and values, which a matmul may copy to make them contiguous."""
    return STEP_OVERHEAD + SAMPLING_BYTES_PER_VOCAB * cfg.vocab_size + bytes_per_token(cfg) // cfg.num_layers * keys


def step_bytes(cfg: ModelConfig, queries: int, keys: int) -> int:
    """Upper estimate of the scratch bytes of one forward step of `queries` tokens over `keys` keys."""
    return queries * per_query_bytes(cfg, keys) + fixed_bytes(cfg, keys)


def step_rows(cfg: ModelConfig, reserve: int, keys: int) -> int:
    """The most query rows one step over at most `keys` keys may take within `reserve` bytes (at least 1)."""
    return max(1, (reserve - fixed_bytes(cfg, keys)) // per_query_bytes(cfg, keys))


def prefill_chunk(cfg: ModelConfig, reserve: int, tokens: int) -> int:
    """The most prompt tokens one prefill step may take so that any step of a `tokens`-token prompt fits in
    `reserve` bytes (every chunk attends over at most `tokens` keys). At least 1: the plan reserves room
    for one query over the longest sequence (`step_bytes(cfg, 1, max_tokens)`)."""
    room = reserve - fixed_bytes(cfg, tokens)
    return max(1, min(tokens, room // per_query_bytes(cfg, tokens)))
