"""The resource contract: what running a MoE model costs in bytes, from its shards or from config.json alone.

Pure arithmetic. Every value is a non-negative integer (bytes, counts, parameters) so the contract is
canonical msgpack inside the signed manifest head; see docs/resource-contract.md for each key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from shardtool import formats
from shardtool.checkpoint._split_plan import config_reader
from shardtool.errors import CheckpointFormatError
from shardtool.families import (BY_NAME, CUSTOM, Family, detect_family, expert_count, experts_per_token,
                                moe_layers, mxfp4_experts, text_config)
from shardtool.hf_config import ConfigReader

DEFAULT_CONTEXT_TOKENS = 4096
CONTRACT_VERSION = 1
# config.json is untrusted: it is read with the producer's caps (checkpoint/_split_plan.py config_reader); products
# that outgrow the manifest's 63-bit contract values are refused when the manifest is built.

# Order matters only for display; the manifest sorts keys.
KEYS = (
    "contract_version", "params_total", "params_active", "total_bytes", "trunk_bytes", "resident_trunk_bytes",
    "expert_bytes_total", "bytes_per_expert", "num_layers", "moe_layers", "mtp_layers", "experts_per_layer",
    "experts_per_token", "shared_experts", "expert_bytes_per_token_cold", "kv_cache_bytes_per_token",
    "kv_cache_element_bytes", "context_tokens", "min_memory_bytes",
)


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a model, by part, derived from its config."""

    family: str
    num_layers: int                  # decoder layers used for generation
    moe_layers: tuple[int, ...]      # indices of layers with routed experts
    mtp_layers: int                  # DeepSeek multi-token-prediction layers (stored, not used to generate)
    experts_per_layer: int
    experts_per_token: int
    shared_experts: int
    params_embed: int
    params_head: int                 # final norm + lm_head (0 for lm_head when tied)
    params_layers: tuple[int, ...]   # per decoder layer: everything but routed experts
    params_expert: int               # one routed expert
    params_mtp: int                  # all MTP layers, routed experts included
    kv_elements_per_token: int       # K/V cache elements per token of context, all layers
    kv_element_bytes: int
    params_expert_mxfp4: int = 0     # of params_expert, the weights stored as MXFP4 (gpt-oss), not at B bits
    bytes_expert_mxfp4: int = 0      # their bytes: blocks + scales, 4.25 bits per weight

    @property
    def params_total(self) -> int:
        routed = len(self.moe_layers) * self.experts_per_layer * self.params_expert
        return self.params_embed + self.params_head + sum(self.params_layers) + routed + self.params_mtp

    @property
    def params_active(self) -> int:
        routed = len(self.moe_layers) * self.experts_per_token * self.params_expert
        return self.params_embed + self.params_head + sum(self.params_layers) + routed


def _int(r: ConfigReader, *keys: str, default: int | None = None, lo: int = 0) -> int:
    """The first of `keys` (aliases) config.json sets, an integer in [lo, its cap]."""
    key = r.first(*keys)
    if not r.has(key) and default is None:
        r.raw(key, aliases=keys[1:])  # raises: lacks ... / ...
    return r.int(key, default, minimum=lo)


def _attention(family: Family | None, r: ConfigReader, h: int) -> tuple[int, int]:
    """(params of one attention block incl. its norms-in-attention, KV elements per token per layer)."""
    nh = _int(r, "num_attention_heads", lo=1)
    if family is not None and family.attention == "mla":
        rope, nope = _int(r, "qk_rope_head_dim"), _int(r, "qk_nope_head_dim")
        v, kv_rank = _int(r, "v_head_dim"), _int(r, "kv_lora_rank")
        q_rank = _int(r, "q_lora_rank", default=0)
        q = h * q_rank + q_rank + q_rank * nh * (nope + rope) if q_rank else h * nh * (nope + rope)
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * nh * (nope + v)
        # MLA caches the compressed latent and the shared rope key, not per-head K/V.
        return q + kv + nh * v * h, kv_rank + rope
    nkv = _int(r, "num_key_value_heads", default=nh)
    hd = _int(r, "head_dim", default=0) or h // nh
    params = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
    qkv_bias = nh * hd + 2 * nkv * hd
    if family is None:
        params += qkv_bias + h if r.bool("attention_bias", False) else 0
    else:
        if r.bool(family.bias_key, family.bias_default):
            params += qkv_bias + (h if family.o_proj_bias else 0)
        params += nh if family.attention_sinks else 0
    qk_norm = family.qk_norm if family is not None else "none"
    if qk_norm == "per_head":
        params += 2 * hd          # per-head q_norm, k_norm
    elif qk_norm == "full":
        params += nh * hd + nkv * hd  # q_norm, k_norm over whole projections
    return params, 2 * nkv * hd


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """Parameter counts for a supported family from config.json alone."""
    family = BY_NAME[detect_family(config)]
    cfg = text_config(config)
    r = config_reader(config)
    h, vocab = _int(r, "hidden_size"), _int(r, "vocab_size")
    n = _int(r, "num_hidden_layers")
    experts = expert_count(family, r)[1]
    top_k = experts_per_token(family, r, minimum=0)
    moe = tuple(i for i, sparse in enumerate(moe_layers(family, r, n)) if sparse)

    expert_i = _int(r, family.expert_size_key)
    dense_i = _int(r, family.dense_size_key)
    params_expert = 3 * h * expert_i + (2 * expert_i + h if family.expert_bias else 0)
    mxfp4 = mxfp4_experts(family, r)  # gate, up [I, H] and down [H, I] as blocks + scales; biases stay at B bits

    router = experts * h + (experts if family.router_bias else 0)
    shared, shared_params = 0, 0
    if family.shared_expert == "gated" and _int(r, "shared_expert_intermediate_size", default=0):
        shared, shared_params = 1, 3 * h * _int(r, "shared_expert_intermediate_size") + h
    elif family.shared_expert == "plain":
        shared = _int(r, "n_shared_experts", default=0)
        shared_params = 3 * h * expert_i * shared
    elif family.shared_expert == "one":
        shared, shared_params = 1, 3 * h * expert_i

    attn, kv_per_layer = _attention(family, r, h)
    base = attn + 2 * h  # + input_layernorm, post_attention_layernorm
    moe_set = set(moe)
    layers = tuple(base + (router + shared_params if i in moe_set else 3 * h * dense_i) for i in range(n))

    mtp = _int(r, *family.mtp_keys, default=0) if family.mtp_keys else 0
    # Each DeepSeek MTP module: a full MoE decoder layer + enorm, hnorm, eh_proj, shared_head.norm and its own
    # copies of the embedding and output head (as stored in the released checkpoints).
    mtp_params = mtp * (base + router + shared_params + experts * params_expert + 3 * h + 2 * h * h
                        + 2 * vocab * h)
    tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    return ModelShape(
        family=family, num_layers=n, moe_layers=moe, mtp_layers=mtp, experts_per_layer=experts,
        experts_per_token=top_k, shared_experts=shared, params_embed=vocab * h,
        params_head=h + (0 if tied else vocab * h), params_layers=layers, params_expert=params_expert,
        params_mtp=mtp_params, kv_elements_per_token=kv_per_layer * n,
        kv_element_bytes=4 if dtype == "float32" else 2,
        params_expert_mxfp4=3 * h * expert_i if mxfp4 else 0,
        bytes_expert_mxfp4=_projection_bytes(formats.MXFP4, expert_i, h) if mxfp4 else 0,
    )


def contract_from_config(config: Mapping[str, Any], bits_per_weight: float, *,
                         context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                         expert_quantize: str | None = None) -> dict[str, int]:
    """The contract a split of this model would carry if every weight took `bits_per_weight` bits, except the
    experts a config.json declares MXFP4 (gpt-oss), which take what they take: 4.25 bits per weight. With
    `expert_quantize` ("int8", "int4": `split --quantize`), the other routed experts' projections take their
    block format's real bytes (8.5 or 4.5 bits per weight, `shardtool.formats`); their biases stay at B bits."""
    if not bits_per_weight > 0:
        raise CheckpointFormatError(f"bits per weight must be > 0, got {bits_per_weight}")
    s = model_shape(config)

    def size(params: int) -> int:
        return round(params * bits_per_weight / 8)

    resident = size(s.params_embed + s.params_head + sum(s.params_layers))
    per_expert = size(s.params_expert - s.params_expert_mxfp4) + s.bytes_expert_mxfp4
    if expert_quantize is not None and not s.params_expert_mxfp4:
        per_expert = _quantized_expert_bytes(config, expert_quantize, bits_per_weight)
    routed_total = len(s.moe_layers) * s.experts_per_layer * per_expert
    trunk = resident + size(s.params_mtp)
    return _assemble(
        shape=s, total=trunk + routed_total, trunk=trunk, resident=resident, expert_total=routed_total,
        per_expert=per_expert, layer_expert_max={i: per_expert for i in s.moe_layers},
        params_total=s.params_total, params_active=s.params_active, context_tokens=context_tokens)


def _quantized_expert_bytes(config: Mapping[str, Any], method: str, bits_per_weight: float) -> int:
    """One routed expert under `split --quantize`: gate/up [I, H] and down [H, I] in the block format, biases
    (gpt-oss) at `bits_per_weight`. Refuses widths the split would refuse."""
    if method not in formats.SPLIT_METHODS:
        raise CheckpointFormatError(f"unknown expert quantization {method!r:.40}, expected "
                                    f"{' or '.join(formats.SPLIT_METHODS)}")
    fmt = formats.BY_NAME[method]
    family = BY_NAME[detect_family(config)]
    r = config_reader(config)
    h, i = _int(r, "hidden_size"), _int(r, family.expert_size_key)
    block = fmt.block[1]
    if h % block or i % block:
        raise CheckpointFormatError(f"hidden_size {h} and {family.expert_size_key} {i} must be multiples of "
                                    f"{block} to quantize the experts")
    biases = 2 * i + h if family.expert_bias else 0
    return _projection_bytes(fmt, i, h) + round(biases * bits_per_weight / 8)


def _projection_bytes(fmt: formats.Format, i: int, h: int) -> int:
    """One routed expert's gate, up [I, H] and down [H, I] stored in `fmt`."""
    return 2 * fmt.nbytes(i, h) + fmt.nbytes(h, i)


@dataclass(frozen=True)
class SplitSizes:
    """What split measured: file sizes by role and parameter counts from tensor shapes."""

    total_bytes: int
    trunk_bytes: int
    mtp_trunk_bytes: int
    expert_bytes_total: int
    layer_expert_max: Mapping[int, int]     # layer -> largest expert file in it
    experts_per_layer: int
    params_total: int
    params_resident: int                    # trunk params excluding MTP layers
    layer_expert_params: Mapping[int, int]  # layer -> params of one expert


def check_config(config: Mapping[str, Any]) -> None:
    """Fail before split writes anything if config.json lacks what the contract needs."""
    if detect_family(config, custom_ok=True) == CUSTOM:
        _int(config_reader(config), *_CUSTOM_TOP_K)
    else:
        model_shape(config)


def contract_from_split(config: Mapping[str, Any], sizes: SplitSizes, *,
                        context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> dict[str, int]:
    """The contract stored in the manifest: sizes measured from the shards, structure from config."""
    family = detect_family(config, custom_ok=True)
    if family == CUSTOM:
        s = _custom_shape(config, sizes)
    else:
        s = model_shape(config)
    active = sizes.params_resident + s.experts_per_token * sum(sizes.layer_expert_params.values())
    return _assemble(
        shape=s, total=sizes.total_bytes, trunk=sizes.trunk_bytes, resident=sizes.trunk_bytes - sizes.mtp_trunk_bytes,
        expert_total=sizes.expert_bytes_total, per_expert=max(sizes.layer_expert_max.values(), default=0),
        layer_expert_max=sizes.layer_expert_max, params_total=sizes.params_total, params_active=active,
        context_tokens=context_tokens, experts_per_layer=sizes.experts_per_layer)


# --expert-pattern layouts have no row: the generic names transformers and remote code use.
_CUSTOM_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk")


def _custom_shape(config: Mapping[str, Any], sizes: SplitSizes) -> ModelShape:
    """For --expert-pattern layouts: structure from the generic config keys, KV from GQA fields if present."""
    cfg = text_config(config)
    r = config_reader(config)
    n = _int(r, "num_hidden_layers", default=len(sizes.layer_expert_max))
    kv = 0
    if isinstance(cfg.get("hidden_size"), int) and isinstance(cfg.get("num_attention_heads"), int):
        kv = _attention(None, r, _int(r, "hidden_size"))[1] * n
    return ModelShape(
        family=CUSTOM, num_layers=n, moe_layers=tuple(sorted(sizes.layer_expert_max)), mtp_layers=0,
        experts_per_layer=sizes.experts_per_layer,
        experts_per_token=_int(r, *_CUSTOM_TOP_K),
        shared_experts=_int(r, "n_shared_experts", "num_shared_experts", default=0),
        params_embed=0, params_head=0, params_layers=(), params_expert=0, params_mtp=0,
        kv_elements_per_token=kv, kv_element_bytes=4 if cfg.get("torch_dtype") == "float32" else 2)


def _assemble(*, shape: ModelShape, total: int, trunk: int, resident: int, expert_total: int, per_expert: int,
              layer_expert_max: Mapping[int, int], params_total: int, params_active: int, context_tokens: int,
              experts_per_layer: int | None = None) -> dict[str, int]:
    k = shape.experts_per_token
    cold = sum(k * b for b in layer_expert_max.values())
    worst_layer = max((k * b for b in layer_expert_max.values()), default=0)
    kv_token = shape.kv_elements_per_token * shape.kv_element_bytes
    contract = {
        "contract_version": CONTRACT_VERSION,
        "params_total": params_total,
        "params_active": params_active,
        "total_bytes": total,
        "trunk_bytes": trunk,
        "resident_trunk_bytes": resident,
        "expert_bytes_total": expert_total,
        "bytes_per_expert": per_expert,
        "num_layers": shape.num_layers,
        "moe_layers": len(layer_expert_max),
        "mtp_layers": shape.mtp_layers,
        "experts_per_layer": experts_per_layer if experts_per_layer is not None else shape.experts_per_layer,
        "experts_per_token": k,
        "shared_experts": shape.shared_experts,
        "expert_bytes_per_token_cold": cold,
        "kv_cache_bytes_per_token": kv_token,
        "kv_cache_element_bytes": shape.kv_element_bytes,
        "context_tokens": context_tokens,
        # Trunk resident + one layer's selected experts in flight + the KV cache for `context_tokens`.
        "min_memory_bytes": resident + worst_layer + kv_token * context_tokens,
    }
    return contract


@dataclass(frozen=True)
class Estimate:
    """Derived figures for a disk bandwidth; floats are fine here, they are never signed."""

    seconds_per_token_cold: float
    tokens_per_second_cold: float | None  # None when no expert bytes stream per token (nothing to divide by)
    seconds_to_load_trunk: float
    min_memory_bytes: int


def check_contract_keys(contract: Mapping[str, int]) -> None:
    """A contract this version can read: version CONTRACT_VERSION, exactly the KEYS. The manifest decoder
    checks only its form (a flat map of small names to integers); what the names mean is known here."""
    version = contract.get("contract_version")
    if type(version) is not int or version != CONTRACT_VERSION:  # True == 1
        raise CheckpointFormatError(f"resource contract version is {version!r}, this tool reads {CONTRACT_VERSION}")
    missing = [k for k in KEYS if k not in contract]
    unknown = sorted(set(contract) - set(KEYS))
    if missing or unknown:
        raise CheckpointFormatError(f"resource contract lacks {missing[:4]} / has unknown {unknown[:4]}"
                                    if missing and unknown else
                                    f"resource contract lacks keys {missing[:8]}" if missing else
                                    f"resource contract has unknown keys {unknown[:8]}")


def estimate(contract: Mapping[str, int], *, disk_gbps: float, context_tokens: int | None = None) -> Estimate:
    """Seconds per token when every selected expert is read from disk (cold cache) at `disk_gbps` GB/s."""
    if not disk_gbps > 0:
        raise CheckpointFormatError(f"disk bandwidth must be > 0 GB/s, got {disk_gbps}")
    rate = disk_gbps * 1e9
    cold = contract.get("expert_bytes_per_token_cold", 0) / rate
    memory = contract.get("min_memory_bytes", 0)
    if context_tokens is not None:
        memory += contract.get("kv_cache_bytes_per_token", 0) * (context_tokens - contract.get("context_tokens", 0))
    return Estimate(cold, 1 / cold if cold else None, contract.get("resident_trunk_bytes", 0) / rate,
                    memory)


def expected_hit_rate(contract: Mapping[str, int], memory_bytes: int, *, context_tokens: int | None = None) -> float:
    """The share of routed-expert reads a shard cache is expected to serve under a memory budget of `memory_bytes`:
    what the budget leaves above the floor (`estimate`'s min_memory_bytes) caches experts, and with routing spread
    evenly over every expert (the contract knows no routing statistics; a trained model's skew only helps) a read
    hits with probability (cached expert bytes) / (all expert bytes). 0 at or below the floor, 1 once all fit."""
    total = contract.get("expert_bytes_total", 0)
    if not total:
        return 1.0
    spare = memory_bytes - estimate(contract, disk_gbps=1.0, context_tokens=context_tokens).min_memory_bytes
    return min(1.0, max(0.0, spare / total))


def seconds_per_token_at(contract: Mapping[str, int], memory_bytes: int, *, disk_gbps: float,
                         context_tokens: int | None = None) -> float:
    """Seconds per token under a memory budget at `disk_gbps`: the cold figure times the expected miss rate."""
    cold = estimate(contract, disk_gbps=disk_gbps, context_tokens=context_tokens).seconds_per_token_cold
    return cold * (1.0 - expected_hit_rate(contract, memory_bytes, context_tokens=context_tokens))
