"""The memory budget's parts, one at a time: config caps, O(weight) FP8 dequantisation, the activation
estimate and chunked prefill, the plan's refusal of sequences it cannot hold, and the option parsers.
(The same through the real CLI, with peak RSS measured: tests/attacks/test_attack_budget.py.)"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.cli._common import MAX_MEMORY_BUDGET, parse_size
from shardtool.cli.run_cmd import MAX_PROMPT_IDS, MAX_TOKEN_ID, parse_ids
from shardtool.errors import CheckpointFormatError, UsageError
from shardtool.blockquant import quantize_fp8
from shardtool.runtime.model import DictWeightProvider, Model, ModelConfig, dequantize
from shardtool.runtime.model._activations import prefill_chunk, step_bytes
from shardtool.hf_config import FLOAT_CAPS, INT_CAPS
from shardtool.runtime.engine._sampling import sample_token

from _decode import generate
from test_model_numpy import CONFIGS, make

# ---------------------------------------------------------------- config caps

# (family, field path, value above its cap): every number a signed config.json may set, one case each.
_DS, _QW2, _MX = "deepseek_v3", "qwen2_moe", "mixtral"
ABOVE_CAP = [
    (_MX, "hidden_size"), (_MX, "intermediate_size"), (_QW2, "moe_intermediate_size"),
    (_QW2, "shared_expert_intermediate_size"), (_MX, "vocab_size"), (_MX, "num_hidden_layers"),
    (_MX, "num_attention_heads"), (_MX, "num_key_value_heads"), (_MX, "head_dim"), (_MX, "num_local_experts"),
    (_QW2, "num_experts"), (_DS, "n_routed_experts"), (_MX, "num_experts_per_tok"), (_DS, "n_group"),
    (_DS, "topk_group"), (_DS, "n_shared_experts"), (_DS, "first_k_dense_replace"), (_QW2, "decoder_sparse_step"),
    (_MX, "sliding_window"), (_MX, "max_position_embeddings"), (_MX, "bos_token_id"), (_MX, "eos_token_id"),
    (_DS, "q_lora_rank"), (_DS, "kv_lora_rank"), (_DS, "qk_nope_head_dim"), (_DS, "qk_rope_head_dim"),
    (_DS, "v_head_dim"), (_MX, "rope_theta"), (_MX, "rms_norm_eps"), (_DS, "routed_scaling_factor"),
    ("olmoe", "clip_qkv"), ("llama4", "intermediate_size_mlp"), ("llama4", "attention_chunk_size"),
    ("llama4", "floor_scale"), ("llama4", "attn_scale"),
]
NESTED = {  # family, field as named in the message, the config change
    "quantization_config.weight_block_size[0]": (_DS, lambda cap: {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [cap + 1, 128]}}),
    "quantization_config.weight_block_size[1]": (_DS, lambda cap: {"quantization_config": {
        "weight_block_size": [128, cap + 1]}}),
    "rope_scaling.factor": (_DS, lambda cap: {"rope_scaling": {"type": "yarn", "factor": cap * 2,
                                                                "original_max_position_embeddings": 16}}),
    "rope_scaling.original_max_position_embeddings": (_DS, lambda cap: {"rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": cap + 1}}),
    "rope_parameters.beta_fast": (_DS, lambda cap: {"rope_scaling": None, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": cap * 2}}),
    "rope_scaling.mscale": (_DS, lambda cap: {"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": -cap * 2,
                                                                "original_max_position_embeddings": 16}}),
    "eos_token_id[1]": (_MX, lambda cap: {"eos_token_id": [1, cap + 1]}),
    "mlp_only_layers[0]": (_QW2, lambda cap: {"mlp_only_layers": [cap + 1]}),
    "max_window_layers": (_QW2, lambda cap: {"use_sliding_window": True, "max_window_layers": cap + 1}),
    "no_rope_layers[1]": ("llama4", lambda cap: {"no_rope_layers": [1, cap + 1, 1]}),
    "no_rope_layer_interval": ("llama4", lambda cap: {"no_rope_layers": None, "no_rope_layer_interval": cap + 1}),
    "rope_parameters.low_freq_factor": ("llama4", lambda cap: {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": cap * 2, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
}


def _cap(field: str):
    key = field.split(".")[-1].split("[")[0]
    return INT_CAPS[key] if key in INT_CAPS else FLOAT_CAPS[key]


def _refusal(config: dict) -> str:
    with pytest.raises(CheckpointFormatError) as info:
        ModelConfig.from_hf_config(config)
    return str(info.value)


@pytest.mark.parametrize("family,field", ABOVE_CAP, ids=[f for _, f in ABOVE_CAP])
def test_config_field_above_its_cap_is_refused_naming_field_cap_and_value(family, field):
    cap = _cap(field)
    value = cap + 1 if isinstance(cap, int) else cap * 2
    message = _refusal({**CONFIGS[family], field: value})
    assert message.startswith(f"config.json: {field} is {value!r}"), message
    assert f"cap of {cap:g}" in message if isinstance(cap, float) else f"cap of {cap}" in message


@pytest.mark.parametrize("field", sorted(NESTED))
def test_nested_config_field_above_its_cap_is_refused(field):
    family, change = NESTED[field]
    cap = _cap(field)
    message = _refusal({**CONFIGS[family], **change(cap)})
    assert f"config.json: {field} is " in message and "cap of" in message, message


def test_config_at_its_caps_parses_and_derived_head_dim_is_capped():
    # Exactly at the caps is accepted (no allocation happens while parsing).
    at = {**CONFIGS["mixtral"], "hidden_size": INT_CAPS["hidden_size"], "num_attention_heads": 16,
          "num_key_value_heads": 16, "vocab_size": INT_CAPS["vocab_size"],
          "max_position_embeddings": INT_CAPS["max_position_embeddings"]}
    cfg = ModelConfig.from_hf_config(at)
    assert cfg.hidden_size == INT_CAPS["hidden_size"] and cfg.head_dim == INT_CAPS["hidden_size"] // 16
    message = _refusal({**at, "num_attention_heads": 1, "num_key_value_heads": 1})
    assert "head_dim (hidden_size / num_attention_heads) is 65536, above the cap of 4096" in message


def test_every_integer_field_the_parser_reads_has_a_cap():
    # ConfigReader.int looks the cap up by name: parsing every family's config exercises every field it reads.
    for config in CONFIGS.values():
        ModelConfig.from_hf_config(config)
    assert all(isinstance(v, int) and v > 0 for v in INT_CAPS.values())


def _verified(root, kinds: dict[str, str]):
    """A VerifiedManifest over files already in `root` ({path: kind}); the tests need only its entries."""
    import blake3

    from shardtool.manifest._document import VerifiedManifest
    from shardtool.manifest._records import Entry

    entries = [Entry(path=rel, kind=kind, size=(root / rel).stat().st_size,
                     digest=blake3.blake3((root / rel).read_bytes()).digest(), layer=0 if kind != "other" else None,
                     expert=0 if kind == "expert" else None) for rel, kind in sorted(kinds.items())]
    return VerifiedManifest(head=None, entries=tuple(entries), signers=())


def test_signed_config_json_with_a_huge_integer_or_deep_nesting_is_a_verification_error(tmp_path):
    # Python's json refuses a > 4300-digit integer with ValueError and deep nesting with RecursionError:
    # both are the signed file's fault, so a clean VerificationError, never a traceback.
    from shardtool.errors import VerificationError
    from shardtool.runtime.engine._signed import signed_json

    for text in ('{"a": 1' + "0" * 5000 + "}", "[" * 100_000 + "]" * 100_000):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(VerificationError, match="signed config.json is not valid JSON"):
            signed_json(tmp_path, _verified(tmp_path, {"config.json": "other"}), "config.json")


# ---------------------------------------------------------------- FP8 dequantisation is O(weight)


def _peak_bytes(fn, *args) -> tuple[object, int]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn(*args)
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape,block", [((32, 48), (8192, 8192)), ((300, 200), (128, 128)), ((7, 5), (3, 2)),
                                         ((256, 128), (128, 128)), ((64, 64), (1, 1)), ((9, 300), (4, 1 << 18))])
def test_dequantize_equals_the_block_formula_in_weight_sized_memory(shape, block):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32)
    q, scale = _peak_bytes(quantize_fp8, w, block)[0]
    got, peak = _peak_bytes(dequantize, q, scale, block)
    rows, cols = np.arange(shape[0]) // block[0], np.arange(shape[1]) // block[1]
    want = q.astype(np.float32) * scale[rows][:, cols]  # w[i, j] * scale_inv[i // b0, j // b1]
    np.testing.assert_array_equal(got, want)
    # The result, the column-spread scales (no more elements than the weight) and index vectors: never b0*b1
    # floats per block (the old full-block expansion took 256 MiB for the 32x48 weight in 8192x8192 blocks).
    assert peak <= 3 * w.nbytes + 16 * sum(shape) + 4096, (peak, w.nbytes)


# ---------------------------------------------------------------- activations and chunked prefill


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_step_bytes_bounds_the_measured_peak_of_a_forward_step(case):
    # Wider than the tiny configs so that activations, not Python objects, dominate what is measured.
    wide = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 300, "num_attention_heads": 8,
            "num_key_value_heads": 8 if case in ("deepseek_v3", "kimi_k2") else 2}
    for changes in ({}, wide):
        cfg, state = make(case, **changes, max_position_embeddings=512)
        model = Model(cfg, DictWeightProvider(state), max_tokens=200)
        ids = [int(i) for i in np.random.default_rng(0).integers(0, cfg.vocab_size, 200)]
        model.prefill(ids[:4])  # the packed weights and the KV buffers exist before measuring
        for chunk in (200, 48, 7):
            _, peak = _peak_bytes(lambda: model.prefill(ids, last_only=True, chunk=chunk))
            assert peak <= step_bytes(cfg, chunk, len(ids)), (case, changes, chunk, peak)
        model.prefill(ids[:-1])
        _, peak = _peak_bytes(lambda: model.decode(ids[-1]))  # one query over the whole sequence
        assert peak <= step_bytes(cfg, 1, len(ids)), (case, changes, "decode", peak)


def test_prefill_chunk_fits_the_reserve_and_is_at_least_one():
    cfg = ModelConfig.from_hf_config(CONFIGS["mixtral"])
    for tokens in (1, 10, 3000, 100_000):
        for reserve in (step_bytes(cfg, 1, tokens), 32 << 20, 1 << 30):
            chunk = prefill_chunk(cfg, reserve, tokens)
            assert 1 <= chunk <= tokens
            assert chunk == 1 or step_bytes(cfg, chunk, tokens) <= reserve
            assert chunk == tokens or step_bytes(cfg, chunk + 1, tokens) > reserve  # the largest that fits


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_chunked_prefill_gives_the_unchunked_logits_and_greedy_tokens(case):
    cfg, state = make(case, max_position_embeddings=512)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, cfg.vocab_size, 50)]
    whole = Model(cfg, DictWeightProvider(state)).prefill(ids)
    for chunk in (1, 3, 16, 49):
        model = Model(cfg, DictWeightProvider(state))
        got = model.prefill(ids, chunk=chunk)
        assert got.shape == whole.shape
        np.testing.assert_allclose(got, whole, rtol=0, atol=2e-5 * np.abs(whole).max())
        assert (got.argmax(-1) == whole.argmax(-1)).all()
    unchunked = generate(Model(cfg, DictWeightProvider(state)), ids, 8)
    reserve = step_bytes(cfg, 4, len(ids) + 8)  # room for 4 query tokens per step: 13 prefill steps
    assert prefill_chunk(cfg, reserve, len(ids)) == 4
    chunked = generate(Model(cfg, DictWeightProvider(state), activation_reserve=reserve), ids, 8)
    assert chunked == unchunked


def test_kv_cache_never_exceeds_max_tokens():
    cfg, state = make("olmoe")
    model = Model(cfg, DictWeightProvider(state), max_tokens=9)
    model.prefill([1, 2, 3, 4, 5])
    for t in (6, 7, 8, 9):
        model.decode(t)
    from shardtool.runtime.model import bytes_per_token

    assert model.cache.nbytes == 9 * bytes_per_token(cfg)


# ---------------------------------------------------------------- the plan refuses what it cannot hold


def _signed_model(tmp_path, config: dict):
    """A verified manifest over config.json, one expert and one trunk file of fixed sizes."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    kinds = {"experts/layer-000/expert-0000.safetensors": "expert", "trunk/layer-000.safetensors": "trunk"}
    for rel, size in zip(kinds, (4000, 8000)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"\0" * size)
    return _verified(tmp_path, {"config.json": "other", **kinds})


def test_plan_refuses_a_sequence_the_budget_cannot_hold_naming_the_budget_needed(tmp_path):
    from shardtool.runtime.engine._plan import plan_budget

    cfg = ModelConfig.from_hf_config(CONFIGS["mixtral"])
    manifest = _signed_model(tmp_path, CONFIGS["mixtral"])
    with pytest.raises(UsageError) as info:
        plan_budget(40 << 20, cfg, manifest, 100_000, 2)
    message = str(info.value)
    assert "cannot run 100000 tokens (prompt + --max-new-tokens)" in message
    need = int(message.rsplit("at least ", 1)[1].split("MiB")[0])
    plan = plan_budget(need << 20, cfg, manifest, 100_000, 2)  # the budget it names is enough
    assert plan.kv_cache == 100_000 * 384 and plan.activations >= step_bytes(cfg, 1, 100_000)
    with pytest.raises(UsageError):
        plan_budget((need - 1) << 20, cfg, manifest, 100_000, 2)


# ---------------------------------------------------------------- sampling and option parsers


def test_sampling_at_a_tiny_temperature_is_greedy_not_a_crash():
    logits = np.array([0.5, 3.0, -1.0, 2.999], np.float32)
    rng = np.random.default_rng(0)
    assert all(sample_token(logits, temperature=t, rng=rng) == 1 for t in (1e-320, 1e-30, 1e-6))
    with pytest.raises(UsageError):
        sample_token(np.array([0.0, np.nan], np.float32), temperature=1.0, rng=rng)


@pytest.mark.parametrize("text,value", [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29),
                                        ("1000000", 10**6), (" 64 mib ", 64 << 20), ("1024TiB", 2**50),
                                        ("2MB", 2 * 10**6)])
def test_parse_size_accepts(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["9" * 400, "0", "0.1", "1025TiB", "1PiB", "1e3", "-1", "", "GiB", "inf", "nan",
                                  "\u0661\u0660MiB", "1K\u0130B", "1.5.5G", "1" * 31])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError, match="--memory-budget"):
        parse_size(text)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=60) | st.from_regex(r"\s*[0-9]{1,25}(\.[0-9]{0,8})?\s*([kKmMgGtT]i?[bB]?)?\s*", fullmatch=True))
def test_fuzz_parse_size_gives_a_capped_value_or_a_usage_error(text):
    try:
        value = parse_size(text)
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(value, int) and 1 <= value <= MAX_MEMORY_BUDGET


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=80) | st.lists(st.integers(-5, 2**40), max_size=20).map(lambda xs: ",".join(map(str, xs))))
def test_fuzz_parse_ids_gives_capped_ids_or_a_usage_error(text):
    try:
        ids = parse_ids(text)
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert 1 <= len(ids) <= MAX_PROMPT_IDS and all(isinstance(i, int) and 0 <= i <= MAX_TOKEN_ID for i in ids)


def test_parse_ids_caps():
    assert parse_ids("1, 2,3,") == [1, 2, 3]
    for bad in ("", ",", "1,-1", "1,x", "\u0661", str(MAX_TOKEN_ID + 1), "9" * 5000, "1," * (MAX_PROMPT_IDS + 1)):
        with pytest.raises(UsageError, match="--prompt-ids"):
            parse_ids(bad)


# The f32 Mixtral layout serve is benchmarked on (benchmarks/bench_serve.py CACHED_MODEL): hidden 512, 4 layers of 8
# experts, top-2; its chat prompt is 67 tokens with the template, 160 tokens of context per sequence.
SERVED = {"model_type": "mixtral", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
          "num_key_value_heads": 4, "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
          "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6}


@pytest.mark.parametrize("prompts, steps", [(1, 1), (5, 1), (16, 3)])
def test_the_least_activation_reserve_prefills_the_served_chat_prompts_in_few_steps(prompts, steps):
    """A prompt is not cut into small chunks by the activation reserve: at the plan's floor (what a 4 GiB serve of
    this model reserves), a step of new prompts (over 67 keys, as `Engine._plan_rows` sizes it) takes enough rows to
    prefill `prompts` 67-token prompts in `steps` steps."""
    from shardtool.runtime.engine._plan import MIN_ACTIVATION_RESERVE
    from shardtool.runtime.model._activations import step_rows

    cfg = ModelConfig.from_hf_config(SERVED)
    rows = step_rows(cfg, MIN_ACTIVATION_RESERVE, 67)
    assert -(-prompts * 67 // rows) <= steps, rows
