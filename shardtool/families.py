"""The one table of model-family knowledge. Adding a family is adding a row here (and its tests).

Split, inspect, the resource contract and the runtime all ask this table: which config.json names a family,
which keys hold its expert counts, which layers carry routed experts, what its shared expert and attention
look like, how its fused expert tensors are laid out, and the transformers config-class defaults.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shardtool import formats
from shardtool.errors import CheckpointFormatError
from shardtool.hf_config import ConfigReader

CUSTOM = "custom"  # a layout named by --expert-pattern rather than by a row


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]           # config.json "model_type" values
    architectures: tuple[str, ...]         # config.json "architectures" entries
    expert_count_keys: tuple[str, ...]     # routed experts per layer; first is the canonical name, then aliases
    moe_rule: Literal["all", "sparse_step", "first_k_dense", "listed_or_interleaved"]
    expert_size_key: str                   # one routed expert's intermediate size
    dense_size_key: str = "intermediate_size"
    experts_per_token_keys: tuple[str, ...] = ("num_experts_per_tok", "experts_per_token")
    # shared expert: "none"; "gated" (one, sized by shared_expert_intermediate_size, behind a sigmoid gate);
    # "plain" (n_shared_experts of expert size); "one" (one of expert size)
    shared_expert: Literal["none", "gated", "plain", "one"] = "none"
    attention: Literal["gqa", "mla"] = "gqa"
    qk_norm: Literal["none", "per_head", "full"] = "none"
    # attention biases: the config key that switches them, its default, and whether o_proj has one too
    bias_key: str = "attention_bias"
    bias_default: bool = False
    o_proj_bias: bool = True
    attention_sinks: bool = False
    router_bias: bool = False              # router has a bias / score-correction vector
    expert_bias: bool = False              # routed experts' projections carry biases
    mtp_keys: tuple[str, ...] = ()         # multi-token-prediction layer count (stored after the decoder layers)
    # fused [E, ...] expert tensors: "out_in" [E, 2I, H]; "in_out" [E, H, 2I] (transposed);
    # "in_out_interleaved" as in_out with gate/up alternating on the last axis
    fused_layout: Literal["out_in", "in_out", "in_out_interleaved"] = "out_in"
    runtime: bool = False                  # the numpy forward pass runs it
    # "softmax": softmax over all experts, then top-k; "sigmoid_group": DeepSeek's group-limited sigmoid;
    # "topk_softmax": top-k of the (biased) logits, then a softmax over those k (gpt-oss); "sigmoid_input": top-k
    # of the logits, each chosen expert's sigmoid score multiplying that expert's input (Llama 4)
    router: Literal["softmax", "sigmoid_group", "topk_softmax", "sigmoid_input"] = "softmax"
    norm_topk_prob: bool | None = None     # fixed by the modeling code, or None: read from config.json
    # "layer_types": config.json's layer_types (default: sliding, full, sliding, ...) with one sliding_window
    sliding_window: Literal["none", "always", "flag", "per_layer", "layer_types"] = "none"
    # routed experts' activation: "silu" (SwiGLU), or gpt-oss's "clamped_swiglu" (gate clamped above and up on both
    # sides at swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1))
    expert_act: Literal["silu", "clamped_swiglu"] = "silu"
    mxfp4_experts: bool = False            # experts may be stored MXFP4 (quantization_config.quant_method "mxfp4")
    clip_qkv: bool = False
    # Llama 4 attention: chunked attention on RoPE layers, NoPE layers (no_rope_layers) with attention-temperature
    # tuning, interleaved (complex) RoPE and a weightless L2 q/k norm on RoPE layers (use_qk_norm)
    chunked_nope: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers config-class defaults (v5)


_QWEN_DEFAULTS = {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "use_sliding_window": False, "sliding_window": 4096}

TABLE: tuple[Family, ...] = (
    Family("mixtral", ("mixtral",), ("MixtralForCausalLM",), ("num_local_experts", "num_experts"), "all",
           "intermediate_size", runtime=True, norm_topk_prob=True, sliding_window="always",
           defaults={"rope_theta": 1e6, "rms_norm_eps": 1e-5, "sliding_window": None}),
    Family("qwen2_moe", ("qwen2_moe",), ("Qwen2MoeForCausalLM",), ("num_experts", "num_local_experts"),
           "sparse_step", "moe_intermediate_size", shared_expert="gated", bias_key="qkv_bias", bias_default=True,
           o_proj_bias=False, runtime=True,
           sliding_window="per_layer", defaults={**_QWEN_DEFAULTS, "max_window_layers": 28}),
    Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), ("num_experts", "num_local_experts"),
           "sparse_step", "moe_intermediate_size", qk_norm="per_head", runtime=True, sliding_window="flag",
           defaults=_QWEN_DEFAULTS),
    Family("olmoe", ("olmoe",), ("OlmoeForCausalLM",), ("num_experts", "num_local_experts"), "all",
           "intermediate_size", qk_norm="full", runtime=True, clip_qkv=True,
           defaults={"rope_theta": 1e4, "rms_norm_eps": 1e-5, "norm_topk_prob": False, "clip_qkv": None}),
    # Kimi-K2 ships DeepSeek-V3 modeling code with its own model_type.
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2"), ("DeepseekV3ForCausalLM",),
           ("n_routed_experts", "num_local_experts"), "first_k_dense", "moe_intermediate_size",
           shared_expert="plain", attention="mla", router_bias=True,
           mtp_keys=("num_nextn_predict_layers", "num_mtp_layers"), runtime=True, router="sigmoid_group",
           defaults={"rope_theta": 1e4, "rms_norm_eps": 1e-6, "norm_topk_prob": True, "rope_interleave": True,
                     "n_shared_experts": 1, "routed_scaling_factor": 2.5}),
    Family("gpt_oss", ("gpt_oss",), ("GptOssForCausalLM",), ("num_local_experts", "num_experts"), "all",
           "intermediate_size", bias_default=True, attention_sinks=True, router_bias=True, expert_bias=True,
           fused_layout="in_out_interleaved", runtime=True, router="topk_softmax", sliding_window="layer_types",
           expert_act="clamped_swiglu", mxfp4_experts=True, norm_topk_prob=True,
           defaults={"rope_theta": 1.5e5, "rms_norm_eps": 1e-5, "sliding_window": 128, "swiglu_alpha": 1.702,
                     "swiglu_limit": 7.0,
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096}}),
    Family("llama4", ("llama4", "llama4_text"), ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"),
           ("num_local_experts",), "listed_or_interleaved", "intermediate_size",
           dense_size_key="intermediate_size_mlp", shared_expert="one", fused_layout="in_out", runtime=True,
           router="sigmoid_input", norm_topk_prob=False, chunked_nope=True,
           defaults={"rope_theta": 5e5, "rms_norm_eps": 1e-5, "num_experts_per_tok": 1, "num_local_experts": 16,
                     "intermediate_size_mlp": 16384, "use_qk_norm": True, "attention_chunk_size": 8192,
                     "no_rope_layer_interval": 4, "attn_temperature_tuning": True, "floor_scale": 8192,
                     "attn_scale": 0.1}),
)
BY_NAME: dict[str, Family] = {f.name: f for f in TABLE}
SUPPORTED_FAMILIES = tuple(BY_NAME)
_BY_MODEL_TYPE = {mt: f for f in TABLE for mt in f.model_types}
_BY_ARCHITECTURE = {a: f for f in TABLE for a in f.architectures}
# model_type -> family, for the families the runtime runs.
RUNTIME_MODEL_TYPES: dict[str, str] = {mt: f.name for f in TABLE if f.runtime for mt in f.model_types}

# Module names checkpoints use for the MoE block and its router, and the names the runtime reads them under
# (Mixtral keeps the pre-v5 `block_sparse_moe` for its router and experts; gpt-oss calls its router `router`;
# Llama 4 calls the block feed_forward and its router the block's gate). The first matching prefix wins.
MOE_MODULE_ALIASES = {"block_sparse_moe.": "mlp.", "mlp.router.": "mlp.gate.", "feed_forward.router.": "mlp.gate.",
                      "feed_forward.": "mlp."}

# A multimodal checkpoint (Llama 4) stores its language model under this prefix: language_model.model.embed_tokens,
# language_model.lm_head; split keeps those names in the embed and head files.
TEXT_MODEL_WRAPPER = "language_model."

# HF tensor names of routed experts, every family's original layout. Per expert (Mixtral's w1/w3/w2 are
# gate/up/down):
EXPERT_PROJ_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# A routed expert's projections under their canonical names in an expert shard ([out, in] each).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PER_EXPERT = re.compile(
    r"(?P<prefix>(?:[A-Za-z0-9_]+\.)*?)layers\.(?P<layer>\d+)\.(?:block_sparse_moe|mlp|feed_forward)\.experts\."
    r"(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z0-9_.]+)")
# Fused 3-D tensors: [E, ...] holding every expert of a layer (layout per the row's fused_layout).
FUSED = re.compile(
    r"(?P<prefix>(?:[A-Za-z0-9_]+\.)*?)layers\.(?P<layer>\d+)\.(?:block_sparse_moe|mlp|feed_forward)\.experts\."
    r"(?P<proj>gate_up_proj|down_proj)(?:_(?P<part>bias|blocks|scales))?")


def mxfp4_experts(family: Family, r: ConfigReader) -> bool:
    """Whether config.json declares this family's routed experts MXFP4 (quantization_config.quant_method
    "mxfp4"). For a family whose experts may be MXFP4, any other quantization_config is refused."""
    quant = r.raw("quantization_config", None)
    if not family.mxfp4_experts or quant is None:
        return False
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if formats.declared(method) is not formats.MXFP4:
        raise CheckpointFormatError(f"config.json: quantization_config quant_method {method!r:.40} is not "
                                    f"supported for {family.name}",
                                    hint=f"expected {formats.MXFP4.quant_method!r} or no quantization_config")
    return True


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a config (Llama 4 nests it under text_config)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def find_family(config: Mapping[str, Any]) -> Family | None:
    """The row config.json names by model_type, else by an architectures entry; None when none does."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    archs = config.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        if isinstance(arch, str) and arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    return None


def detect_family(config: Mapping[str, Any], *, custom_ok: bool = False) -> str:
    found = find_family(config)
    if found is not None:
        return found.name
    if custom_ok:
        return CUSTOM
    raise CheckpointFormatError(
        f"unsupported model family (model_type={config.get('model_type')!r}, "
        f"architectures={config.get('architectures')!r})",
        path="config.json",
        hint=f"supported: {', '.join(SUPPORTED_FAMILIES)}; for another layout pass --expert-pattern REGEX "
             "with named groups 'layer' and 'expert'")


def expert_count(family: Family, r: ConfigReader) -> tuple[str, int]:
    """(the key that set it, routed experts per layer). transformers' attribute_map lets any alias stand."""
    key = r.first(*family.expert_count_keys)
    if not r.has(key):
        r.raw(key, aliases=family.expert_count_keys[1:])  # raises: lacks ... / ...
    return key, r.int(key)


def experts_per_token(family: Family, r: ConfigReader, *, minimum: int = 1) -> int:
    keys = family.experts_per_token_keys
    key = r.first(*keys)
    if not r.has(key):
        r.raw(key, aliases=keys[1:])
    return r.int(key, minimum=minimum)


def moe_layers(family: Family, r: ConfigReader, n_layers: int) -> tuple[bool, ...]:
    """Per decoder layer: does it carry routed experts (True) or a dense MLP."""
    if family.moe_rule == "sparse_step":
        # sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid
        dense = set(r.int_list("mlp_only_layers"))
        step = r.int("decoder_sparse_step", family.defaults.get("decoder_sparse_step", r.REQUIRED))
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    if family.moe_rule == "first_k_dense":
        first_dense = r.int("first_k_dense_replace", minimum=0)
        return tuple(i >= first_dense for i in range(n_layers))
    if family.moe_rule == "listed_or_interleaved":
        if r.has("moe_layers"):
            listed = set(r.int_list("moe_layers"))
            if listed and max(listed) >= n_layers:
                raise CheckpointFormatError(f"config.json: moe_layers names layer {max(listed)}, beyond "
                                            f"num_hidden_layers {n_layers}")
            return tuple(i in listed for i in range(n_layers))
        step = r.int("interleave_moe_layer_step", 1)
        return tuple((i + 1) % step == 0 for i in range(n_layers))
    return (True,) * n_layers
