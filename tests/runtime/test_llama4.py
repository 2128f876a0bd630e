"""Llama 4 in the numpy forward pass without torch: the router that scales each expert's input, chunked masks,
NoPE temperature, config.json validation (units), and a malformed signed config refused by verify-and-run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardtool.errors import CheckpointFormatError
from shardtool.runtime.model import DictWeightProvider, Model, ModelConfig, expert_mlp, moe_layer
from shardtool.runtime.model._llama4 import chunked_mask, nope_temperature, route

from _decode import generate
from _kit.cli import run as _cli

# 4 layers: dense / MoE interleaved, layer 1 and 3 NoPE, chunks of 4, temperature from position 1 on.
CONFIG = {"model_type": "llama4_text", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16,
          "intermediate_size_mlp": 40, "num_local_experts": 4, "num_experts_per_tok": 2,
          "interleave_moe_layer_step": 2, "no_rope_layers": [1, 0, 1, 0], "attention_chunk_size": 4,
          "floor_scale": 2, "attn_scale": 0.5, "max_position_embeddings": 64}


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# ---------------------------------------------------------------- the router


def test_route_picks_top_logits_and_weighs_by_their_sigmoid():
    logits = np.array([[0.5, 3.0, -1.0, 2.0], [-2.0, -3.0, -0.5, -4.0]], np.float32)
    weights, idx, scores = route(logits, 2)
    order = np.argsort(idx, axis=1)
    assert np.take_along_axis(idx, order, 1).tolist() == [[1, 3], [0, 2]]
    np.testing.assert_allclose(np.take_along_axis(weights, order, 1), sigmoid(np.array([[3.0, 2.0], [-2.0, -0.5]])),
                               rtol=1e-6)
    assert scores is logits  # top-k ran on the raw logits: receipts record their gaps


def test_moe_layer_scales_each_experts_input_not_its_output():
    cfg = ModelConfig.from_hf_config(CONFIG)
    rng = np.random.default_rng(1)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    experts = {e: (rng.standard_normal((i, h)).astype(np.float32), rng.standard_normal((i, h)).astype(np.float32),
                   rng.standard_normal((h, i)).astype(np.float32) * 0.3) for e in range(cfg.num_experts)}
    w = {"mlp.gate.weight": rng.standard_normal((cfg.num_experts, h)).astype(np.float32),
         **{f"mlp.shared_expert.{n}.weight": rng.standard_normal(s).astype(np.float32) * 0.3
            for n, s in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))}}
    x = rng.standard_normal((5, h)).astype(np.float32)

    def fetch(x_in, rows):
        return {e: (lambda e=e, r=r: expert_mlp(x_in[r], *experts[e])) for e, r in rows.items()}

    got = moe_layer(x, w, cfg, fetch)
    logits = x @ w["mlp.gate.weight"].T
    want, as_output = [], []
    for t in range(len(x)):
        shared = expert_mlp(x[t:t + 1], w["mlp.shared_expert.gate_proj.weight"], w["mlp.shared_expert.up_proj.weight"],
                            w["mlp.shared_expert.down_proj.weight"])[0]
        top = np.argsort(-logits[t])[:2]
        want.append(shared + sum(expert_mlp(x[t:t + 1] * sigmoid(logits[t, e]), *experts[e])[0] for e in top))
        as_output.append(shared + sum(sigmoid(logits[t, e]) * expert_mlp(x[t:t + 1], *experts[e])[0] for e in top))
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)
    assert np.abs(got - np.array(as_output)).max() > 1e-2  # the two readings really differ on this input


# ---------------------------------------------------------------- attention


def test_chunked_mask_sees_only_earlier_keys_of_the_same_chunk():
    mask = chunked_mask(np.arange(6), 6, 3)
    want = np.array([[j <= i and j // 3 == i // 3 for j in range(6)] for i in range(6)])
    assert (mask == want).all()
    assert chunked_mask(np.array([2]), 3, 3) is None  # one query, all keys in its chunk
    assert chunked_mask(np.array([3]), 4, 3).tolist() == [[False, False, False, True]]


def test_nope_temperature_follows_floor_scale():
    cfg = ModelConfig.from_hf_config(CONFIG).chunked_nope
    q = np.ones((4, 1, 2), np.float32)
    scales = nope_temperature(q, 3, cfg)[:, 0, 0]  # positions 3..6, floor((p + 1) / 2) = 2, 2, 3, 3
    np.testing.assert_allclose(scales, 1 + 0.5 * np.log1p([2, 2, 3, 3]), rtol=1e-6)
    off = ModelConfig.from_hf_config({**CONFIG, "attn_temperature_tuning": False}).chunked_nope
    assert (nope_temperature(q, 3, off) == q).all()


def test_decode_with_cache_crosses_chunks_as_the_full_forward_does():
    cfg = ModelConfig.from_hf_config(CONFIG)
    from test_model_numpy import random_state

    model = Model(cfg, DictWeightProvider(random_state(cfg)))
    prompt = [5, 1, 90, 33, 7, 12, 40, 2, 8, 61]  # chunks [0, 4), [4, 8), [8, 10)
    full = model.prefill(prompt)
    steps = [model.prefill(prompt[:3])[-1]] + [model.decode(t) for t in prompt[3:]]
    np.testing.assert_allclose(np.stack(steps), full[2:], rtol=1e-5, atol=1e-5)
    assert len(generate(model, prompt, 4)) == 4


# ---------------------------------------------------------------- config.json


def test_config_follows_transformers_defaults():
    cfg = ModelConfig.from_hf_config(CONFIG)
    assert cfg.rope_layers == (True, False, True, False) and cfg.attention_chunks == (4, None, 4, None)
    assert cfg.moe_layers == (False, True, False, True) and cfg.intermediate_size == 40
    assert cfg.shared_expert == "one" and cfg.shared_intermediate_size == 16 and cfg.rope.interleave
    assert cfg.rope.theta == 5e5 and cfg.chunked_nope.use_qk_norm
    # no_rope_layers absent or empty: a NoPE layer every no_rope_layer_interval (4) layers; 8192-token chunks.
    bare = {k: v for k, v in CONFIG.items() if k not in ("no_rope_layers", "attention_chunk_size")}
    for c in (ModelConfig.from_hf_config({**bare, "num_hidden_layers": 8}),
              ModelConfig.from_hf_config({**bare, "num_hidden_layers": 8, "no_rope_layers": []})):
        assert c.rope_layers == (True, True, True, False) * 2
        assert c.attention_chunks == (8192, 8192, 8192, None) * 2
    # an explicit null chunk size: no chunked layers at all
    assert ModelConfig.from_hf_config({**CONFIG, "attention_chunk_size": None}).attention_chunks == (None,) * 4
    listed = ModelConfig.from_hf_config({**CONFIG, "layer_types": ["full_attention"] * 3 + ["chunked_attention"]})
    assert listed.attention_chunks == (None, None, None, 4)


def test_multimodal_config_runs_its_text_config():
    wrapped = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": CONFIG,
               "vision_config": {"hidden_size": 8}}
    assert ModelConfig.from_hf_config(wrapped) == ModelConfig.from_hf_config({**CONFIG, "model_type": "llama4"})


BAD = {
    "no_rope_layers shorter than the model": {"no_rope_layers": [1, 0, 1]},
    "no_rope_layers longer than the model": {"no_rope_layers": [1, 0, 1, 0, 1]},
    "no_rope_layers entry other than 0/1": {"no_rope_layers": [1, 2, 1, 0]},
    "no_rope_layers entry a bool": {"no_rope_layers": [1, True, 1, 0]},
    "no_rope_layers not a list": {"no_rope_layers": 1},
    "zero NoPE interval": {"no_rope_layers": None, "no_rope_layer_interval": 0},
    "zero attention chunk": {"attention_chunk_size": 0},
    "attention chunk above its cap": {"attention_chunk_size": 1 << 30},
    "attention chunk a string": {"attention_chunk_size": "8192"},
    "unknown layer type": {"layer_types": ["sliding_attention"] * 4},
    "layer_types of the wrong length": {"layer_types": ["full_attention"] * 3},
    "chunked layer without a chunk size": {"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4},
    "zero floor_scale": {"floor_scale": 0},
    "attn_scale a string": {"attn_scale": "0.1"},
    "attn_scale not finite": {"attn_scale": float("inf")},
    "use_qk_norm not a bool": {"use_qk_norm": 1},
    "temperature tuning not a bool": {"attn_temperature_tuning": "yes"},
    "moe_layers beyond the model": {"moe_layers": [1, 7]},
    "zero interleave step": {"interleave_moe_layer_step": 0},
    "llama3 rope high below low": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                       "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                                       "original_max_position_embeddings": 16}},
    "llama3 rope without low_freq_factor": {"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                                "high_freq_factor": 4.0}},
    "text_config not an object": {"model_type": "llama4", "text_config": [1]},
    "text_config of another family": {"model_type": "llama4", "text_config": {**CONFIG, "model_type": "mixtral"}},
    "text_config lacking the model": {"model_type": "llama4", "text_config": {"model_type": "llama4_text"}},
    "gelu activation": {"hidden_act": "gelu"},
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_config_is_one_clear_error(name, raises_exactly):
    with raises_exactly(CheckpointFormatError) as info:
        ModelConfig.from_hf_config({**CONFIG, **BAD[name]})
    assert "config.json" in str(info.value)


def test_verify_and_run_refuses_a_signed_config_with_bad_no_rope_layers(tmp_path):
    """The publisher signed a config.json whose no_rope_layers does not match its layers: exit 1, one line
    naming the field, nothing printed on stdout."""
    from examples.make_tiny_moe import make_checkpoint

    ck = make_checkpoint(tmp_path / "ck", "llama4", layers=2, dense_layers=1, dtype="f32")
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "no_rope_layers": [1, 0, 1]}))
    for program, *args in (("shardtool", "keygen", "--out", "k", "--no-passphrase"),
                           ("shardtool", "split", "-q", ck, tmp_path / "model"),
                           ("shardtool", "sign", tmp_path / "model", "--key", tmp_path / "k.key")):
        done = _cli(program, *args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    r = _cli("verify-and-run", tmp_path / "model", "--trust", tmp_path / "k.pub", "--prompt-ids", "3,4,5",
             "--max-new-tokens", 2, "--state-dir", tmp_path / "state", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and r.stdout == "" and len(lines) == 1, r.stderr
    assert "no_rope_layers lists 3 layers, expected num_hidden_layers 2" in lines[0]
