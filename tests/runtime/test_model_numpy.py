"""The numpy forward pass on its own (no torch): config validation, dtypes, providers, cache, sampling."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from shardtool.errors import CheckpointFormatError, UsageError
from shardtool.runtime.engine._sampling import sample_token
from shardtool.blockquant import quantize_fp8
from shardtool.runtime.model import (DictWeightProvider, KVCache, Model, ModelConfig, bytes_per_token, dequantize,
                                     to_float32, trunk_shapes)

from _decode import generate, stream

_BASE = {"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 40, "max_position_embeddings": 64}
CONFIGS = {
    "mixtral": {**_BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 3},
    "qwen2_moe": {**_BASE, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "mlp_only_layers": [1]},
    "qwen3_moe": {**_BASE, "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2, "head_dim": 12,
                  "moe_intermediate_size": 16, "norm_topk_prob": True, "tie_word_embeddings": True},
    "olmoe": {**_BASE, "model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 1.0},
    "deepseek_v3": {**_BASE, "model_type": "deepseek_v3", "num_key_value_heads": 4, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                    "moe_intermediate_size": 16, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 4, "v_head_dim": 8,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                     "mscale": 1.0, "mscale_all_dim": 1.0}},
    "kimi_k2": {**_BASE, "model_type": "kimi_k2", "num_key_value_heads": 4, "n_routed_experts": 8,
                "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "moe_intermediate_size": 16, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4, "v_head_dim": 8, "rope_interleave": False},
    # dense / MoE interleaved, a NoPE layer, chunks of 4 (the 6-token prompt spans two), top-1 input scaling
    "llama4": {**_BASE, "model_type": "llama4_text", "num_local_experts": 4, "num_experts_per_tok": 1,
               "intermediate_size": 16, "intermediate_size_mlp": 40, "head_dim": 8, "interleave_moe_layer_step": 2,
               "no_rope_layers": [1, 0, 1], "attention_chunk_size": 4, "floor_scale": 2, "attn_scale": 0.5},
    # Sinks, biases, a SwiGLU limit that clamps, the default layer_types (sliding, full, sliding) and YaRN.
    "gpt_oss": {**_BASE, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 12,
                "sliding_window": 3, "swiglu_limit": 0.5},
}
PROMPT = [5, 1, 90, 33, 7, 12]


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """A flat HF-named state dict with the shapes `cfg` implies (per-expert tensors, as checkpoints hold them)."""
    rng = np.random.default_rng(seed)

    def rand(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm.weight"):
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    v, h, i = cfg.vocab_size, cfg.hidden_size, cfg.moe_intermediate_size
    state = {"model.embed_tokens.weight": rand("e", (v, h)), "model.norm.weight": rand("norm.weight", (h,))}
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = rand("lm", (v, h))
    for layer in range(cfg.num_layers):
        required, optional = trunk_shapes(cfg, layer)
        for name, shape in required.items():
            state[f"model.layers.{layer}.{name}"] = rand(name, shape)
        if cfg.moe_layers[layer]:
            for e in range(cfg.num_experts):
                p = f"model.layers.{layer}.mlp.experts.{e}."
                state.update({p + "gate_proj.weight": rand("g", (i, h)), p + "up_proj.weight": rand("u", (i, h)),
                              p + "down_proj.weight": rand("d", (h, i))})
                if cfg.expert_bias:
                    state.update({p + "gate_proj.bias": rand("gb", (i,)), p + "up_proj.bias": rand("ub", (i,)),
                                  p + "down_proj.bias": rand("db", (h,))})
    return state


def make(case: str, **changes) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    cfg = ModelConfig.from_hf_config({**CONFIGS[case], **changes})
    return cfg, random_state(cfg)


# ---------------------------------------------------------------- forward pass


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_decode_with_cache_equals_full_forward(case):
    cfg, state = make(case)
    model = Model(cfg, DictWeightProvider(state))
    full = model.prefill(PROMPT)
    assert full.shape == (len(PROMPT), cfg.vocab_size) and full.dtype == np.float32
    steps = [model.prefill(PROMPT[:2])[-1]] + [model.decode(t) for t in PROMPT[2:]]
    np.testing.assert_allclose(np.stack(steps), full[1:], rtol=0, atol=1e-5 * np.abs(full).max())
    last = model.prefill(PROMPT, last_only=True)  # one row: gemv instead of gemm, so not bit-identical
    np.testing.assert_allclose(last, full[-1:], rtol=0, atol=1e-6 * np.abs(full).max())


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_weights_packed_once_give_identical_logits(case):
    # Packed once per shard (kept on the provider's Tensors) or again at every use (plain dicts): the same logits.
    class PlainDicts(DictWeightProvider):
        def layer(self, layer):
            return dict(super().layer(layer))

        def experts(self, layer, expert_ids):
            return {e: dict(t) for e, t in super().experts(layer, expert_ids).items()}

    cfg, state = make(case)
    plain = Model(cfg, PlainDicts(state)).prefill(PROMPT)
    cached = Model(cfg, DictWeightProvider(state))
    cached.prefill(PROMPT)
    provider = cached.provider
    assert provider.layer(0).memo and any(t.memo for e in provider._experts.values() for t in e.values())
    np.testing.assert_array_equal(cached.prefill(PROMPT), plain)


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "float8"])
def test_stored_dtype_equals_float32_of_the_same_values(kind):
    # Products accumulate in float32 whatever the stored dtype: the low-precision provider must give the logits of
    # its values (exactly for f16; bf16's one-row kernel sums even and odd elements apart, and the FP8 product
    # scales each block's partial sum: other roundings of the same sums).
    cfg, state = make("deepseek_v3", quantization_config={"weight_block_size": [8, 8]})
    stored, exact = {}, {}
    for name, a in state.items():
        if kind == "float8" and a.ndim == 2 and name.endswith("proj.weight"):
            q, s = quantize_fp8(a, (8, 8))
            stored[name], stored[name + "_scale_inv"], exact[name] = q, s, dequantize(q, s, (8, 8))
        elif kind != "float8":
            low = a.astype(ml_dtypes.bfloat16 if kind == "bfloat16" else np.float16)
            stored[name], exact[name] = low, low.astype(np.float32)
        else:
            stored[name] = exact[name] = a
    assert sum(a.dtype != np.float32 for a in stored.values()) > 10
    got = Model(cfg, DictWeightProvider(stored)).prefill(PROMPT)
    want = Model(cfg, DictWeightProvider(exact)).prefill(PROMPT)
    if kind == "float8":
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    elif kind == "bfloat16":
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    else:
        np.testing.assert_array_equal(got, want)


def test_fused_state_dict_equals_per_expert_checkpoint():
    cfg, state = make("qwen3_moe")
    fused = {k: v for k, v in state.items() if ".experts." not in k}
    for layer in range(cfg.num_layers):
        if cfg.moe_layers[layer]:
            p = f"model.layers.{layer}.mlp.experts."
            e = range(cfg.num_experts)
            fused[p + "gate_up_proj"] = np.stack([np.concatenate([state[f"{p}{x}.gate_proj.weight"],
                                                                  state[f"{p}{x}.up_proj.weight"]]) for x in e])
            fused[p + "down_proj"] = np.stack([state[f"{p}{x}.down_proj.weight"] for x in e])
    np.testing.assert_array_equal(Model(cfg, DictWeightProvider(fused)).prefill(PROMPT),
                                  Model(cfg, DictWeightProvider(state)).prefill(PROMPT))


def test_mixtral_legacy_names_equal_canonical_names():
    cfg, state = make("mixtral")
    legacy = {}
    for k, v in state.items():
        k = k.replace(".mlp.", ".block_sparse_moe.")
        for new, old in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            k = k.replace(f".{new}.", f".{old}.")
        legacy[k] = v
    np.testing.assert_array_equal(Model(cfg, DictWeightProvider(legacy)).prefill(PROMPT),
                                  Model(cfg, DictWeightProvider(state)).prefill(PROMPT))


class CountingProvider(DictWeightProvider):
    def __init__(self, state):
        super().__init__(state)
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def experts(self, layer, expert_ids):
        self.calls.append((layer, tuple(expert_ids)))
        return super().experts(layer, expert_ids)


def test_experts_are_requested_once_per_layer_and_step_only_if_selected():
    cfg, state = make("deepseek_v3")
    provider = CountingProvider(state)
    model = Model(cfg, provider)
    model.prefill(PROMPT)
    model.decode(3)
    moe = [layer for layer in range(cfg.num_layers) if cfg.moe_layers[layer]]
    assert [layer for layer, _ in provider.calls] == moe * 2
    for _, ids in provider.calls:
        assert len(set(ids)) == len(ids) and all(0 <= e < cfg.num_experts for e in ids)
    assert all(len(ids) == cfg.top_k for _, ids in provider.calls[len(moe):])  # one decode token: top-k experts


# ---------------------------------------------------------------- config validation

BAD_CONFIGS = {
    "not an object": [1, 2],
    "unknown model_type": {**CONFIGS["mixtral"], "model_type": "llama"},
    "missing hidden_size": {k: v for k, v in CONFIGS["mixtral"].items() if k != "hidden_size"},
    "gelu activation": {**CONFIGS["mixtral"], "hidden_act": "gelu"},
    "bool as integer": {**CONFIGS["mixtral"], "num_hidden_layers": True},
    "zero layers": {**CONFIGS["mixtral"], "num_hidden_layers": 0},
    "string as integer": {**CONFIGS["mixtral"], "hidden_size": "32"},
    "heads not a multiple of kv heads": {**CONFIGS["mixtral"], "num_key_value_heads": 3},
    "top-k above expert count": {**CONFIGS["mixtral"], "num_experts_per_tok": 5},
    "negative eps": {**CONFIGS["mixtral"], "rms_norm_eps": -1e-6},
    "eos not an integer": {**CONFIGS["mixtral"], "eos_token_id": "2"},
    "dynamic rope": {**CONFIGS["mixtral"], "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "yarn without factor": {**CONFIGS["mixtral"], "rope_scaling": {"type": "yarn"}},
    "rope factor below 1": {**CONFIGS["mixtral"], "rope_scaling": {"type": "linear", "factor": 0.5}},
    "partial rotary": {**CONFIGS["mixtral"], "partial_rotary_factor": 0.5},
    "rope parameters not an object": {**CONFIGS["mixtral"], "rope_parameters": [1]},
    "mlp_only_layers not a list": {**CONFIGS["qwen2_moe"], "mlp_only_layers": 1},
    "layer_types of wrong length": {**CONFIGS["qwen2_moe"], "use_sliding_window": True,
                                    "layer_types": ["full_attention"]},
    "softmax scoring in deepseek": {**CONFIGS["deepseek_v3"], "scoring_func": "softmax"},
    "groups do not divide experts": {**CONFIGS["deepseek_v3"], "n_group": 3},
    "one expert per group": {**CONFIGS["deepseek_v3"], "n_group": 8, "topk_group": 2},
    "topk_group above n_group": {**CONFIGS["deepseek_v3"], "topk_group": 3},
    "groups cannot supply top-k": {**CONFIGS["deepseek_v3"], "num_experts_per_tok": 5},
    "int4 quantization": {**CONFIGS["deepseek_v3"], "quantization_config": {"quant_method": "compressed-tensors"}},
    "bad fp8 block size": {**CONFIGS["deepseek_v3"], "quantization_config": {"weight_block_size": [128]}},
    "yarn without original length": {**CONFIGS["deepseek_v3"], "max_position_embeddings": 0,
                                     "rope_scaling": {"type": "yarn", "factor": 2.0}},
    # YaRN divides by log(rope_theta) and by its mscale (0.1 * m * ln(factor) + 1): both must stay away from zero
    "rope_theta of 1 under yarn": {**CONFIGS["gpt_oss"], "rope_theta": 1.0},
    "rope_theta below 1": {**CONFIGS["mixtral"], "rope_theta": 1e-300},
    "yarn mscale_all_dim that zeroes its mscale": {
        **CONFIGS["deepseek_v3"], "rope_scaling": {"type": "yarn", "factor": 2.718281828459045,
                                                   "original_max_position_embeddings": 16, "mscale": 1.0,
                                                   "mscale_all_dim": -10.0}},
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_rejected(name, raises_exactly):
    with raises_exactly(CheckpointFormatError):
        ModelConfig.from_hf_config(BAD_CONFIGS[name])


def test_config_fields_follow_transformers_conventions():
    mixtral = ModelConfig.from_hf_config({k: v for k, v in CONFIGS["mixtral"].items()})
    assert mixtral.rope.theta == 1e6 and mixtral.norm_topk_prob and mixtral.sliding_windows == (3, 3, 3)
    qwen2 = ModelConfig.from_hf_config({**CONFIGS["qwen2_moe"], "rope_theta": 5e5})
    assert qwen2.moe_layers == (True, False, True) and qwen2.rope.theta == 5e5 and qwen2.shared_expert == "gated"
    qwen3 = ModelConfig.from_hf_config({**CONFIGS["qwen3_moe"], "num_experts": None, "num_local_experts": 6,
                                        "decoder_sparse_step": 2})
    assert qwen3.num_experts == 6 and qwen3.moe_layers == (False, True, False) and qwen3.head_dim == 12
    kimi = ModelConfig.from_hf_config(CONFIGS["kimi_k2"])
    assert kimi.family == "deepseek_v3" and kimi.mla.q_lora_rank is None and kimi.fp8_block == (128, 128)
    ds = ModelConfig.from_hf_config(CONFIGS["deepseek_v3"])
    mscale = 0.1 * np.log(4.0) + 1
    assert ds.moe_layers == (False, True, True) and ds.rope.kind == "yarn" and ds.rope.dim == 4
    assert ds.attn_scale == pytest.approx(12 ** -0.5 * mscale ** 2)
    assert ds.routed_scaling_factor == 2.5 and ds.norm_topk_prob and ds.rope.interleave
    v5 = ModelConfig.from_hf_config({**CONFIGS["deepseek_v3"], "rope_scaling": None, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 50.0}})
    assert v5.rope.theta == 50.0 and v5.rope.kind == "yarn" and v5.attn_scale == 12 ** -0.5


# ---------------------------------------------------------------- weights


def _drop(state, suffix):
    return {k: v for k, v in state.items() if not k.endswith(suffix)}


def _bad_weights() -> dict:
    cfg, state = make("deepseek_v3")
    fp8 = dict(state)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    fp8[name], fp8[name + "_scale_inv"] = quantize_fp8(state[name])
    return {
        "missing layer tensor": (cfg, _drop(state, "layers.0.self_attn.kv_b_proj.weight")),
        "missing embedding": (cfg, _drop(state, "embed_tokens.weight")),
        "missing lm_head": (cfg, _drop(state, "lm_head.weight")),
        "wrong trunk shape": (cfg, {**state, "model.layers.1.mlp.gate.weight": np.zeros((7, 32), np.float32)}),
        "unexpected trunk tensor": (cfg, {**state, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}),
        "missing expert": (cfg, _drop(state, "layers.2.mlp.experts.3.up_proj.weight")),
        "wrong expert shape": (cfg, {**state, "model.layers.1.mlp.experts.0.down_proj.weight":
                                     np.zeros((32, 15), np.float32)}),
        "fp8 without scale": (cfg, _drop(fp8, "q_b_proj.weight_scale_inv")),
        "fp8 scale of wrong shape": (cfg, {**fp8, name + "_scale_inv": np.ones((2, 2), np.float32)}),
        "integer weights": (cfg, {**state, name: state[name].astype(np.int8)}),
        "missing dense layer": (cfg, {k: v for k, v in state.items() if ".layers.2." not in k}),
    }


@pytest.mark.parametrize("name", sorted(_bad_weights()))
def test_bad_weights_are_rejected(name, raises_exactly):
    cfg, state = _bad_weights()[name]
    model = Model(cfg, DictWeightProvider(state))
    with raises_exactly(CheckpointFormatError):
        model.prefill(list(range(cfg.vocab_size)))  # every token: a missing expert shows only once selected


def test_fused_experts_of_inconsistent_shape_are_rejected(raises_exactly):
    with raises_exactly(CheckpointFormatError):
        DictWeightProvider({"model.layers.0.mlp.experts.gate_up_proj": np.zeros((4, 10, 8), np.float32),
                            "model.layers.0.mlp.experts.down_proj": np.zeros((4, 8, 4), np.float32)})


def test_dequantize_128_blocks_with_ragged_edges():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    q, scale = quantize_fp8(w)
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and scale.shape == (3, 2)
    back = dequantize(q, scale)
    # the block (i // 128, j // 128) scales element (i, j): check one element of each block by hand
    for i, j in [(0, 0), (127, 127), (128, 0), (299, 199), (256, 130)]:
        assert back[i, j] == np.float32(q[i, j].astype(np.float32) * scale[i // 128, j // 128])
    assert np.abs(back - w).max() <= np.abs(w).max() / 8  # e4m3 keeps 3 mantissa bits


def test_to_float32_rejects_fp8_without_scale(raises_exactly):
    with raises_exactly(CheckpointFormatError):
        to_float32(np.zeros(3, ml_dtypes.float8_e4m3fn))


# ---------------------------------------------------------------- cache and API


def test_cache_reports_bytes_and_enforces_its_limit(raises_exactly):
    for case in ("mixtral", "deepseek_v3"):
        cfg, state = make(case)
        model = Model(cfg, DictWeightProvider(state), max_tokens=8)
        assert model.cache.nbytes == 0
        model.prefill(PROMPT)
        # allocated once at max_tokens: never more than the budget reserves for it, never copied to grow
        assert model.cache.nbytes == 8 * bytes_per_token(cfg)
        model.decode(1), model.decode(2)
        with raises_exactly(UsageError):
            model.decode(3)
        assert model.cache.length == 8
    assert bytes_per_token(ModelConfig.from_hf_config(CONFIGS["mixtral"])) == 3 * 2 * 2 * 8 * 4
    assert bytes_per_token(ModelConfig.from_hf_config(CONFIGS["deepseek_v3"])) == 3 * (16 + 4) * 4


def test_cache_grows_past_initial_capacity():
    cfg, state = make("olmoe")
    full = Model(cfg, DictWeightProvider(state)).prefill(PROMPT)
    model = Model(cfg, DictWeightProvider(state))
    model.cache = cache = KVCache(cfg, initial_capacity=2)
    model.prefill(PROMPT[:1])
    steps = [model.decode(t) for t in PROMPT[1:]]
    np.testing.assert_allclose(np.stack(steps), full[1:], atol=1e-5 * np.abs(full).max(), rtol=0)
    assert cache.nbytes == 8 * bytes_per_token(cfg)  # capacity 2 -> 4 -> 8 for 6 tokens


BAD_CALLS = {
    "decode before prefill": lambda m: m.decode(1),
    "token beyond vocabulary": lambda m: m.prefill([1, 97]),
    "negative token": lambda m: m.prefill([-1]),
    "empty prompt": lambda m: m.prefill([]),
    "float tokens": lambda m: m.prefill([1.5]),
    "nested tokens": lambda m: m.prefill([[1, 2]]),
    "negative temperature": lambda m: generate(m, [1], 2, temperature=-1.0),
    "top_p zero": lambda m: generate(m, [1], 2, temperature=1.0, top_p=0.0),
    "negative max_new_tokens": lambda m: generate(m, [1], -1),
    "provider without experts()": lambda m: Model(m.config, object()),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_calls_raise_usage_error(name, raises_exactly):
    cfg, state = make("mixtral")
    with raises_exactly(UsageError):
        BAD_CALLS[name](Model(cfg, DictWeightProvider(state)))


class FailingProvider(DictWeightProvider):
    fail: str | None = None  # "layer": layer 2's trunk is unavailable; "expert": layer 2's first chosen expert is

    def layer(self, layer):
        if self.fail == "layer" and layer == 2:
            raise CheckpointFormatError("layer 2 unavailable")
        return super().layer(layer)

    def experts(self, layer, expert_ids):
        got = super().experts(layer, expert_ids)
        if self.fail != "expert" or layer != 2:
            return got
        bad = expert_ids[0]

        class Failing(dict):
            def __getitem__(self, e):
                if e == bad:
                    raise CheckpointFormatError(f"layer 2 expert {e} unavailable")
                return super().__getitem__(e)
        return Failing(got)


# window 3: the decode step is the general path's (the row outgrew it); None: one sequence's decode row
@pytest.mark.parametrize("window", [3, None])
@pytest.mark.parametrize("fail", ["layer", "expert"])
def test_failed_step_leaves_cache_unchanged(window, fail):
    cfg, state = make("mixtral", sliding_window=window)
    provider = FailingProvider(state)
    model = Model(cfg, provider)
    model.prefill(PROMPT)
    before = model.decode(4)
    model.prefill(PROMPT)
    provider.fail = fail
    with pytest.raises(CheckpointFormatError):
        model.decode(4)  # layers 0 and 1 wrote their entries, then layer 2 failed
    assert model.cache.length == len(PROMPT)
    provider.fail = None
    np.testing.assert_array_equal(model.decode(4), before)


# ---------------------------------------------------------------- sampling


def test_greedy_is_argmax_and_generate_is_decode_loop():
    cfg, state = make("qwen2_moe")
    model = Model(cfg, DictWeightProvider(state))
    tokens = generate(model, PROMPT, 5)
    ids = list(PROMPT)
    for t in tokens:
        assert t == int(np.argmax(Model(cfg, DictWeightProvider(state)).prefill(ids)[-1]))
        ids.append(t)


def test_generation_stops_at_stop_ids():
    cfg, state = make("qwen2_moe")
    model = Model(cfg, DictWeightProvider(state))
    tokens = generate(model, PROMPT, 5)
    assert generate(model, PROMPT, 5, stop_ids=[tokens[1]]) == tokens[:2]
    stopping = ModelConfig.from_hf_config({**CONFIGS["qwen2_moe"], "eos_token_id": [tokens[0]]})
    assert generate(Model(stopping, DictWeightProvider(state)), PROMPT, 5) == tokens[:1]
    assert list(stream(model, PROMPT, 0)) == []


def test_sampling_is_reproducible_and_respects_top_p():
    cfg, state = make("olmoe")
    model = Model(cfg, DictWeightProvider(state))
    a = generate(model, PROMPT, 6, temperature=1.5, seed=7)
    assert a == generate(model, PROMPT, 6, temperature=1.5, seed=7)
    assert a != generate(model, PROMPT, 6, temperature=1.5, seed=8)  # 97-token vocabulary, near-flat logits
    assert generate(model, PROMPT, 6, temperature=1.5, top_p=1e-6, seed=8) == generate(model, PROMPT, 6)
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    rng = np.random.default_rng(0)
    picks = {sample_token(logits, temperature=1.0, top_p=0.75, rng=rng) for _ in range(300)}
    assert picks == {0, 1}  # 0.5 + 0.3 reaches 0.75: the nucleus is the top two


def test_sampling_without_generator_is_refused(raises_exactly):
    with raises_exactly(UsageError):
        sample_token(np.zeros(4, np.float32), temperature=1.0)


def test_config_is_frozen():
    cfg = ModelConfig.from_hf_config(CONFIGS["mixtral"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 3  # type: ignore[misc]
