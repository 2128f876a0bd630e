"""The numpy forward pass against transformers itself, on tiny random models of each family."""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

pytest.importorskip("torch", reason="parity oracle needs torch (pip install -e '.[oracle]')")
pytest.importorskip("transformers", reason="parity oracle needs transformers (pip install -e '.[oracle]')")

import _hf_oracle as oracle  # noqa: E402  (tests/runtime is on sys.path: pytest's prepend import mode)

from shardtool.runtime.model import DictWeightProvider, Model, ModelConfig  # noqa: E402

from _decode import generate  # noqa: E402

pytestmark = pytest.mark.oracle

PROMPT = [3, 17, 200, 45, 9, 128, 77, 5]
REL_TOL = 1e-4  # max |numpy - torch| <= REL_TOL * max |torch|


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    assert got.shape == ref.shape
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@cache
def reference(case: str):
    """(transformers model, its config.json dict, its reference logits on PROMPT), built once per case."""
    hf = oracle.build(case)
    return hf, oracle.config_dict(hf), oracle.logits(hf, PROMPT)


def provider(config, state) -> DictWeightProvider:
    return DictWeightProvider(state, fused_layout=oracle.fused_layout(config))


def numpy_model(case: str, **config_changes) -> Model:
    hf, config, _ = reference(case)
    cfg = dataclasses.replace(ModelConfig.from_hf_config(config), **config_changes)
    return Model(cfg, provider(config, oracle.state_dict(hf)))


@pytest.mark.parametrize("case", oracle.FAMILY_CASES)
def test_prefill_logits_match_transformers(case):
    _, _, ref = reference(case)
    assert rel_err(numpy_model(case).prefill(PROMPT), ref) <= REL_TOL


@pytest.mark.parametrize("case", oracle.FAMILY_CASES)
def test_kv_cache_decode_matches_full_forward(case):
    model = numpy_model(case)
    full = model.prefill(PROMPT)
    steps = [model.prefill(PROMPT[:3])[-1]] + [model.decode(t) for t in PROMPT[3:]]
    assert model.cache.length == len(PROMPT)
    assert rel_err(np.stack(steps), full[2:]) <= 1e-5


@pytest.mark.parametrize("case", oracle.FAMILY_CASES)
def test_greedy_tokens_match_generate(case):
    hf, _, _ = reference(case)
    assert generate(numpy_model(case), PROMPT, 16) == oracle.greedy(hf, PROMPT, 16)


# Each case must exercise the feature it is there for: switching the feature off on the numpy side
# (in the config, or in the weights) has to break parity, or the passing tests above prove nothing about it.
def _zero(suffix):
    return lambda state: {k: (np.zeros_like(v) if k.endswith(suffix) else v) for k, v in state.items()}


def _flip_interleave(cfg):
    return {"rope": dataclasses.replace(cfg.rope, interleave=not cfg.rope.interleave)}


FEATURES = {  # name: (case, config changes (or a function of the config giving them), weight change)
    "mixtral sliding window": ("mixtral", {"sliding_windows": (None, None)}, None),
    "qwen2 shared expert gate": ("qwen2_moe", {}, _zero("shared_expert_gate.weight")),
    "qwen2 q/k/v bias": ("qwen2_moe", {}, _zero("k_proj.bias")),
    "qwen2 un-normalized top-k": ("qwen2_moe", {"norm_topk_prob": True}, None),
    "qwen3 per-head q/k norm": ("qwen3_moe", {}, lambda s: {k: (v * 0 + 1 if k.endswith("q_norm.weight") else v)
                                                            for k, v in s.items()}),
    "qwen3 normalized top-k": ("qwen3_moe", {"norm_topk_prob": False}, None),
    "olmoe clip_qkv": ("olmoe", {"clip_qkv": None}, None),
    "deepseek score correction bias": ("deepseek_v3", {}, _zero("e_score_correction_bias")),
    "deepseek group-limited routing": ("deepseek_v3", {"n_group": 1, "topk_group": 1}, None),
    "deepseek routed scaling": ("deepseek_v3", {"routed_scaling_factor": 1.0}, None),
    "deepseek rope interleave": ("deepseek_v3", _flip_interleave, None),
    "deepseek rope no interleave": ("deepseek_v3_yarn", _flip_interleave, None),
    "deepseek yarn softmax mscale": ("deepseek_v3_yarn", {"attn_scale": (16 + 8) ** -0.5}, None),
    "deepseek yarn frequencies": ("deepseek_v3_yarn", lambda c: {"rope": dataclasses.replace(c.rope, kind="default")},
                                  None),
    "llama4 chunked attention": ("llama4", {"attention_chunks": ()}, None),
    "llama4 NoPE layer": ("llama4", {"rope_layers": ()}, None),
    "llama4 NoPE temperature tuning": ("llama4", lambda c: {"chunked_nope": dataclasses.replace(
        c.chunked_nope, temperature_tuning=False)}, None),
    "llama4 L2 q/k norm": ("llama4", lambda c: {"chunked_nope": dataclasses.replace(c.chunked_nope,
                                                                                     use_qk_norm=False)}, None),
    "llama4 complex (interleaved) rope": ("llama4", _flip_interleave, None),
    "llama4 shared expert": ("llama4", {}, _zero("shared_expert.down_proj.weight")),
    "llama4 router scales the expert input": ("llama4", {"router": "softmax", "norm_topk_prob": True}, None),
    "llama4 top-2 NoPE layer": ("llama4_llama3", {"rope_layers": ()}, None),
    "llama4 llama3 rope frequencies": ("llama4_llama3", lambda c: {"rope": dataclasses.replace(c.rope, kind="default")},
                                       None),
    "gpt-oss attention sinks": ("gpt_oss", {}, lambda s: {k: (v * 0 - 1e9 if k.endswith(".sinks") else v)
                                                          for k, v in s.items()}),
    "gpt-oss sliding window": ("gpt_oss", {"sliding_windows": (None, None, None)}, None),
    "gpt-oss router bias": ("gpt_oss", {}, _zero("router.bias")),
    "gpt-oss expert biases": ("gpt_oss", {}, _zero("gate_up_proj_bias")),
    "gpt-oss swiglu limit": ("gpt_oss", {"swiglu_limit": 1e9}, None),
    "gpt-oss swiglu alpha": ("gpt_oss", {"swiglu_alpha": 1.0}, None),
    "gpt-oss top-k then softmax": ("gpt_oss", {"router": "softmax", "norm_topk_prob": False}, None),
    "gpt-oss yarn": ("gpt_oss", lambda c: {"rope": dataclasses.replace(c.rope, kind="default")}, None),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_case_exercises_its_feature(feature):
    case, changes, reweigh = FEATURES[feature]
    hf, config, ref = reference(case)
    cfg = ModelConfig.from_hf_config(config)
    cfg = dataclasses.replace(cfg, **(changes(cfg) if callable(changes) else changes))
    state = oracle.state_dict(hf)
    model = Model(cfg, provider(config, reweigh(state) if reweigh else state))
    assert rel_err(model.prefill(PROMPT), ref) > 1e-3


def test_saved_checkpoint_names_match_state_dict(tmp_path):
    # save_pretrained writes per-expert tensors (Mixtral: block_sparse_moe.experts.E.w1); state_dict() fuses them.
    hf, config, _ = reference("mixtral")
    saved = oracle.saved_state(hf, tmp_path)
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in saved)
    from_saved = Model(ModelConfig.from_hf_config(config), DictWeightProvider(saved)).prefill(PROMPT)
    np.testing.assert_array_equal(from_saved, numpy_model("mixtral").prefill(PROMPT))


# Stored dtypes: the numpy model reads the low-precision arrays; transformers gets the float32 values
# they stand for, so only the dtype handling is under test.
PRECISION_CASES = {
    "mixtral-bfloat16": ("mixtral", "bfloat16", (128, 128)),
    "qwen3_moe-float16": ("qwen3_moe", "float16", (128, 128)),
    "deepseek_v3-float8-16x16": ("deepseek_v3", "float8", (16, 16)),
    "deepseek_v3_yarn-float8-128x128": ("deepseek_v3_yarn", "float8", (128, 128)),
    "llama4-bfloat16": ("llama4", "bfloat16", (128, 128)),
}


@pytest.mark.parametrize("name", sorted(PRECISION_CASES))
def test_stored_dtypes_match_transformers_on_dequantized_weights(name, tmp_path):
    case, kind, block = PRECISION_CASES[name]
    hf, config, _ = reference(case)
    stored, exact = oracle.lower_precision(oracle.saved_state(hf, tmp_path / "src"), kind, block)
    assert any(str(a.dtype) in (kind, "float8_e4m3fn") for a in stored.values())
    torch_model = oracle.load_weights(hf, tmp_path / "ref", exact)
    if kind == "float8":
        config = {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    cfg = ModelConfig.from_hf_config(config)
    model = Model(cfg, provider(config, stored))
    assert rel_err(model.prefill(PROMPT), oracle.logits(torch_model, PROMPT)) <= REL_TOL
    assert generate(model, PROMPT, 16) == oracle.greedy(torch_model, PROMPT, 16)


@pytest.mark.parametrize("low, high", [(1.0, 1.0), (1.0, 4.0)])  # Llama 4 Scout ships low = high = 1
def test_llama3_rope_frequencies_match_transformers(low, high):
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardtool.runtime.model._rope import inv_freq

    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 16.0, "low_freq_factor": low,
              "high_freq_factor": high, "original_max_position_embeddings": 8192}
    want, scaling = ROPE_INIT_FUNCTIONS["llama3"](Llama4TextConfig(hidden_size=5120, num_attention_heads=40,
                                                                   head_dim=128, rope_parameters=params))
    cfg = ModelConfig.from_hf_config({"model_type": "llama4_text", "vocab_size": 32, "hidden_size": 5120,
                                      "num_hidden_layers": 1, "num_attention_heads": 40, "head_dim": 128,
                                      "intermediate_size": 8, "rope_scaling": params})
    got, got_scaling = inv_freq(cfg.rope)
    assert got_scaling == scaling == 1.0
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert (got != inv_freq(dataclasses.replace(cfg.rope, kind="default"))[0]).sum() > 10  # the scaling acts


def test_mxfp4_experts_match_transformers_reading_the_same_checkpoint(tmp_path):
    """gpt-oss as released: MXFP4 expert blocks + scales. transformers dequantizes them itself (the oracle for the
    decoding too); the numpy model reads the packed arrays."""
    hf, config, _ = reference("gpt_oss")
    stored = oracle.write_mxfp4(hf, tmp_path)
    assert stored["model.layers.0.mlp.experts.down_proj_blocks"].dtype == np.uint8
    ref = oracle.load_mxfp4(tmp_path)
    model = Model(ModelConfig.from_hf_config({**config, "quantization_config": oracle.MXFP4_CONFIG}),
                  provider(config, stored))
    want = oracle.logits(ref, PROMPT)
    assert rel_err(model.prefill(PROMPT), want) <= REL_TOL
    assert rel_err(model.prefill(PROMPT), oracle.logits(hf, PROMPT)) > 1e-3  # the 4-bit weights really differ
    assert generate(model, PROMPT, 16) == oracle.greedy(ref, PROMPT, 16)
