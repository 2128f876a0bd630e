"""Write small, real Hugging Face-layout MoE checkpoints (config, tokenizer, safetensors) without torch.

Names, shapes and dtypes are what transformers (checked against 5.24) loads; `python examples/make_tiny_moe.py -h`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import zlib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable

import ml_dtypes
import numpy as np

try:
    from shardtool.errors import StorageError, UsageError
except ModuleNotFoundError:  # run as a script from a checkout where `pip install -e .` was not done
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from shardtool.errors import StorageError, UsageError
from shardtool.formats import MXFP4

MXFP4_GROUP = MXFP4.block[1]  # gpt-oss MXFP4: 32 FP4 weights in 16 bytes share one scale byte

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "fused", "gpt_oss", "llama4")
DTYPES = ("f32", "f16", "bf16")

_NP_DTYPES = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
    "u8": np.dtype(np.uint8),
}
_CONFIG_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}

# Special tokens sit at ids 0..2 (the BPE trainer places them first, in this order).
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
_MIN_VOCAB = 256 + 3  # byte-level alphabet + the special tokens

FP8_BLOCK = 128  # DeepSeek-V3 quantizes in 128x128 blocks ("weight_block_size": [128, 128])
_FP4_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of a uniformly random 4-bit code
# What gpt-oss's released config.json says: only the routed experts are MXFP4.
MXFP4_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_POOL_SIGMAS = 4.0  # pool values are N(0,1) scaled so that 4 sigma maps to _FP8_MAX

# Random values are cut from one seeded N(0, 1) pool at per-tensor random offsets: multi-GB checkpoints
# are then memcpy-speed. The odd length keeps tensors larger than the pool from repeating row-aligned.
_POOL_LEN = (1 << 22) + 15


@dataclass(frozen=True)
class Knobs:
    """Size and format knobs. `None` means "the family's default" (see `_resolve`)."""

    layers: int = 2
    experts: int = 4
    hidden: int = 64
    # Defaults keep hidden, intermediate, moe_intermediate and 2*moe_intermediate all different, so a
    # transposed or mis-sliced tensor can never pass a shape check by accident.
    intermediate: int = 96  # dense MLP width (dense layers, qwen2 shared expert, llama4 dense layers)
    moe_intermediate: int = 40  # width of one routed expert (and llama4's / deepseek's shared expert)
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    experts_per_tok: int | None = None  # default 2 (llama4: 1)
    dtype: str = "bf16"
    seed: int = 0
    shard_size_mb: float = 5000.0  # MB = 10**6 bytes, like HF's max_shard_size="5000MB"
    dense_layers: int | None = None  # leading non-MoE layers; default deepseek_v3: 1, others: 0
    fp8: bool = False  # deepseek_v3 only
    mxfp4: bool = False  # gpt_oss only: experts as U8 MXFP4 blocks + scales (hidden, moe_intermediate % 32 == 0)
    mtp_layers: int | None = None  # deepseek_v3 only; default 1
    n_group: int | None = None  # deepseek_v3 only
    topk_group: int | None = None  # deepseek_v3 only
    q_lora_rank: int | None = None  # deepseek_v3 only; 0 = no q compression (q_proj)
    kv_lora_rank: int | None = None  # deepseek_v3 only
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    chat_template: bool = True  # tokenizer_config.json carries CHAT_TEMPLATE; False: a model without one
    attention_chunk_size: int | None = None  # llama4 only; default 8192 (transformers')
    nope_interval: int | None = None  # llama4 only: every n-th layer is a NoPE layer; default 4 (transformers')

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("dtype", "fp8", "mxfp4", "tie_word_embeddings", "shard_size_mb", "chat_template") \
                    or value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise UsageError(f"{f.name} must be an integer, got {value!r}")
            if value < 0 or (value == 0 and f.name not in ("dense_layers", "mtp_layers", "seed", "q_lora_rank")):
                raise UsageError(f"{f.name} must be > 0, got {value}")
        if self.dtype not in DTYPES:
            raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.shard_size_mb > 0:
            raise UsageError(f"shard_size_mb must be > 0, got {self.shard_size_mb}")
        if self.hidden % self.heads:
            raise UsageError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise UsageError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.vocab < _MIN_VOCAB:
            raise UsageError(f"vocab must be >= {_MIN_VOCAB} (byte-level BPE alphabet + 3 special tokens), "
                             f"got {self.vocab}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its HF name, shape, storage dtype and how to fill it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # key of _NP_DTYPES
    std: float
    mean: float = 0.0
    # "normal" | "fp8" (quantized weight) | "fp8_scale" (its weight_scale_inv) | "mxfp4_blocks" | "mxfp4_scales"
    kind: str = "normal"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _NP_DTYPES[self.dtype].itemsize


# ---------------------------------------------------------------------------------------------------------
# Pure: knobs -> (config.json dict, tensor specs) for each family.


def _resolve(family: str, k: Knobs) -> Knobs:
    """Fill family defaults and reject knobs the family cannot express."""
    if family not in FAMILIES:
        raise UsageError(f"unknown family {family!r}", hint=f"choose one of {', '.join(FAMILIES)}")
    is_ds = family == "deepseek_v3"
    k = replace(
        k,
        experts_per_tok=k.experts_per_tok if k.experts_per_tok is not None else (1 if family == "llama4" else 2),
        dense_layers=k.dense_layers if k.dense_layers is not None else (1 if is_ds else 0),
        mtp_layers=k.mtp_layers if k.mtp_layers is not None else (1 if is_ds else 0),
    )
    if k.experts_per_tok > k.experts:
        raise UsageError(f"experts_per_tok ({k.experts_per_tok}) must be <= experts ({k.experts})")
    if k.dense_layers > k.layers:
        raise UsageError(f"dense_layers ({k.dense_layers}) must be <= layers ({k.layers})")
    if k.dense_layers and family in ("mixtral", "olmoe", "gpt_oss"):
        raise UsageError(f"{family} has no dense layers; dense_layers must be 0, got {k.dense_layers}")
    if k.mxfp4 and family != "gpt_oss":
        raise UsageError(f"mxfp4 is a gpt_oss option, not valid for {family}")
    if k.mxfp4 and (k.hidden % MXFP4_GROUP or k.moe_intermediate % MXFP4_GROUP):
        raise UsageError(f"mxfp4 needs hidden ({k.hidden}) and moe_intermediate ({k.moe_intermediate}) to be "
                         f"multiples of {MXFP4_GROUP}")
    if not is_ds:
        for name in ("fp8", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank"):
            if getattr(k, name):
                raise UsageError(f"{name} is a deepseek_v3 option, not valid for {family}")
        if k.mtp_layers:
            raise UsageError(f"mtp_layers is a deepseek_v3 option, not valid for {family}")
        if family != "llama4":
            for name in ("attention_chunk_size", "nope_interval"):
                if getattr(k, name) is not None:
                    raise UsageError(f"{name} is a llama4 option, not valid for {family}")
        return k
    n_group = k.n_group if k.n_group is not None else (2 if k.experts % 2 == 0 and k.experts >= 4 else 1)
    topk_group = k.topk_group if k.topk_group is not None else max(1, n_group // 2)
    if k.experts % n_group:
        raise UsageError(f"experts ({k.experts}) must be a multiple of n_group ({n_group})")
    if n_group > 1 and k.experts // n_group < 2:
        raise UsageError(f"each expert group needs >= 2 experts (DeepSeek scores a group by its top 2); "
                         f"experts={k.experts}, n_group={n_group}")
    if topk_group > n_group or k.experts_per_tok > topk_group * (k.experts // n_group):
        raise UsageError(f"experts_per_tok={k.experts_per_tok} cannot be picked from topk_group={topk_group} "
                         f"groups of {k.experts // n_group} experts")
    return replace(
        k,
        n_group=n_group,
        topk_group=topk_group,
        q_lora_rank=k.q_lora_rank if k.q_lora_rank is not None else max(1, k.hidden // 2),
        kv_lora_rank=k.kv_lora_rank if k.kv_lora_rank is not None else max(1, k.hidden // 4),
    )


def _std(fan_in: int) -> float:
    # ~1/sqrt(fan_in) keeps activations O(1); clamped to the 0.02-0.1 range real checkpoints show.
    return min(0.1, max(0.02, fan_in ** -0.5))


class _Specs:
    """Accumulates TensorSpecs in module order (the order HF iterates a state dict when sharding)."""

    def __init__(self, dtype: str, fp8: bool = False):
        self.dtype = dtype
        self.fp8 = fp8
        self.items: list[TensorSpec] = []

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0,
               dtype: str | None = None) -> None:
        self.items.append(TensorSpec(name, tuple(shape), dtype or self.dtype, std, mean))

    def linear(self, name: str, out_f: int, in_f: int, *, quantize: bool = True, bias: bool = False) -> None:
        """nn.Linear weight [out, in]; under --fp8 an F8_E4M3 weight plus its block `weight_scale_inv`."""
        std = _std(in_f)
        if self.fp8 and quantize:
            self.items.append(TensorSpec(f"{name}.weight", (out_f, in_f), "fp8", std, kind="fp8"))
            scale_shape = (-(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK))
            self.items.append(TensorSpec(f"{name}.weight_scale_inv", scale_shape, "f32", std, kind="fp8_scale"))
        else:
            self.normal(f"{name}.weight", (out_f, in_f), std)
        if bias:
            self.normal(f"{name}.bias", (out_f,), 0.02)

    def mxfp4(self, name: str, experts: int, out_f: int, in_f: int) -> None:
        """Fused expert weights as MXFP4: `name`_blocks [E, out, in/32, 16] and `name`_scales [E, out, in/32]."""
        groups = in_f // MXFP4_GROUP
        self.items.append(TensorSpec(f"{name}_blocks", (experts, out_f, groups, MXFP4_GROUP // 2), "u8",
                                     _std(in_f), kind="mxfp4_blocks"))
        self.items.append(TensorSpec(f"{name}_scales", (experts, out_f, groups), "u8", _std(in_f),
                                     kind="mxfp4_scales"))

    def norm(self, name: str, size: int) -> None:
        # Not all ones: split/join tests must be able to tell one layer's norm from another's.
        self.normal(f"{name}.weight", (size,), 0.05, mean=1.0)

    def router(self, name: str, experts: int, hidden: int, dtype: str | None = None) -> None:
        # Router logits ~ N(0, 2^2) on normalized input, so different tokens pick different experts.
        self.normal(name, (experts, hidden), 2.0 / math.sqrt(hidden), dtype=dtype)

    def swiglu(self, prefix: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> None:
        gate, up, down = names
        self.linear(f"{prefix}.{gate}", inter, hidden)
        self.linear(f"{prefix}.{up}", inter, hidden)
        self.linear(f"{prefix}.{down}", hidden, inter)


def _gqa_attention(s: _Specs, p: str, k: Knobs, *, bias: bool = False, o_bias: bool = False,
                   qk_norm: tuple[int, int] | None = None) -> None:
    hd = k.head_dim
    s.linear(f"{p}.q_proj", k.heads * hd, k.hidden, bias=bias)
    s.linear(f"{p}.k_proj", k.kv_heads * hd, k.hidden, bias=bias)
    s.linear(f"{p}.v_proj", k.kv_heads * hd, k.hidden, bias=bias)
    s.linear(f"{p}.o_proj", k.hidden, k.heads * hd, bias=o_bias)
    if qk_norm is not None:
        s.norm(f"{p}.q_norm", qk_norm[0])
        s.norm(f"{p}.k_norm", qk_norm[1])


def _embed(s: _Specs, k: Knobs) -> None:
    s.normal("model.embed_tokens.weight", (k.vocab, k.hidden), 0.1)


def _head(s: _Specs, k: Knobs) -> None:
    s.norm("model.norm", k.hidden)
    if not k.tie_word_embeddings:
        s.normal("lm_head.weight", (k.vocab, k.hidden), _std(k.hidden))


def _base_config(k: Knobs, model_type: str, architecture: str, rope_theta: float, rms_eps: float) -> dict:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": k.vocab,
        "hidden_size": k.hidden,
        "num_hidden_layers": k.layers,
        "num_attention_heads": k.heads,
        "num_key_value_heads": k.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": k.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": rms_eps,
        # rope_theta is what hub checkpoints carry; rope_parameters is the transformers>=5 form. Both agree.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_dropout": 0.0,
        "num_experts_per_tok": k.experts_per_tok,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": k.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": _CONFIG_DTYPE[k.dtype],
    }


def _mixtral(k: Knobs) -> tuple[dict, list[TensorSpec]]:
    cfg = _base_config(k, "mixtral", "MixtralForCausalLM", 1e6, 1e-5)
    cfg.update(intermediate_size=k.moe_intermediate, num_local_experts=k.experts, sliding_window=None,
               router_jitter_noise=0.0, router_aux_loss_coef=0.02)
    s = _Specs(k.dtype)
    _embed(s, k)
    for i in range(k.layers):
        p = f"model.layers.{i}"
        s.norm(f"{p}.input_layernorm", k.hidden)
        _gqa_attention(s, f"{p}.self_attn", k)
        s.norm(f"{p}.post_attention_layernorm", k.hidden)
        s.router(f"{p}.block_sparse_moe.gate.weight", k.experts, k.hidden)
        for e in range(k.experts):
            s.swiglu(f"{p}.block_sparse_moe.experts.{e}", k.hidden, k.moe_intermediate, names=("w1", "w3", "w2"))
    _head(s, k)
    return cfg, s.items


def _qwen_like(k: Knobs, family: str) -> tuple[dict, list[TensorSpec]]:
    """qwen2_moe, qwen3_moe, and `fused` (qwen3_moe with transformers>=5 fused 3-D expert tensors)."""
    qwen2 = family == "qwen2_moe"
    mlp_only = list(range(k.dense_layers))
    if qwen2:
        cfg = _base_config(k, "qwen2_moe", "Qwen2MoeForCausalLM", 1e6, 1e-6)
        cfg.update(shared_expert_intermediate_size=k.intermediate, norm_topk_prob=False)
    else:
        cfg = _base_config(k, "qwen3_moe", "Qwen3MoeForCausalLM", 1e6, 1e-6)
        cfg.update(head_dim=k.head_dim, attention_bias=False, norm_topk_prob=True)
    cfg.update(intermediate_size=k.intermediate, moe_intermediate_size=k.moe_intermediate, num_experts=k.experts,
               decoder_sparse_step=1, mlp_only_layers=mlp_only, use_sliding_window=False, sliding_window=None)
    if qwen2:
        cfg.update(max_window_layers=k.layers)
    s = _Specs(k.dtype)
    _embed(s, k)
    for i in range(k.layers):
        p = f"model.layers.{i}"
        s.norm(f"{p}.input_layernorm", k.hidden)
        if qwen2:
            _gqa_attention(s, f"{p}.self_attn", k, bias=True)
        else:
            _gqa_attention(s, f"{p}.self_attn", k, qk_norm=(k.head_dim, k.head_dim))
        s.norm(f"{p}.post_attention_layernorm", k.hidden)
        if i in mlp_only:
            s.swiglu(f"{p}.mlp", k.hidden, k.intermediate)
            continue
        s.router(f"{p}.mlp.gate.weight", k.experts, k.hidden)
        if family == "fused":
            # transformers>=5 in-memory layout, saved with save_original_format=False:
            # gate_up_proj [E, 2I, H] = cat(gate [I, H], up [I, H]) per expert; down_proj [E, H, I].
            s.normal(f"{p}.mlp.experts.gate_up_proj", (k.experts, 2 * k.moe_intermediate, k.hidden),
                     _std(k.hidden))
            s.normal(f"{p}.mlp.experts.down_proj", (k.experts, k.hidden, k.moe_intermediate),
                     _std(k.moe_intermediate))
        else:
            for e in range(k.experts):
                s.swiglu(f"{p}.mlp.experts.{e}", k.hidden, k.moe_intermediate)
        if qwen2:
            s.swiglu(f"{p}.mlp.shared_expert", k.hidden, k.intermediate)
            s.normal(f"{p}.mlp.shared_expert_gate.weight", (1, k.hidden), _std(k.hidden))
    _head(s, k)
    return cfg, s.items


def _olmoe(k: Knobs) -> tuple[dict, list[TensorSpec]]:
    cfg = _base_config(k, "olmoe", "OlmoeForCausalLM", 1e4, 1e-5)
    cfg.update(intermediate_size=k.moe_intermediate, num_experts=k.experts, norm_topk_prob=False,
               attention_bias=False, clip_qkv=None, router_aux_loss_coef=0.01)
    s = _Specs(k.dtype)
    _embed(s, k)
    for i in range(k.layers):
        p = f"model.layers.{i}"
        s.norm(f"{p}.input_layernorm", k.hidden)
        # OLMoE normalizes the whole q and k projections, not per head.
        _gqa_attention(s, f"{p}.self_attn", k, qk_norm=(k.heads * k.head_dim, k.kv_heads * k.head_dim))
        s.norm(f"{p}.post_attention_layernorm", k.hidden)
        s.router(f"{p}.mlp.gate.weight", k.experts, k.hidden)
        for e in range(k.experts):
            s.swiglu(f"{p}.mlp.experts.{e}", k.hidden, k.moe_intermediate)
    _head(s, k)
    return cfg, s.items


def _deepseek_dims(k: Knobs) -> dict[str, int]:
    hd = k.head_dim
    return {"qk_nope_head_dim": hd, "qk_rope_head_dim": max(2, hd // 2 // 2 * 2), "v_head_dim": hd}


def _deepseek_layer(s: _Specs, p: str, k: Knobs, moe: bool) -> None:
    d = _deepseek_dims(k)
    qk_head = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    a = f"{p}.self_attn"
    s.norm(f"{p}.input_layernorm", k.hidden)
    if k.q_lora_rank:
        s.linear(f"{a}.q_a_proj", k.q_lora_rank, k.hidden)
        s.norm(f"{a}.q_a_layernorm", k.q_lora_rank)
        s.linear(f"{a}.q_b_proj", k.heads * qk_head, k.q_lora_rank)
    else:
        s.linear(f"{a}.q_proj", k.heads * qk_head, k.hidden)
    s.linear(f"{a}.kv_a_proj_with_mqa", k.kv_lora_rank + d["qk_rope_head_dim"], k.hidden)
    s.norm(f"{a}.kv_a_layernorm", k.kv_lora_rank)
    s.linear(f"{a}.kv_b_proj", k.heads * (d["qk_nope_head_dim"] + d["v_head_dim"]), k.kv_lora_rank)
    s.linear(f"{a}.o_proj", k.hidden, k.heads * d["v_head_dim"])
    s.norm(f"{p}.post_attention_layernorm", k.hidden)
    if not moe:
        s.swiglu(f"{p}.mlp", k.hidden, k.intermediate)
        return
    # The router stays in the checkpoint dtype (BF16 in DeepSeek's FP8 release), its bias in F32.
    s.router(f"{p}.mlp.gate.weight", k.experts, k.hidden)
    s.normal(f"{p}.mlp.gate.e_score_correction_bias", (k.experts,), 0.05, dtype="f32")
    for e in range(k.experts):
        s.swiglu(f"{p}.mlp.experts.{e}", k.hidden, k.moe_intermediate)
    s.swiglu(f"{p}.mlp.shared_experts", k.hidden, k.moe_intermediate)  # n_shared_experts = 1


def _deepseek_v3(k: Knobs) -> tuple[dict, list[TensorSpec]]:
    cfg = _base_config(k, "deepseek_v3", "DeepseekV3ForCausalLM", 1e4, 1e-6)
    cfg.update(
        num_key_value_heads=k.heads,  # MLA: every head has its own k/v from the shared latent
        intermediate_size=k.intermediate, moe_intermediate_size=k.moe_intermediate,
        n_routed_experts=k.experts, n_shared_experts=1, routed_scaling_factor=2.5,
        n_group=k.n_group, topk_group=k.topk_group, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, first_k_dense_replace=k.dense_layers, moe_layer_freq=1,
        num_nextn_predict_layers=k.mtp_layers, q_lora_rank=k.q_lora_rank or None, kv_lora_rank=k.kv_lora_rank,
        rope_interleave=True, attention_bias=False, ep_size=1, **_deepseek_dims(k),
    )
    if k.fp8:
        # Exactly DeepSeek-V3's: F8_E4M3 linear weights, F32 `weight_scale_inv` per 128x128 block.
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    s = _Specs(k.dtype, fp8=k.fp8)
    _embed(s, k)
    for i in range(k.layers):
        _deepseek_layer(s, f"model.layers.{i}", k, moe=i >= k.dense_layers)
    _head(s, k)
    # Multi-token-prediction modules follow the main layers (model.layers.61 in DeepSeek-V3). transformers
    # does not load them by default (`_keys_to_ignore_on_load_unexpected`, hard-wired to layer 61).
    for m in range(k.mtp_layers):
        p = f"model.layers.{k.layers + m}"
        s.normal(f"{p}.embed_tokens.weight", (k.vocab, k.hidden), 0.1)
        s.norm(f"{p}.enorm", k.hidden)
        s.norm(f"{p}.hnorm", k.hidden)
        s.linear(f"{p}.eh_proj", k.hidden, 2 * k.hidden, quantize=False)
        _deepseek_layer(s, p, k, moe=True)
        s.norm(f"{p}.shared_head.norm", k.hidden)
        s.normal(f"{p}.shared_head.head.weight", (k.vocab, k.hidden), _std(k.hidden))
    return cfg, s.items


def _gpt_oss(k: Knobs) -> tuple[dict, list[TensorSpec]]:
    cfg = _base_config(k, "gpt_oss", "GptOssForCausalLM", 150000.0, 1e-5)
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    cfg.update(intermediate_size=k.moe_intermediate, num_local_experts=k.experts, head_dim=k.head_dim,
               sliding_window=128, attention_bias=True, swiglu_limit=7.0, rope_parameters=yarn,
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(k.layers)])
    if k.mxfp4:
        cfg["quantization_config"] = MXFP4_QUANTIZATION
    s = _Specs(k.dtype)
    _embed(s, k)
    ie = k.moe_intermediate
    for i in range(k.layers):
        p = f"model.layers.{i}"
        s.norm(f"{p}.input_layernorm", k.hidden)
        _gqa_attention(s, f"{p}.self_attn", k, bias=True, o_bias=True)
        s.normal(f"{p}.self_attn.sinks", (k.heads,), 0.1)
        s.norm(f"{p}.post_attention_layernorm", k.hidden)
        s.router(f"{p}.mlp.router.weight", k.experts, k.hidden)
        s.normal(f"{p}.mlp.router.bias", (k.experts,), 0.02)
        # Input-major ([in, out], used as x @ W) and gate/up interleaved on the last axis:
        # gate = gate_up[..., 0::2], up = gate_up[..., 1::2] (GptOssExperts._apply_gate).
        if k.mxfp4:  # as released: output-major U8 blocks [E, out, in/32, 16] and scales [E, out, in/32]
            s.mxfp4(f"{p}.mlp.experts.gate_up_proj", k.experts, 2 * ie, k.hidden)
            s.normal(f"{p}.mlp.experts.gate_up_proj_bias", (k.experts, 2 * ie), 0.02)
            s.mxfp4(f"{p}.mlp.experts.down_proj", k.experts, k.hidden, ie)
            s.normal(f"{p}.mlp.experts.down_proj_bias", (k.experts, k.hidden), 0.02)
            continue
        s.normal(f"{p}.mlp.experts.gate_up_proj", (k.experts, k.hidden, 2 * ie), _std(k.hidden))
        s.normal(f"{p}.mlp.experts.gate_up_proj_bias", (k.experts, 2 * ie), 0.02)
        s.normal(f"{p}.mlp.experts.down_proj", (k.experts, ie, k.hidden), _std(ie))
        s.normal(f"{p}.mlp.experts.down_proj_bias", (k.experts, k.hidden), 0.02)
    _head(s, k)
    return cfg, s.items


def _llama4(k: Knobs) -> tuple[dict, list[TensorSpec]]:
    cfg = _base_config(k, "llama4_text", "Llama4ForCausalLM", 500000.0, 1e-5)
    moe_layers = list(range(k.dense_layers, k.layers))
    chunk = k.attention_chunk_size or 8192
    interval = k.nope_interval or 4
    no_rope_layers = [int((i + 1) % interval != 0) for i in range(k.layers)]  # 0 = NoPE, as transformers' default
    # floor_scale follows the chunk, as in the released models (both 8192): a small chunk exercises both.
    cfg.update(intermediate_size=k.moe_intermediate, intermediate_size_mlp=k.intermediate,
               num_local_experts=k.experts, head_dim=k.head_dim, interleave_moe_layer_step=1,
               moe_layers=moe_layers, use_qk_norm=True, attention_chunk_size=chunk, attention_bias=False,
               no_rope_layers=no_rope_layers, no_rope_layer_interval=interval,
               layer_types=["chunked_attention" if r else "full_attention" for r in no_rope_layers],
               attn_temperature_tuning=True, floor_scale=chunk, attn_scale=0.1, router_jitter_noise=0.0)
    s = _Specs(k.dtype)
    _embed(s, k)
    ie = k.moe_intermediate
    for i in range(k.layers):
        p = f"model.layers.{i}"
        s.norm(f"{p}.input_layernorm", k.hidden)
        _gqa_attention(s, f"{p}.self_attn", k)  # Llama 4's qk-norm is a weightless L2 norm
        s.norm(f"{p}.post_attention_layernorm", k.hidden)
        f = f"{p}.feed_forward"
        if i not in moe_layers:
            s.swiglu(f, k.hidden, k.intermediate)
            continue
        s.router(f"{f}.router.weight", k.experts, k.hidden)
        # Input-major ([in, out], used with bmm); gate_up = cat(gate, up) on the last axis, not interleaved.
        s.normal(f"{f}.experts.gate_up_proj", (k.experts, k.hidden, 2 * ie), _std(k.hidden))
        s.normal(f"{f}.experts.down_proj", (k.experts, ie, k.hidden), _std(ie))
        s.swiglu(f"{f}.shared_expert", k.hidden, ie)
    _head(s, k)
    return cfg, s.items


def build_spec(family: str, knobs: Knobs) -> tuple[dict, list[TensorSpec]]:
    """The config.json dict and every tensor (in module order) of `family` at these sizes. Pure."""
    k = _resolve(family, knobs)
    builders = {"mixtral": _mixtral, "olmoe": _olmoe, "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss,
                "llama4": _llama4}
    if family in ("qwen2_moe", "qwen3_moe", "fused"):
        return _qwen_like(k, family)
    return builders[family](k)


def plan_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors into shards the way huggingface_hub's split_state_dict_into_shards_factory does.

    Walk in order; start a new shard when the next tensor would overflow; a tensor larger than the
    limit gets a shard of its own (appended at once, before the shard being filled).
    """
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.nbytes > max_bytes:
            shards.append([spec])
            continue
        if size + spec.nbytes > max_bytes and current:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        shards.append(current)
    return shards


def shard_filenames(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def index_document(shards: list[list[TensorSpec]], names: list[str]) -> dict:
    """model.safetensors.index.json as transformers writes it (total_size = bytes of tensor data)."""
    weight_map = {spec.name: fname for shard, fname in zip(shards, names) for spec in shard}
    total = sum(spec.nbytes for shard in shards for spec in shard)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


# ---------------------------------------------------------------------------------------------------------
# Pure: deterministic tensor values.


class _ValueSource:
    """Seeded tensor values. Each tensor is a slice of a cached, pre-cast pool at a per-name offset."""

    def __init__(self, seed: int):
        self.seed = seed
        self._normal = np.random.default_rng([seed, 0x5EED]).standard_normal(_POOL_LEN, dtype=np.float32)
        self._pools: dict[tuple, np.ndarray] = {}

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def _pool(self, dtype: str, std: float, mean: float) -> np.ndarray:
        key = (dtype, std, mean)
        if key not in self._pools:
            if dtype == "fp8":
                scaled = self._normal * np.float32(_FP8_MAX / _FP8_POOL_SIGMAS)
                pool = np.clip(scaled, -_FP8_MAX, _FP8_MAX).astype(_NP_DTYPES["fp8"])
            else:
                pool = (self._normal * np.float32(std) + np.float32(mean)).astype(_NP_DTYPES[dtype])
            self._pools[key] = pool
        return self._pools[key]

    def array(self, spec: TensorSpec) -> np.ndarray:  # -> spec.shape, spec.dtype
        rng = self._rng(spec.name)
        n = math.prod(spec.shape)
        if spec.kind == "fp8_scale":
            # weight_scale_inv: dequantized weight = fp8 * scale; the pool spans +-4 sigma of the fp8 range,
            # so this gives std ~spec.std, with a per-block spread so that blocks are distinguishable.
            base = spec.std * _FP8_POOL_SIGMAS / _FP8_MAX
            return (base * rng.uniform(0.75, 1.25, size=spec.shape)).astype(np.float32)
        if spec.kind == "mxfp4_blocks":  # uniformly random 4-bit codes, two per byte
            return rng.integers(0, 256, size=spec.shape, dtype=np.uint8)
        if spec.kind == "mxfp4_scales":
            # 2^(s - 127) brings the codes' RMS to ~spec.std, give or take a factor of 2 per group
            exponent = round(math.log2(spec.std / _FP4_RMS))
            return (127 + exponent + rng.integers(-1, 2, size=spec.shape)).astype(np.uint8)
        pool = self._pool("fp8" if spec.kind == "fp8" else spec.dtype, spec.std, spec.mean)
        return _tile(pool, int(rng.integers(len(pool))), n).reshape(spec.shape)


def _tile(pool: np.ndarray, offset: int, n: int) -> np.ndarray:  # [P], int, int -> [n]
    out = np.empty(n, dtype=pool.dtype)
    pos, src = 0, offset
    while pos < n:
        take = min(n - pos, len(pool) - src)
        out[pos:pos + take] = pool[src:src + take]
        pos += take
        src = 0
    return out


# ---------------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE trained on built-in text; vocab padded with reserved tokens to the exact size.

_CORPUS = """\
The small river ran past the mill and under the old stone bridge, where children stopped on their way to
school to drop leaves into the water and watch them race. In the spring the water was high and brown, and
in the late summer it was so clear that you could count the pebbles on the bottom. The miller said that the
river had been there long before the town and would be there long after it, and nobody argued with him.

A good loaf of bread needs only flour, water, salt and time. Mix the flour and the water, let them rest for
half an hour, then add the salt and a little of yesterday's dough. Fold it every hour through the morning.
When it has grown by half, shape it gently, put it in a basket and leave it somewhere cool overnight. Bake it
in a very hot oven, with a lid for the first twenty minutes, and then without, until the crust is dark.

Every model of the weather is wrong, but some are useful. Forecasters combine measurements of temperature,
pressure, wind and humidity from thousands of stations, balloons, ships and satellites. They run the same
simulation many times with slightly different starting points, and when most of the runs agree, they are
more confident about tomorrow. When the runs disagree, the honest forecast says so.

She opened the letter at the kitchen table. It was short: the house by the sea was hers if she wanted it,
the key was with the neighbour, and the roof leaked above the north window. She read it twice, folded it,
and looked out at the grey street for a long time. Then she went upstairs and began to pack.

Computers store numbers in binary. A byte holds eight bits, and so it can take two hundred and fifty six
different values. Text is stored as a sequence of bytes, and a tokenizer splits that text into pieces that
a language model can read. Common words become single tokens, while rare words are broken into several
smaller pieces. The same text must always be split the same way, or the model will not understand it.

In the mountains the path climbs through pine forest, crosses a meadow full of flowers in July, and reaches
a lake so cold that even the dogs refuse to swim. Walkers eat their lunch on the flat rocks by the shore and
watch the clouds build over the far ridge. By three o'clock it is wise to start down, because the storms
arrive quickly in the afternoon and the path is steep and exposed near the top.

The library opened at nine. First came the students with their laptops and their coffee, then the retired
teachers who read every newspaper from front to back, then the parents with small children for the story
hour. The librarian knew most of them by name, and she knew which books each of them would ask for before
they reached her desk. On quiet afternoons she repaired the spines of old atlases with glue and linen tape.

A garden teaches patience. Seeds planted in March may not flower until June, and a fruit tree may take five
years to give a real harvest. The gardener waters, weeds and waits, and learns to accept that frost, slugs
and birds will take their share. Still, there is nothing quite like the first ripe tomato of the year,
eaten warm from the vine with a pinch of salt, standing in the evening light between the rows.
"""


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` tokens; BOS/EOS/PAD at ids 0/1/2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # the corpus ran out of merges: fill up like Llama 3's reserved special tokens
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:  # pragma: no cover - tokenizers contract
        raise UsageError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


# A small ChatML-style template, as Qwen's: role markers are plain text to this tokenizer (it has no <|im_start|>
# token), the BOS token opens the conversation, and raise_exception refuses a system message after the first.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokenizer_files(vocab_size: int, max_len: int, chat_template: bool = True) -> dict[str, str]:
    tok = build_tokenizer(vocab_size)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if chat_template:
        tokenizer_config["chat_template"] = CHAT_TEMPLATE
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    return {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": _json(tokenizer_config),
        "special_tokens_map.json": _json(special),
    }


def _json(doc: Any) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------------------------
# I/O: write everything into a temporary sibling directory, then rename it into place.


def _write_shards(tmp: Path, shards: list[list[TensorSpec]], names: list[str], values: _ValueSource) -> None:
    from safetensors.numpy import save_file

    for shard, fname in zip(shards, names):
        # One shard in memory at a time: multi-GB checkpoints need only max(shard) bytes of RAM.
        tensors = {spec.name: values.array(spec) for spec in shard}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
        os.chmod(tmp / fname, 0o644)  # safetensors creates 0600; a checkpoint is meant to be shared


def _prepare_target(out_dir: Path, overwrite: bool) -> Path:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise UsageError("output exists and is not a directory", path=str(out_dir))
        if any(out_dir.iterdir()) and not overwrite:
            raise UsageError("output directory is not empty", path=str(out_dir), hint="pass --overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-make-tiny-moe"
    if tmp.exists():  # left by an interrupted run: never mistaken for a checkpoint, since it was not renamed
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def make_checkpoint(out_dir: Path | str, family: str, *, overwrite: bool = False, **knobs: Any) -> Path:
    """Write a complete HF checkpoint directory for `family` to `out_dir` and return its path.

    `knobs` are the fields of `Knobs` (layers, experts, hidden, ..., fp8). The directory appears only when
    complete (written as a hidden sibling, then renamed); an existing non-empty `out_dir` needs overwrite=True.
    """
    unknown = set(knobs) - {f.name for f in fields(Knobs)}
    if unknown:
        raise UsageError(f"unknown knob(s): {', '.join(sorted(unknown))}")
    k = Knobs(**knobs)
    config, specs = build_spec(family, k)
    shards = plan_shards(specs, int(k.shard_size_mb * 1_000_000))
    names = shard_filenames(len(shards))

    out_dir = Path(out_dir)
    tmp = _prepare_target(out_dir, overwrite)
    try:
        files = {"config.json": _json(config),
                 "generation_config.json": _json({"_from_model_config": True, "bos_token_id": BOS_ID,
                                                  "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}),
                 **_tokenizer_files(k.vocab, k.max_position_embeddings, k.chat_template)}
        if len(shards) > 1:
            files["model.safetensors.index.json"] = _json(index_document(shards, names))
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        _write_shards(tmp, shards, names, _ValueSource(k.seed))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StorageError(f"cannot write checkpoint: {e.strerror or e}", path=str(out_dir)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="make_tiny_moe.py", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output checkpoint directory (created; must be empty or absent)")
    ap.add_argument("--family", required=True, choices=FAMILIES)
    d = Knobs()
    for name, help_ in [
        ("layers", "decoder layers"), ("experts", "routed experts per MoE layer"), ("hidden", "hidden size"),
        ("intermediate", "dense MLP width"), ("moe-intermediate", "routed expert width"),
        ("heads", "attention heads"), ("kv-heads", "key/value heads"), ("vocab", "vocabulary size"),
        ("experts-per-tok", "experts per token (default: 2, llama4: 1)"), ("seed", "random seed"),
        ("dense-layers", "leading dense layers (default: deepseek_v3 1, others 0)"),
        ("mtp-layers", "deepseek_v3 multi-token-prediction layers (default 1)"),
        ("n-group", "deepseek_v3 expert groups"), ("topk-group", "deepseek_v3 groups picked per token"),
        ("q-lora-rank", "deepseek_v3 q compression rank (0: none)"), ("kv-lora-rank", "deepseek_v3 kv rank"),
        ("max-position-embeddings", "max_position_embeddings"),
        ("attention-chunk-size", "llama4 attention chunk (default 8192)"),
        ("nope-interval", "llama4: every n-th layer is NoPE (default 4)"),
    ]:
        attr = name.replace("-", "_")
        ap.add_argument(f"--{name}", dest=attr, type=int, default=getattr(d, attr), help=help_)
    ap.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    ap.add_argument("--shard-size-mb", type=float, default=d.shard_size_mb,
                    help="max tensor bytes per shard file, in 10^6 bytes (HF's max_shard_size)")
    ap.add_argument("--fp8", action="store_true", help="deepseek_v3: F8_E4M3 weights + 128x128 weight_scale_inv")
    ap.add_argument("--mxfp4", action="store_true",
                    help="gpt_oss: experts as MXFP4 U8 blocks + E8M0 scales, as released (sizes multiples of 32)")
    ap.add_argument("--tie-word-embeddings", action="store_true")
    ap.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                    help="tokenizer_config.json without a chat_template")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    return ap


def main(argv: Iterable[str] | None = None) -> int:
    args = vars(_parser().parse_args(None if argv is None else list(argv)))
    out, family, overwrite = args.pop("out"), args.pop("family"), args.pop("overwrite")
    try:
        path = make_checkpoint(out, family, overwrite=overwrite, **args)
    except (UsageError, StorageError) as err:
        print(f"make_tiny_moe: error: {err.one_line()}", file=sys.stderr)
        return err.exit_code
    total = sum(p.stat().st_size for p in path.iterdir())
    print(f"wrote {family} checkpoint ({total / 1e6:.1f} MB) to {path}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
