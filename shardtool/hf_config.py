"""The one reader of Hugging Face config.json values: typed, strict, and capped.

config.json is untrusted input (a signed one too): its sizes drive allocations no shard has to back (KV cache,
activations, rotary tables, FP8 scale tiles) and products that must fit the manifest's 63-bit contract. Every
number is looked up in a caps table by name, so a field without a cap cannot be read (`ConfigReader.int`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardtool.errors import CheckpointFormatError

# Runtime caps: far above any released MoE (DeepSeek-V3 / Kimi-K2: hidden 7168, vocab 163840, 384 experts,
# 128 heads, 61 layers, 163840 positions), low enough that nothing sized from them exhausts memory.
_MAX_DIM = 1 << 18  # any matrix dimension: intermediate sizes, FP8 block sides
_MAX_HEAD = 1 << 12  # one attention head's channels
_MAX_LAYERS = 1 << 12
_MAX_VOCAB = 1 << 21
_MAX_POSITIONS = 1 << 24
INT_CAPS: dict[str, int] = {
    "hidden_size": 1 << 16, "intermediate_size": _MAX_DIM, "moe_intermediate_size": _MAX_DIM,
    "shared_expert_intermediate_size": _MAX_DIM, "intermediate_size_mlp": _MAX_DIM, "vocab_size": _MAX_VOCAB,
    "num_hidden_layers": _MAX_LAYERS, "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10,
    "head_dim": _MAX_HEAD, "num_local_experts": 1 << 14, "num_experts": 1 << 14, "n_routed_experts": 1 << 14,
    "num_experts_per_tok": 1 << 8, "experts_per_token": 1 << 8, "moe_topk": 1 << 8,
    "n_group": 1 << 14, "topk_group": 1 << 14, "n_shared_experts": 1 << 6, "num_shared_experts": 1 << 6,
    "first_k_dense_replace": _MAX_LAYERS, "decoder_sparse_step": _MAX_LAYERS, "max_window_layers": _MAX_LAYERS,
    "interleave_moe_layer_step": _MAX_LAYERS, "mlp_only_layers": _MAX_LAYERS, "moe_layers": _MAX_LAYERS,
    "num_nextn_predict_layers": _MAX_LAYERS, "num_mtp_layers": _MAX_LAYERS,
    "sliding_window": _MAX_POSITIONS, "max_position_embeddings": _MAX_POSITIONS,
    "original_max_position_embeddings": _MAX_POSITIONS, "bos_token_id": _MAX_VOCAB, "eos_token_id": _MAX_VOCAB,
    "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 14, "qk_nope_head_dim": _MAX_HEAD, "qk_rope_head_dim": _MAX_HEAD,
    "v_head_dim": _MAX_HEAD, "weight_block_size": _MAX_DIM,
    "attention_chunk_size": _MAX_POSITIONS, "floor_scale": _MAX_POSITIONS, "no_rope_layer_interval": _MAX_LAYERS,
    "no_rope_layers": 1,  # per layer: 1 = RoPE, 0 = NoPE
}
# Floats: the largest magnitude accepted (rope factors, scales, epsilons).
FLOAT_CAPS: dict[str, float] = {
    "rope_theta": 1e12, "factor": 1e4, "attention_factor": 1e4, "beta_fast": 1e4, "beta_slow": 1e4,
    "mscale": 1e4, "mscale_all_dim": 1e4, "rms_norm_eps": 1.0, "clip_qkv": 1e9, "routed_scaling_factor": 1e4,
    "low_freq_factor": 1e4, "high_freq_factor": 1e4, "attn_scale": 1e4,
    "swiglu_alpha": 1e4, "swiglu_limit": 1e9,
}

# Producer caps (split, inspect): the contract is arithmetic only, and a product that outgrows the manifest's
# 63-bit values is refused when the manifest is built, so sizes may reach 2^40; the same fields, no others.
ARITHMETIC_CAP = 2**40
CONTRACT_INT_CAPS: dict[str, int] = {key: ARITHMETIC_CAP for key in INT_CAPS}

_REQUIRED = object()


class ConfigReader:
    """Typed access to config.json fields; every failure names the field and the value, every number is capped."""

    REQUIRED = _REQUIRED

    def __init__(self, d: Mapping[str, Any], defaults: Mapping[str, Any] | None = None, *, prefix: str = "",
                 int_caps: Mapping[str, int] = INT_CAPS):
        if not isinstance(d, Mapping):
            raise CheckpointFormatError(f"config.json: {prefix or 'the config'} must be a JSON object, "
                                        f"got {type(d).__name__}")
        self.d = d
        self.defaults = defaults or {}
        self.prefix = prefix  # where `d` sits in config.json, for messages: "rope_scaling."
        self.int_caps = int_caps

    def nested(self, key: str, prefix: str) -> ConfigReader:
        return ConfigReader(self.d.get(key) or {}, {}, prefix=prefix, int_caps=self.int_caps)

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def first(self, *keys: str) -> str:
        """The first of `keys` config.json sets (aliases of one field), else the first (reported as missing)."""
        return next((k for k in keys if self.has(k)), keys[0])

    def raw(self, key: str, default: Any = _REQUIRED, *, aliases: tuple[str, ...] = ()) -> Any:
        """A value of any type (the caller checks it); None counts as absent, as in transformers."""
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is not _REQUIRED:
            return default
        if key in self.defaults:
            return self.defaults[key]
        raise CheckpointFormatError(f"config.json: lacks {' / '.join((key, *aliases))}"
                                    if not self.prefix else f"config.json: lacks {self.prefix}{key}")

    def int(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1, cap: int | None = None) -> Any:
        v = self.raw(key, default)
        if v is None:
            return v
        return check_int(f"{self.prefix}{key}", v, cap if cap is not None else self.int_caps[key], minimum)

    def float(self, key: str, default: Any = _REQUIRED, *, positive: bool = True) -> Any:
        v = self.raw(key, default)
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
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise CheckpointFormatError(f"config.json: {self.prefix}{key} must be true or false, got {v!r}")
        return v

    def int_list(self, key: str, *, minimum: int = 0) -> tuple[int, ...]:
        v = self.raw(key, [])
        if not isinstance(v, list):
            raise CheckpointFormatError(f"config.json: {self.prefix}{key} must be a list of integers, got {v!r:.80}")
        cap = self.int_caps[key]
        return tuple(check_int(f"{self.prefix}{key}[{i}]", x, cap, minimum) for i, x in enumerate(v))


def check_int(name: str, v: Any, cap: int, minimum: int) -> int:
    """`v` as a config.json integer field `name` in [minimum, cap], or a CheckpointFormatError naming both."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise CheckpointFormatError(f"config.json: {name} must be an integer >= {minimum}, got {v!r:.80}")
    if v > cap:
        raise CheckpointFormatError(f"config.json: {name} is {v}, above the cap of {cap}")
    return v
