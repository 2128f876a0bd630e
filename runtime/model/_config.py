"""`ModelConfig`: the fields of a Hugging Face config.json the forward pass uses, validated once.

Which families run, their traits and the transformers config-class defaults (v5) come from the family table
(shardtool/families.py), so a config.json that omits a field means what it means to transformers; every value
is read through the one capped reader (shardtool/hf_config.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shardtool import formats
from shardtool.errors import CheckpointFormatError
from shardtool.families import (BY_NAME, RUNTIME_MODEL_TYPES, Family, expert_count, experts_per_token, find_family,
                                moe_layers, mxfp4_experts, text_config)
from shardtool.hf_config import INT_CAPS, ConfigReader, check_int

_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over the first `dim` channels of a head (all of them, or DeepSeek's rope part)."""

    kind: Literal["default", "linear", "yarn", "llama3"]
    theta: float
    dim: int
    factor: float = 1.0
    interleave: bool = False  # DeepSeek: channels are (x0, x1), (x2, x3) pairs
    original_max_position_embeddings: int = 0
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 1.0  # llama3


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek multi-head latent attention sizes."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ChunkedNopeConfig:
    """Llama 4 attention beyond the per-layer tables (`ModelConfig.rope_layers`, `attention_chunks`): the
    weightless L2 q/k norm on RoPE layers, and NoPE layers' attention-temperature tuning
    (q *= 1 + attn_scale * log1p(floor((position + 1) / floor_scale)))."""

    use_qk_norm: bool
    temperature_tuning: bool
    floor_scale: int
    attn_scale: float


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # one routed expert
    shared_intermediate_size: int  # 0 when the family has no shared expert
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    attn_scale: float
    qk_norm: Literal["none", "per_head", "full"]
    clip_qkv: float | None
    sliding_windows: tuple[int | None, ...]  # per layer
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP
    num_experts: int
    top_k: int
    router: Literal["softmax", "sigmoid_group", "topk_softmax", "sigmoid_input"]
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert: Literal["none", "gated", "plain", "one"] = "none"
    mla: MlaConfig | None = None
    fp8_block: tuple[int, int] = (128, 128)
    max_position_embeddings: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_layers: tuple[bool, ...] = ()  # per layer: RoPE applied (False: a NoPE layer); () = every layer
    attention_chunks: tuple[int | None, ...] = ()  # per layer: chunked attention's chunk size; () = none
    chunked_nope: ChunkedNopeConfig | None = None  # Llama 4 attention
    # gpt-oss (runtime/model/_gpt_oss.py): attention sinks, router and expert biases, the clamped SwiGLU
    attention_sinks: bool = False
    router_bias: bool = False  # mlp.gate.bias (gpt-oss's mlp.router.bias) added to the router logits
    expert_bias: bool = False
    expert_act: Literal["silu", "clamped_swiglu"] = "silu"
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    mxfp4: bool = False  # routed experts stored as MXFP4 blocks + scales (quantization_config.quant_method)

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parse a config.json dict; raises CheckpointFormatError naming the field on bad or unsupported values."""
        if not isinstance(d, Mapping):
            raise CheckpointFormatError(f"config.json must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in RUNTIME_MODEL_TYPES:
            raise CheckpointFormatError(f"config.json: unsupported model_type {model_type!r}",
                                        hint=f"supported: {', '.join(sorted(RUNTIME_MODEL_TYPES))}")
        family = BY_NAME[RUNTIME_MODEL_TYPES[model_type]]
        if "text_config" in d:  # a multimodal checkpoint (Llama 4): the runtime runs its language model
            inner = text_config(d)
            if inner is d or find_family(inner) not in (None, family):
                raise CheckpointFormatError(f"config.json: text_config must be an object describing a "
                                            f"{family.name} language model, got {d['text_config']!r:.80}")
            d = inner
        r = ConfigReader(d, family.defaults)
        if family.attention == "mla":
            return _parse_mla(r, model_type, family)
        return _parse_gqa(r, model_type, family)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' YaRN magnitude scaling (cos/sin in `_rope`, DeepSeek's softmax scale here)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _common(r: ConfigReader, model_type: str, family: Family) -> dict[str, Any]:
    act = r.raw("hidden_act", "silu")
    if act != "silu":
        raise CheckpointFormatError(f"config.json: hidden_act {act!r} is not supported", hint="expected 'silu'")
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    kv_heads = r.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointFormatError(f"config.json: num_attention_heads {heads} is not a multiple of "
                                    f"num_key_value_heads {kv_heads}")
    head_dim = r.int("head_dim", None) or check_int("head_dim (hidden_size / num_attention_heads)", hidden // heads,
                                                    INT_CAPS["head_dim"], 1)
    if isinstance(r.raw("eos_token_id", None), list):
        eos_ids = r.int_list("eos_token_id")
    else:
        eos = r.int("eos_token_id", None, minimum=0)
        eos_ids = () if eos is None else (eos,)
    return dict(
        model_type=model_type, family=family.name, vocab_size=r.int("vocab_size"), hidden_size=hidden,
        num_layers=r.int("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=r.int(family.dense_size_key), rms_norm_eps=r.float("rms_norm_eps"),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        max_position_embeddings=r.int("max_position_embeddings", 0, minimum=0),
        bos_token_id=r.int("bos_token_id", None, minimum=0), eos_token_ids=eos_ids,
    )


def _rope(r: ConfigReader, dim: int, max_pos: int, interleave: bool = False) -> RopeConfig:
    """rope_parameters (transformers v5) or rope_scaling + rope_theta (older config.json files)."""
    params = r.d.get("rope_scaling") or r.d.get("rope_parameters") or r.defaults.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise CheckpointFormatError(f"config.json: rope_parameters must be an object, got {params!r}")
    p = ConfigReader(params, {}, prefix="rope_scaling." if r.d.get("rope_scaling") else "rope_parameters.")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise CheckpointFormatError(f"config.json: rope type {kind!r} is not supported",
                                    hint=f"supported: {', '.join(_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", r.d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointFormatError(f"config.json: partial_rotary_factor {partial!r} is not supported")
    theta = p.float("rope_theta", None) or r.float("rope_theta")
    if not theta > 1.0:  # the frequencies are theta ** (-2i / d); YaRN divides by log(theta)
        raise CheckpointFormatError(f"config.json: rope_theta must be above 1, got {theta}")
    if dim % 2:
        raise CheckpointFormatError(f"config.json: rotary dimension {dim} must be even")
    if kind == "default":
        return RopeConfig("default", theta, dim, interleave=interleave)
    factor = p.float("factor")
    if factor < 1.0:
        raise CheckpointFormatError(f"config.json: rope factor must be >= 1, got {factor}")
    if kind == "linear":
        return RopeConfig("linear", theta, dim, factor=factor, interleave=interleave)
    if kind == "llama3":
        low, high = p.float("low_freq_factor"), p.float("high_freq_factor")
        if high < low:
            raise CheckpointFormatError(f"config.json: rope high_freq_factor {high} is below low_freq_factor {low}")
        return RopeConfig("llama3", theta, dim, factor=factor, interleave=interleave, low_freq_factor=low,
                          high_freq_factor=high, original_max_position_embeddings=p.int(
                              "original_max_position_embeddings", max_pos or ConfigReader.REQUIRED))
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointFormatError(f"config.json: rope truncate must be true or false, got {truncate!r}")
    mscale, mscale_all_dim = p.float("mscale", None, positive=False), p.float("mscale_all_dim", None, positive=False)
    for name, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None and value < 0:  # 0.1 * m * ln(factor) + 1 must stay >= 1: it divides and scales
            raise CheckpointFormatError(f"config.json: rope {name} must be >= 0, got {value}")
    return RopeConfig(
        "yarn", theta, dim, factor=factor, interleave=interleave,
        original_max_position_embeddings=p.int("original_max_position_embeddings", max_pos or ConfigReader.REQUIRED),
        attention_factor=p.float("attention_factor", None),
        beta_fast=p.float("beta_fast", None) or 32.0, beta_slow=p.float("beta_slow", None) or 1.0,
        mscale=mscale, mscale_all_dim=mscale_all_dim, truncate=truncate,
    )


def _moe_counts(r: ConfigReader, family: Family) -> dict[str, Any]:
    experts_key, num_experts = expert_count(family, r)
    top_k = experts_per_token(family, r)
    if top_k > num_experts:
        raise CheckpointFormatError(f"config.json: num_experts_per_tok {top_k} exceeds {experts_key} {num_experts}")
    return dict(num_experts=num_experts, top_k=top_k)


def _sliding_windows(r: ConfigReader, family: Family, n: int) -> tuple[int | None, ...]:
    if family.sliding_window == "always":  # one window for every layer, or none
        return (r.int("sliding_window", None),) * n
    if family.sliding_window == "layer_types":  # gpt-oss: sliding, full, sliding, ... unless listed
        window = r.int("sliding_window")
        types = r.raw("layer_types", None) or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    elif family.sliding_window == "none" or not r.bool("use_sliding_window"):
        return (None,) * n
    else:
        window = r.int("sliding_window")
        if family.sliding_window == "flag":
            return (window,) * n
        types = r.raw("layer_types", None) or [
            "sliding_attention" if (i + 1) % 2 and i < r.int("max_window_layers", minimum=0) else "full_attention"
            for i in range(n)]
    if not isinstance(types, list) or len(types) != n or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise CheckpointFormatError(f"config.json: layer_types must list {n} attention types, got {types!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _parse_gqa(r: ConfigReader, model_type: str, family: Family) -> ModelConfig:
    """Grouped-query attention families: what differs between them is in their row of the family table."""
    c = _common(r, model_type, family)
    n = c["num_layers"]
    windows = _sliding_windows(r, family, n)
    counts = _moe_counts(r, family)
    expert_size = r.int(family.expert_size_key)
    shared = family.shared_expert if family.shared_expert in ("gated", "one") else "none"
    shared_size = {"gated": lambda: r.int("shared_expert_intermediate_size"), "one": lambda: expert_size,
                   "none": lambda: 0}[shared]()
    return ModelConfig(
        **c, **counts, **_gpt_oss_traits(r, family), moe_intermediate_size=expert_size,
        shared_intermediate_size=shared_size,
        rope=_rope(r, c["head_dim"], c["max_position_embeddings"], interleave=family.chunked_nope),
        attn_scale=c["head_dim"] ** -0.5,
        qk_norm=family.qk_norm, clip_qkv=r.float("clip_qkv") if family.clip_qkv else None,
        sliding_windows=windows, moe_layers=moe_layers(family, r, n), router=family.router,
        norm_topk_prob=family.norm_topk_prob if family.norm_topk_prob is not None else r.bool("norm_topk_prob"),
        shared_expert=shared, **(_chunked_nope(r, n) if family.chunked_nope else {}),
    )


_LAYER_TYPES = ("chunked_attention", "full_attention")


def _chunked_nope(r: ConfigReader, n: int) -> dict[str, Any]:
    """Llama 4's per-layer attention: which layers are NoPE, which are chunked, and the temperature tuning.

    As transformers' Llama4TextConfig: an absent or empty no_rope_layers means a NoPE layer every
    no_rope_layer_interval layers; an explicit null attention_chunk_size means no chunking; layer_types, when
    absent, makes every RoPE layer chunked."""
    listed = r.raw("no_rope_layers", None)
    if listed:
        flags = r.int_list("no_rope_layers", minimum=0)
        if len(flags) != n:
            raise CheckpointFormatError(f"config.json: no_rope_layers lists {len(flags)} layers, expected "
                                        f"num_hidden_layers {n}")
        rope_layers = tuple(bool(f) for f in flags)
    else:
        interval = r.int("no_rope_layer_interval")
        rope_layers = tuple((i + 1) % interval != 0 for i in range(n))
    chunk = None if "attention_chunk_size" in r.d and r.d["attention_chunk_size"] is None \
        else r.int("attention_chunk_size")
    types = r.raw("layer_types", None)
    if types is None:
        types = ["chunked_attention" if rope and chunk is not None else "full_attention" for rope in rope_layers]
    if not isinstance(types, list) or len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise CheckpointFormatError(f"config.json: layer_types must list {n} of {' / '.join(_LAYER_TYPES)}, "
                                    f"got {types!r:.120}")
    if chunk is None and "chunked_attention" in types:
        raise CheckpointFormatError("config.json: layer_types names chunked_attention but attention_chunk_size "
                                    "is null")
    nope = ChunkedNopeConfig(use_qk_norm=r.bool("use_qk_norm"), temperature_tuning=r.bool("attn_temperature_tuning"),
                             floor_scale=r.int("floor_scale"), attn_scale=r.float("attn_scale", positive=False))
    return dict(rope_layers=rope_layers, attention_chunks=tuple(chunk if t == "chunked_attention" else None
                                                                for t in types), chunked_nope=nope)


def _gpt_oss_traits(r: ConfigReader, family: Family) -> dict[str, Any]:
    """Sinks, router/expert biases, the expert activation and MXFP4 experts, as the family row says."""
    if family.expert_act == "clamped_swiglu":
        act = dict(expert_act="clamped_swiglu", swiglu_alpha=r.float("swiglu_alpha"),
                   swiglu_limit=r.float("swiglu_limit"))
    else:
        act = {}
    mxfp4 = mxfp4_experts(family, r)
    router_bias = family.router_bias and family.router != "sigmoid_group"  # DeepSeek's steers selection only
    return dict(attention_sinks=family.attention_sinks, router_bias=router_bias, expert_bias=family.expert_bias,
                mxfp4=mxfp4, **act)


def _parse_mla(r: ConfigReader, model_type: str, family: Family) -> ModelConfig:
    """DeepSeek-V3 multi-head latent attention with group-limited sigmoid routing and FP8 block scales."""
    c = _common(r, model_type, family)
    n = c["num_layers"]
    scoring = r.raw("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise CheckpointFormatError(f"config.json: scoring_func {scoring!r} is not supported",
                                    hint="DeepSeek-V3 routing is 'sigmoid'")
    mla = MlaConfig(q_lora_rank=r.int("q_lora_rank", None), kv_lora_rank=r.int("kv_lora_rank"),
                    qk_nope_head_dim=r.int("qk_nope_head_dim"), qk_rope_head_dim=r.int("qk_rope_head_dim"),
                    v_head_dim=r.int("v_head_dim"))
    counts = _moe_counts(r, family)
    n_group, topk_group = r.int("n_group"), r.int("topk_group")
    per_group = counts["num_experts"] // n_group
    if counts["num_experts"] % n_group or per_group < 2:
        raise CheckpointFormatError(f"config.json: n_routed_experts {counts['num_experts']} must split into "
                                    f"n_group {n_group} groups of at least 2 experts")
    if topk_group > n_group or counts["top_k"] > topk_group * per_group:
        raise CheckpointFormatError(f"config.json: topk_group {topk_group} of n_group {n_group} groups cannot "
                                    f"supply num_experts_per_tok {counts['top_k']} experts")
    rope = _rope(r, mla.qk_rope_head_dim, c["max_position_embeddings"], interleave=r.bool("rope_interleave"))
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:  # transformers' yarn_apply_mscale
        scale *= yarn_get_mscale(rope.factor, rope.mscale_all_dim) ** 2
    quant = r.d.get("quantization_config") or {}
    fp8 = formats.FP8
    method = quant.get("quant_method", fp8.quant_method) if isinstance(quant, Mapping) else None
    if formats.declared(method) is not fp8:
        raise CheckpointFormatError(f"config.json: quantization_config quant_method {method!r} is not supported",
                                    hint=f"only DeepSeek-style block-scaled {fp8.quant_method!r} weights are")
    block = quant.get("weight_block_size", list(fp8.block))
    if not (isinstance(block, list) and len(block) == 2):
        raise CheckpointFormatError(f"config.json: quantization_config.weight_block_size must be two positive "
                                    f"integers, got {block!r:.80}")
    block = ConfigReader({"weight_block_size": block}, {}, prefix="quantization_config.").int_list(
        "weight_block_size", minimum=1)
    n_shared = r.int("n_shared_experts", minimum=0)
    return ModelConfig(
        **c, **counts, moe_intermediate_size=r.int("moe_intermediate_size"),
        shared_intermediate_size=r.int("moe_intermediate_size") * n_shared, rope=rope, attn_scale=scale,
        qk_norm="none", clip_qkv=None, sliding_windows=(None,) * n,
        moe_layers=moe_layers(family, r, n), router=family.router,
        norm_topk_prob=r.bool("norm_topk_prob"), n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=r.float("routed_scaling_factor"), shared_expert="plain" if n_shared else "none",
        mla=mla, fp8_block=(block[0], block[1]),
    )

