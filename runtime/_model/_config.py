"""`ModelConfig`: the fields of a Hugging Face config.json the forward pass uses, validated once.

Defaults mirror the transformers config classes (v5) of each family, so a config.json that omits a
field means what it means to transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shardtool.errors import CheckpointFormatError

Family = Literal["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]

# model_type in config.json -> the transformers modeling code we mirror.
FAMILIES: dict[str, Family] = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi-K2 ships DeepSeek-V3 modeling code with its own model_type
}

# Per-family defaults of the transformers config classes, for the fields we read.
_DEFAULTS: dict[Family, dict[str, Any]] = {
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "sliding_window": None},
    "qwen2_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "use_sliding_window": False, "sliding_window": 4096},
    "olmoe": {"rope_theta": 1e4, "rms_norm_eps": 1e-5, "norm_topk_prob": False, "clip_qkv": None},
    "deepseek_v3": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "norm_topk_prob": True, "rope_interleave": True,
                    "n_shared_experts": 1, "routed_scaling_factor": 2.5},
}
_ROPE_TYPES = ("default", "linear", "yarn")

# Caps on every number config.json may set. A signed config.json is still untrusted input to this parser: its
# sizes drive allocations no shard has to back (KV cache, activations, rotary tables, FP8 scale tiles), and a
# value past these caps is refused before anything is sized from it. Each cap is far above any released MoE
# (DeepSeek-V3 / Kimi-K2: hidden 7168, vocab 163840, 384 experts, 128 heads, 61 layers, 163840 positions).
# Integer fields are looked up here by name: a field without a cap cannot be read (`_Reader.int`).
_MAX_DIM = 1 << 18  # any matrix dimension: intermediate sizes, FP8 block sides
_MAX_HEAD = 1 << 12  # one attention head's channels
_MAX_LAYERS = 1 << 12
_MAX_VOCAB = 1 << 21
_MAX_POSITIONS = 1 << 24
INT_CAPS: dict[str, int] = {
    "hidden_size": 1 << 16, "intermediate_size": _MAX_DIM, "moe_intermediate_size": _MAX_DIM,
    "shared_expert_intermediate_size": _MAX_DIM, "vocab_size": _MAX_VOCAB, "num_hidden_layers": _MAX_LAYERS,
    "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10, "head_dim": _MAX_HEAD,
    "num_local_experts": 1 << 14, "num_experts": 1 << 14, "n_routed_experts": 1 << 14, "num_experts_per_tok": 1 << 8,
    "n_group": 1 << 14, "topk_group": 1 << 14, "n_shared_experts": 1 << 6,
    "first_k_dense_replace": _MAX_LAYERS, "decoder_sparse_step": _MAX_LAYERS, "max_window_layers": _MAX_LAYERS,
    "mlp_only_layers": _MAX_LAYERS, "sliding_window": _MAX_POSITIONS, "max_position_embeddings": _MAX_POSITIONS,
    "original_max_position_embeddings": _MAX_POSITIONS, "bos_token_id": _MAX_VOCAB, "eos_token_id": _MAX_VOCAB,
    "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 14, "qk_nope_head_dim": _MAX_HEAD, "qk_rope_head_dim": _MAX_HEAD,
    "v_head_dim": _MAX_HEAD, "weight_block_size": _MAX_DIM,
}
# Floats: the largest magnitude accepted (rope factors, scales, epsilons).
FLOAT_CAPS: dict[str, float] = {
    "rope_theta": 1e12, "factor": 1e4, "attention_factor": 1e4, "beta_fast": 1e4, "beta_slow": 1e4,
    "mscale": 1e4, "mscale_all_dim": 1e4, "rms_norm_eps": 1.0, "clip_qkv": 1e9, "routed_scaling_factor": 1e4,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over the first `dim` channels of a head (all of them, or DeepSeek's rope part)."""

    kind: Literal["default", "linear", "yarn"]
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


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek multi-head latent attention sizes."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    family: Family
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
    router: Literal["softmax", "sigmoid_group"]
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert: Literal["none", "gated", "plain"] = "none"
    mla: MlaConfig | None = None
    fp8_block: tuple[int, int] = (128, 128)
    max_position_embeddings: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parse a config.json dict; raises CheckpointFormatError naming the field on bad or unsupported values."""
        if not isinstance(d, Mapping):
            raise CheckpointFormatError(f"config.json must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in FAMILIES:
            raise CheckpointFormatError(f"config.json: unsupported model_type {model_type!r}",
                                        hint=f"supported: {', '.join(sorted(FAMILIES))}")
        family = FAMILIES[model_type]
        r = _Reader(d, _DEFAULTS[family])
        return _PARSERS[family](r, model_type, family)


class _Reader:
    """Typed access to config.json fields; every failure names the field and the value, every number is capped."""

    _REQUIRED = object()

    def __init__(self, d: Mapping[str, Any], defaults: Mapping[str, Any], prefix: str = ""):
        self.d = d
        self.defaults = defaults
        self.prefix = prefix  # where `d` sits in config.json, for messages: "rope_scaling."

    def _get(self, key: str, default: Any) -> Any:
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is not self._REQUIRED:
            return default
        if key in self.defaults:
            return self.defaults[key]
        raise CheckpointFormatError(f"config.json: missing required field {self.prefix}{key!r}")

    def int(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> int:
        v = self._get(key, default)
        if v is None:
            return v
        return check_int(f"{self.prefix}{key}", v, INT_CAPS[key], minimum)

    def float(self, key: str, default: Any = _REQUIRED, *, positive: bool = True) -> float:
        v = self._get(key, default)
        if v is None:
            return v
        name, cap = f"{self.prefix}{key}", FLOAT_CAPS[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise CheckpointFormatError(f"config.json: {name} must be a {'positive ' if positive else ''}number, "
                                        f"got {v!r}")
        if abs(v) > cap:
            raise CheckpointFormatError(f"config.json: {name} is {v!r}, beyond the cap of {cap:g}")
        return float(v)

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise CheckpointFormatError(f"config.json: {self.prefix}{key} must be true or false, got {v!r}")
        return v

    def int_list(self, key: str, *, minimum: int = 0) -> tuple[int, ...]:
        v = self._get(key, [])
        if not isinstance(v, list):
            raise CheckpointFormatError(f"config.json: {self.prefix}{key} must be a list of integers, got {v!r:.80}")
        return tuple(check_int(f"{self.prefix}{key}[{i}]", x, INT_CAPS[key], minimum) for i, x in enumerate(v))


def check_int(name: str, v: Any, cap: int, minimum: int) -> int:
    """`v` as a config.json integer field `name` in [minimum, cap], or a CheckpointFormatError naming both."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise CheckpointFormatError(f"config.json: {name} must be an integer >= {minimum}, got {v!r:.80}")
    if v > cap:
        raise CheckpointFormatError(f"config.json: {name} is {v}, above the cap of {cap}")
    return v


def _common(r: _Reader, model_type: str, family: Family) -> dict[str, Any]:
    act = r._get("hidden_act", "silu")
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
    if isinstance(r._get("eos_token_id", None), list):
        eos_ids = r.int_list("eos_token_id")
    else:
        eos = r.int("eos_token_id", None, minimum=0)
        eos_ids = () if eos is None else (eos,)
    return dict(
        model_type=model_type, family=family, vocab_size=r.int("vocab_size"), hidden_size=hidden,
        num_layers=r.int("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=r.int("intermediate_size"), rms_norm_eps=r.float("rms_norm_eps"),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        max_position_embeddings=r.int("max_position_embeddings", 0, minimum=0),
        bos_token_id=r.int("bos_token_id", None, minimum=0), eos_token_ids=eos_ids,
    )


def _rope(r: _Reader, dim: int, max_pos: int, interleave: bool = False) -> RopeConfig:
    """rope_parameters (transformers v5) or rope_scaling + rope_theta (older config.json files)."""
    params = r.d.get("rope_scaling") or r.d.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise CheckpointFormatError(f"config.json: rope_parameters must be an object, got {params!r}")
    p = _Reader(params, {}, prefix="rope_scaling." if r.d.get("rope_scaling") else "rope_parameters.")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise CheckpointFormatError(f"config.json: rope type {kind!r} is not supported",
                                    hint=f"supported: {', '.join(_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", r.d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointFormatError(f"config.json: partial_rotary_factor {partial!r} is not supported")
    theta = p.float("rope_theta", None) or r.float("rope_theta")
    if dim % 2:
        raise CheckpointFormatError(f"config.json: rotary dimension {dim} must be even")
    if kind == "default":
        return RopeConfig("default", theta, dim, interleave=interleave)
    factor = p.float("factor")
    if factor < 1.0:
        raise CheckpointFormatError(f"config.json: rope factor must be >= 1, got {factor}")
    if kind == "linear":
        return RopeConfig("linear", theta, dim, factor=factor, interleave=interleave)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointFormatError(f"config.json: rope truncate must be true or false, got {truncate!r}")
    return RopeConfig(
        "yarn", theta, dim, factor=factor, interleave=interleave,
        original_max_position_embeddings=p.int("original_max_position_embeddings", max_pos or _Reader._REQUIRED),
        attention_factor=p.float("attention_factor", None),
        beta_fast=p.float("beta_fast", None) or 32.0, beta_slow=p.float("beta_slow", None) or 1.0,
        mscale=p.float("mscale", None, positive=False), mscale_all_dim=p.float("mscale_all_dim", None, positive=False),
        truncate=truncate,
    )


def _moe_counts(r: _Reader, experts_key: str, alias: str) -> dict[str, Any]:
    # transformers' attribute_map lets either name stand for the expert count (v5 Qwen3 saves the alias).
    if r.d.get(experts_key) is None and r.d.get(alias) is not None:
        experts_key = alias
    num_experts = r.int(experts_key)
    top_k = r.int("num_experts_per_tok")
    if top_k > num_experts:
        raise CheckpointFormatError(f"config.json: num_experts_per_tok {top_k} exceeds {experts_key} {num_experts}")
    return dict(num_experts=num_experts, top_k=top_k)


def _qwen_moe_layers(r: _Reader, n_layers: int) -> tuple[bool, ...]:
    # Qwen2/3-MoE decoder layer: sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    mlp_only = set(r.int_list("mlp_only_layers"))
    step = r.int("decoder_sparse_step")
    return tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(n_layers))


def _parse_mixtral(r: _Reader, model_type: str, family: Family) -> ModelConfig:
    c = _common(r, model_type, family)
    n = c["num_layers"]
    window = r.int("sliding_window", None)
    return ModelConfig(
        **c, **_moe_counts(r, "num_local_experts", "num_experts"), moe_intermediate_size=c["intermediate_size"],
        shared_intermediate_size=0, rope=_rope(r, c["head_dim"], c["max_position_embeddings"]),
        attn_scale=c["head_dim"] ** -0.5, qk_norm="none", clip_qkv=None, sliding_windows=(window,) * n,
        moe_layers=(True,) * n, router="softmax", norm_topk_prob=True,  # Mixtral always renormalizes top-k
    )


def _parse_qwen2_moe(r: _Reader, model_type: str, family: Family) -> ModelConfig:
    c = _common(r, model_type, family)
    n = c["num_layers"]
    windows: tuple[int | None, ...] = (None,) * n
    if r.bool("use_sliding_window"):
        window = r.int("sliding_window")
        types = r._get("layer_types", None) or [
            "sliding_attention" if (i + 1) % 2 and i < r.int("max_window_layers", minimum=0) else "full_attention"
            for i in range(n)]
        if not isinstance(types, list) or len(types) != n or \
                any(t not in ("sliding_attention", "full_attention") for t in types):
            raise CheckpointFormatError(f"config.json: layer_types must list {n} attention types, got {types!r}")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    return ModelConfig(
        **c, **_moe_counts(r, "num_experts", "num_local_experts"), moe_intermediate_size=r.int("moe_intermediate_size"),
        shared_intermediate_size=r.int("shared_expert_intermediate_size"),
        rope=_rope(r, c["head_dim"], c["max_position_embeddings"]), attn_scale=c["head_dim"] ** -0.5,
        qk_norm="none", clip_qkv=None, sliding_windows=windows, moe_layers=_qwen_moe_layers(r, n),
        router="softmax", norm_topk_prob=r.bool("norm_topk_prob"), shared_expert="gated",
    )


def _parse_qwen3_moe(r: _Reader, model_type: str, family: Family) -> ModelConfig:
    c = _common(r, model_type, family)
    n = c["num_layers"]
    window = r.int("sliding_window") if r.bool("use_sliding_window") else None
    return ModelConfig(
        **c, **_moe_counts(r, "num_experts", "num_local_experts"), moe_intermediate_size=r.int("moe_intermediate_size"),
        shared_intermediate_size=0, rope=_rope(r, c["head_dim"], c["max_position_embeddings"]),
        attn_scale=c["head_dim"] ** -0.5, qk_norm="per_head", clip_qkv=None, sliding_windows=(window,) * n,
        moe_layers=_qwen_moe_layers(r, n), router="softmax", norm_topk_prob=r.bool("norm_topk_prob"),
    )


def _parse_olmoe(r: _Reader, model_type: str, family: Family) -> ModelConfig:
    c = _common(r, model_type, family)
    n = c["num_layers"]
    return ModelConfig(
        **c, **_moe_counts(r, "num_experts", "num_local_experts"), moe_intermediate_size=c["intermediate_size"],
        shared_intermediate_size=0, rope=_rope(r, c["head_dim"], c["max_position_embeddings"]),
        attn_scale=c["head_dim"] ** -0.5, qk_norm="full", clip_qkv=r.float("clip_qkv"),
        sliding_windows=(None,) * n, moe_layers=(True,) * n, router="softmax",
        norm_topk_prob=r.bool("norm_topk_prob"),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _parse_deepseek_v3(r: _Reader, model_type: str, family: Family) -> ModelConfig:
    c = _common(r, model_type, family)
    n = c["num_layers"]
    scoring = r._get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise CheckpointFormatError(f"config.json: scoring_func {scoring!r} is not supported",
                                    hint="DeepSeek-V3 routing is 'sigmoid'")
    mla = MlaConfig(q_lora_rank=r.int("q_lora_rank", None), kv_lora_rank=r.int("kv_lora_rank"),
                    qk_nope_head_dim=r.int("qk_nope_head_dim"), qk_rope_head_dim=r.int("qk_rope_head_dim"),
                    v_head_dim=r.int("v_head_dim"))
    counts = _moe_counts(r, "n_routed_experts", "num_local_experts")
    n_group, topk_group = r.int("n_group"), r.int("topk_group")
    per_group = counts["num_experts"] // n_group
    if counts["num_experts"] % n_group or per_group < 2:
        raise CheckpointFormatError(f"config.json: n_routed_experts {counts['num_experts']} must split into "
                                    f"n_group {n_group} groups of at least 2 experts")
    if topk_group > n_group or counts["top_k"] > topk_group * per_group:
        raise CheckpointFormatError(f"config.json: topk_group {topk_group} of n_group {n_group} groups cannot "
                                    f"supply num_experts_per_tok {counts['top_k']} experts")
    first_dense = r.int("first_k_dense_replace", minimum=0)
    rope = _rope(r, mla.qk_rope_head_dim, c["max_position_embeddings"], interleave=r.bool("rope_interleave"))
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:  # transformers' yarn_apply_mscale
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    quant = r.d.get("quantization_config") or {}
    method = quant.get("quant_method", "fp8") if isinstance(quant, Mapping) else None
    if method != "fp8":
        raise CheckpointFormatError(f"config.json: quantization_config quant_method {method!r} is not supported",
                                    hint="only DeepSeek-style block-scaled 'fp8' weights are")
    block = quant.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2):
        raise CheckpointFormatError(f"config.json: quantization_config.weight_block_size must be two positive "
                                    f"integers, got {block!r:.80}")
    block = _Reader({"weight_block_size": block}, {}, prefix="quantization_config.").int_list("weight_block_size",
                                                                                            minimum=1)
    n_shared = r.int("n_shared_experts", minimum=0)
    return ModelConfig(
        **c, **counts, moe_intermediate_size=r.int("moe_intermediate_size"),
        shared_intermediate_size=r.int("moe_intermediate_size") * n_shared, rope=rope, attn_scale=scale,
        qk_norm="none", clip_qkv=None, sliding_windows=(None,) * n,
        moe_layers=tuple(i >= first_dense for i in range(n)), router="sigmoid_group",
        norm_topk_prob=r.bool("norm_topk_prob"), n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=r.float("routed_scaling_factor"), shared_expert="plain" if n_shared else "none",
        mla=mla, fp8_block=(block[0], block[1]),
    )


_PARSERS = {
    "mixtral": _parse_mixtral, "qwen2_moe": _parse_qwen2_moe, "qwen3_moe": _parse_qwen3_moe,
    "olmoe": _parse_olmoe, "deepseek_v3": _parse_deepseek_v3,
}
