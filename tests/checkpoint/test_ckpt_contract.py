"""The resource contract: published model sizes from config alone, and agreement with what split measures."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from shardtool.checkpoint import CONTRACT_KEYS, contract_from_config, estimate, model_shape, split_checkpoint
from shardtool.errors import CheckpointFormatError

from ckpt_helpers import NOW
from test_ckpt_split_join import CASES, _source

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# Kimi-K2: DeepSeek-V3's architecture with 64 heads, 384 experts, 8 active, one dense layer, no MTP layer.
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
           "num_key_value_heads": 64, "n_routed_experts": 384, "first_k_dense_replace": 1,
           "num_nextn_predict_layers": 0}
# A model nobody can download: 2.78 T parameters, 896 experts of which 16 run per token.
GIANT = {**KIMI_K2, "model_type": "deepseek_v3", "num_hidden_layers": 71, "n_routed_experts": 896,
         "num_experts_per_tok": 16}
EXPERT_PARAMS = 3 * 7168 * 2048
# gpt-oss-20b's config.json as released (layer_types omitted: the config class alternates them the same way).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}


def test_deepseek_v3_matches_published_parameter_counts() -> None:
    s = model_shape(DEEPSEEK_V3)
    # DeepSeek-V3 report: 671 B parameters (+ 14 B in the MTP module), 37 B activated per token.
    assert s.params_total - s.params_mtp == pytest.approx(671e9, rel=0.002)
    assert s.params_mtp == pytest.approx(14e9, rel=0.05)
    assert s.params_active == pytest.approx(37e9, rel=0.02)


# Llama 4 Scout as published (multimodal config, the language model under text_config); Maverick: 128 experts
# on every other layer, dense MLPs (intermediate_size_mlp) between.
LLAMA4_SCOUT_TEXT = {
    "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)], "attention_chunk_size": 8192,
    "torch_dtype": "bfloat16",
}
LLAMA4_SCOUT = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
                "text_config": LLAMA4_SCOUT_TEXT}
LLAMA4_MAVERICK = {**LLAMA4_SCOUT, "text_config": {**LLAMA4_SCOUT_TEXT, "num_local_experts": 128,
                                                    "interleave_moe_layer_step": 2}}


@pytest.mark.parametrize("config, experts, moe_layers, total_b, active_b", [
    (LLAMA4_SCOUT, 16, 48, 107.8, 17.2), (LLAMA4_MAVERICK, 128, 24, 400.7, 17.2)])
def test_llama4_matches_published_parameter_counts(config, experts, moe_layers, total_b, active_b) -> None:
    """Meta: Scout 17B active / 109B total, Maverick 17B active / 400B total (both with the vision tower)."""
    h, expert, dense, vocab = 5120, 3 * 5120 * 8192, 3 * 5120 * 16384, 202048
    attention = h * 40 * 128 * 2 + 2 * h * 8 * 128 + 2 * h  # q, o, k, v, the two layer norms
    moe = attention + experts * h + expert  # + router + shared expert (+ routed experts below)
    total = 2 * vocab * h + h + moe_layers * (moe + experts * expert) + (48 - moe_layers) * (attention + dense)
    active = 2 * vocab * h + h + moe_layers * (moe + expert) + (48 - moe_layers) * (attention + dense)
    c = contract_from_config(config, 16)
    assert (c["params_total"], c["params_active"]) == (total, active)
    assert round(c["params_total"] / 1e9, 1) == total_b and round(c["params_active"] / 1e9, 1) == active_b
    assert (c["moe_layers"], c["experts_per_layer"], c["experts_per_token"], c["shared_experts"]) == \
        (moe_layers, experts, 1, 1)
    assert c["kv_cache_bytes_per_token"] == 48 * 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bf16, every layer
    assert c["bytes_per_expert"] == expert * 2 and c["expert_bytes_per_token_cold"] == moe_layers * expert * 2


def test_kimi_k2_from_config_alone() -> None:
    c = contract_from_config(KIMI_K2, 8.0)  # FP8 weights: one byte each (scales ignored at 8.0 bits)
    assert 1.00e12 <= c["params_total"] <= 1.05e12  # "1 T total parameters"
    assert 32e9 <= c["params_active"] <= 33.5e9       # "32 B activated"
    assert (c["num_layers"], c["moe_layers"], c["mtp_layers"]) == (61, 60, 0)
    assert (c["experts_per_layer"], c["experts_per_token"], c["shared_experts"]) == (384, 8, 1)
    assert c["bytes_per_expert"] == EXPERT_PARAMS
    assert c["expert_bytes_per_token_cold"] == 8 * 60 * EXPERT_PARAMS
    assert c["kv_cache_bytes_per_token"] == (512 + 64) * 61 * 2  # MLA caches the latent + rope key, BF16
    assert c["min_memory_bytes"] == c["resident_trunk_bytes"] + 8 * EXPERT_PARAMS + c["kv_cache_bytes_per_token"] * 4096
    est = estimate(c, disk_gbps=2.0)
    assert est.seconds_per_token_cold == pytest.approx(8 * 60 * EXPERT_PARAMS / 2e9)


def test_giant_896_expert_model_from_config_alone() -> None:
    c = contract_from_config(GIANT, 4.0)
    assert c["params_total"] == pytest.approx(2.78e12, rel=0.005)
    assert (c["experts_per_layer"], c["experts_per_token"], c["moe_layers"]) == (896, 16, 70)
    assert c["total_bytes"] == pytest.approx(c["params_total"] / 2, abs=2)
    assert c["expert_bytes_per_token_cold"] == 16 * 70 * EXPERT_PARAMS // 2
    # The headline-free number: ~24.7 GB of experts read per token with a cold cache, 12 s at 2 GB/s.
    assert estimate(c, disk_gbps=2.0).seconds_per_token_cold == pytest.approx(12.33, rel=0.01)
    assert estimate(c, disk_gbps=2.0, context_tokens=131072).min_memory_bytes == \
        c["min_memory_bytes"] + c["kv_cache_bytes_per_token"] * (131072 - 4096)


@pytest.mark.parametrize("config,total,active,gib", [(GPT_OSS_20B, 20.91e9, 3.61e9, 12.8),
                                                     (GPT_OSS_120B, 116.83e9, 5.13e9, 60.8)],
                         ids=["gpt-oss-20b", "gpt-oss-120b"])
def test_gpt_oss_mxfp4_experts_match_the_published_checkpoint_sizes(config, total, active, gib) -> None:
    """gpt-oss model card: 20.91 B / 116.83 B parameters, 3.61 B / 5.13 B active (embeddings excluded), checkpoints
    of 12.8 GiB / 60.8 GiB: BF16 everywhere but the experts' weights, which are MXFP4 (4.25 bits per weight)."""
    c = contract_from_config(config, 16.0)
    s = model_shape(config)
    assert c["params_total"] == pytest.approx(total, rel=0.001)
    assert c["params_active"] - s.params_embed == pytest.approx(active, rel=0.005)
    h = i = 2880
    # gate and up [I, H], down [H, I]: 32 weights in 16 bytes + 1 scale byte; the 2I + H biases stay BF16
    one_expert = 3 * (h * i // 32) * 17 + (2 * i + h) * 2
    assert c["bytes_per_expert"] == one_expert == 13_236_480
    assert c["expert_bytes_total"] == config["num_hidden_layers"] * config["num_local_experts"] * one_expert
    assert c["expert_bytes_per_token_cold"] == config["num_hidden_layers"] * 4 * one_expert
    assert c["total_bytes"] / 2**30 == pytest.approx(gib, abs=0.05)
    # Without the quantization_config the same model at 16 bits: experts 3.76x larger
    bf16 = contract_from_config({k: v for k, v in config.items() if k != "quantization_config"}, 16.0)
    assert bf16["bytes_per_expert"] == 2 * s.params_expert and bf16["params_total"] == c["params_total"]


def test_contract_keys_are_canonical_integers() -> None:
    c = contract_from_config(GIANT, 4.5)
    assert list(c) == list(CONTRACT_KEYS)
    assert all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in c.values())
    assert len(c) <= 64 and all(len(k) <= 64 for k in c)


@pytest.mark.parametrize("config,bits", [({**KIMI_K2, "hidden_size": None}, 8.0), ({**KIMI_K2, "hidden_size": "7168"}, 8.0),
                                         (KIMI_K2, 0.0), ({"model_type": "llama"}, 8.0)],
                         ids=["missing-hidden", "string-hidden", "zero-bits", "unsupported-family"])
def test_bad_config_is_refused(config: dict, bits: float, raises_exactly) -> None:
    with raises_exactly(CheckpointFormatError):
        contract_from_config(config, bits)


def _data_bytes(path: Path) -> int:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    return path.stat().st_size - 8 - n


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_arithmetic_agrees_with_split(case: str, make_tiny, tmp_path: Path) -> None:
    """The config-only parameter model counts exactly the elements split finds in the tensors."""
    src = _source(make_tiny, case)
    config = json.loads((src / "config.json").read_text())
    measured = split_checkpoint(src, tmp_path / "out", model_id="tiny", now=NOW).contract
    bits = {"float32": 32, "bfloat16": 16, "float16": 16}[config.get("torch_dtype") or config["dtype"]]
    predicted = contract_from_config(config, bits)
    same = ("params_total", "params_active", "num_layers", "moe_layers", "mtp_layers", "experts_per_layer",
            "experts_per_token", "shared_experts", "kv_cache_bytes_per_token", "kv_cache_element_bytes")
    assert {k: measured[k] for k in same} == {k: predicted[k] for k in same}
    if CASES[case][1].get("fp8"):
        return  # FP8 storage is not a uniform bits-per-weight; the parameter counts above still agree
    out = tmp_path / "out"
    trunk = sum(_data_bytes(p) for p in (out / "trunk").glob("*.safetensors"))
    experts = sorted((out / "experts").rglob("*.safetensors"))
    # DeepSeek keeps e_score_correction_bias in F32 whatever the checkpoint dtype: the only non-uniform tensor.
    f32_bias = (predicted["moe_layers"] + predicted["mtp_layers"]) * predicted["experts_per_layer"] * (4 - bits // 8) \
        if config["model_type"] == "deepseek_v3" else 0
    assert trunk == predicted["trunk_bytes"] + f32_bias
    assert {_data_bytes(p) for p in experts} == {predicted["bytes_per_expert"]}
