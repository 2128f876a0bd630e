"""gpt-oss's own numerics against hand-computed values (MXFP4 decoding, the clamped SwiGLU, attention sinks,
top-k-then-softmax routing), its config defaults, and every malformed config or shard refused with one line
naming what was expected: in units, and through the installed verify-and-run (exit 1, no traceback)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from shardtool.errors import CheckpointFormatError
from shardtool.runtime.model import ModelConfig
from shardtool.runtime.model._dtypes import FP4_E2M1, mxfp4_to_float32, quantize_mxfp4
from shardtool.runtime.model._gpt_oss import clamped_swiglu, expert_weights, route_topk_softmax, sink_softmax
from shardtool.runtime.model._packed import to_float32
from shardtool.runtime.model._layers import attention

from _republish import republish
from examples import make_tiny_moe as mtm
from _kit.cli import run as _cli

BASE = {"model_type": "gpt_oss", "vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2}

# ---------------------------------------------------------------- MXFP4


def test_mxfp4_decodes_low_nibble_first_times_two_to_the_scale_minus_127():
    blocks = np.zeros((2, 1, 16), np.uint8)
    # 0x21: codes 1 (+0.5) then 2 (+1.0); 0xF8: 8 (-0.0) then 15 (-6); 0x07: 7 (+6) then 0; 0x9E: 14 (-4) then 9 (-0.5)
    blocks[0, 0, :4] = [0x21, 0xF8, 0x07, 0x9E]
    blocks[1, 0, 0] = 0x7F  # 15 (-6) then 7 (+6)
    scales = np.array([[128], [125]], np.uint8)  # 2^1 and 2^-2
    got = mxfp4_to_float32(blocks, scales)
    assert got.shape == (2, 32) and got.dtype == np.float32
    want0 = np.zeros(32, np.float32)
    want0[:8] = [1.0, 2.0, -0.0, -12.0, 12.0, 0.0, -8.0, -1.0]
    want1 = np.zeros(32, np.float32)
    want1[:2] = [-1.5, 1.5]
    np.testing.assert_array_equal(got[0], want0)
    np.testing.assert_array_equal(got[1], want1)
    assert np.signbit(got[0, 2])  # code 8 is -0.0


def test_mxfp4_extreme_scales_are_exact_powers_of_two():
    blocks = np.full((2, 1, 16), 0x11, np.uint8)  # every element +0.5
    got = mxfp4_to_float32(blocks, np.array([[0], [254]], np.uint8))
    assert got[0, 0] == np.float32(2.0 ** -128) > 0  # subnormal, still exact
    assert got[1, 0] == np.float32(2.0 ** 126) and np.isfinite(got).all()


def test_quantize_mxfp4_round_trips_representable_weights():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (8, 64))
    exps = rng.integers(-6, 4, (8, 2))
    w = FP4_E2M1[codes] * np.exp2(np.repeat(exps, 32, axis=1)).astype(np.float32)
    w[:, ::32] = 6.0 * np.exp2(np.repeat(exps, 1, axis=1))  # each group's absmax is 6 * 2^e: the scale is e
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (8, 2, 16) and scales.shape == (8, 2)
    np.testing.assert_array_equal(mxfp4_to_float32(blocks, scales), w)


def test_mxfp4_decoding_memory_is_the_result_plus_a_bounded_index():
    import tracemalloc

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (1024, 32, 16), dtype=np.uint8)  # 512 KiB: eight look-ups of 64 KiB
    scales = rng.integers(100, 140, (1024, 32), dtype=np.uint8)
    mxfp4_to_float32(blocks[:1, :1], scales[:1, :1])  # the look-up table exists before measuring
    tracemalloc.start()
    try:
        got = mxfp4_to_float32(blocks, scales)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.nbytes == 1024 * 1024 * 4
    # + one chunk's int64 indices and numpy's buffer for the look-up: 2 MiB at most, whatever the size
    assert peak <= got.nbytes + 4 * 8 * (1 << 16), peak


@pytest.mark.parametrize("blocks,scales,message", [
    (np.zeros((2, 1, 16), np.int8), np.zeros((2, 1), np.uint8), "must be U8"),
    (np.zeros((2, 1, 16), np.uint8), np.zeros((2, 1), np.float32), "must be U8"),
    (np.zeros((2, 1, 8), np.uint8), np.zeros((2, 1), np.uint8), "do not match"),
    (np.zeros((2, 2, 16), np.uint8), np.zeros((2, 1), np.uint8), "do not match"),
    (np.zeros((2, 16), np.uint8), np.zeros((2,), np.uint8), "do not match"),
    (np.zeros((2, 1, 16), np.uint8), np.array([[127], [255]], np.uint8), "0xFF"),
], ids=["blocks-int8", "scales-float", "half-blocks", "scales-short", "blocks-2d", "nan-scale"])
def test_malformed_mxfp4_is_refused(blocks, scales, message, raises_exactly):
    with raises_exactly(CheckpointFormatError, match=message):
        mxfp4_to_float32(blocks, scales, "w")

# ---------------------------------------------------------------- clamped SwiGLU, sinks, routing


def test_clamped_swiglu_against_hand_computed_values():
    gate = np.array([[10.0, -1.0, 0.5, -30.0]], np.float32)
    up = np.array([[-10.0, 2.0, 8.0, 0.0]], np.float32)
    alpha, limit = 1.702, 7.0

    def one(g, u):
        g, u = min(g, limit), max(-limit, min(u, limit))  # gate clamped above only, up both sides
        return (u + 1) * g / (1 + math.exp(-alpha * g))

    want = [one(g, u) for g, u in zip(gate[0], up[0])]
    got = clamped_swiglu(gate, up, alpha, limit)
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-30)
    assert got[0, 0] == pytest.approx(-6 * 7 / (1 + math.exp(-1.702 * 7)), rel=1e-6)  # both clamps bite


def test_sink_takes_its_share_of_the_softmax_and_masked_keys_none():
    scores = np.array([1.0, 2.0, -np.inf], np.float32).reshape(1, 1, 1, 3)  # the third key is masked
    sinks = np.array([[0.5]], np.float32)
    got = sink_softmax(scores, sinks)[0, 0, 0]
    denom = math.exp(1) + math.exp(2) + math.exp(0.5)
    np.testing.assert_allclose(got, [math.exp(1) / denom, math.exp(2) / denom, 0.0], rtol=1e-6)
    assert got.sum() < 1
    big = sink_softmax(np.array([1e4, 1e4 - 1], np.float32).reshape(1, 1, 1, 2), np.array([[-1e4]], np.float32))
    np.testing.assert_allclose(big[0, 0, 0], [1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))], rtol=1e-6)


def test_attention_gives_each_query_head_its_own_sink():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)  # T=3, nh=4 heads over kvh=2
    k, v = rng.standard_normal((2, 3, 8)).astype(np.float32), rng.standard_normal((2, 3, 8)).astype(np.float32)
    sinks = np.array([0.0, 1.0, -1.0, 2.0], np.float32)
    got = attention(q, k, v, 0.3, None, sinks)
    for h in range(4):
        kv = h // 2
        s = q[:, h] @ k[kv].T * 0.3  # [T, S]
        e = np.exp(s - s.max(-1, keepdims=True))
        p = e / (e.sum(-1, keepdims=True) + np.exp(sinks[h] - s.max(-1, keepdims=True)))
        np.testing.assert_allclose(got[:, h], p @ v[kv], rtol=1e-5, atol=1e-6)


def test_router_takes_top_k_logits_then_their_softmax():
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.0, -1.0, 5.0, 4.9]], np.float32)
    weights, idx, scores = route_topk_softmax(logits, 2)
    order = np.argsort(idx, axis=1)
    assert np.take_along_axis(idx, order, 1).tolist() == [[1, 2], [2, 3]]
    w = np.take_along_axis(weights, order, 1)
    np.testing.assert_allclose(w[0], [math.exp(1) / (1 + math.exp(1)), 1 / (1 + math.exp(1))], rtol=1e-6)
    np.testing.assert_allclose(w[1], [1 / (1 + math.exp(-0.1)), math.exp(-0.1) / (1 + math.exp(-0.1))], rtol=1e-6)
    assert scores is logits  # receipts record what top-k ran on: the biased logits

# ---------------------------------------------------------------- config


def test_config_defaults_are_the_config_class_defaults():
    cfg = ModelConfig.from_hf_config(BASE)
    assert cfg.sliding_windows == (128, None, 128, None)  # sliding_window 128, layer_types alternate
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.truncate, cfg.rope.theta) == ("yarn", 32.0, False, 1.5e5)
    assert cfg.rope.original_max_position_embeddings == 4096
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.rms_norm_eps) == (1.702, 7.0, 1e-5)
    assert cfg.attention_sinks and cfg.router_bias and cfg.expert_bias and not cfg.mxfp4
    assert cfg.router == "topk_softmax" and cfg.expert_act == "clamped_swiglu"
    listed = ModelConfig.from_hf_config({**BASE, "sliding_window": 3, "layer_types": ["full_attention"] * 3
                                         + ["sliding_attention"]})
    assert listed.sliding_windows == (None, None, None, 3)
    assert ModelConfig.from_hf_config({**BASE, "quantization_config": {"quant_method": "mxfp4"}}).mxfp4


BAD = {
    "layer_types too short": ({"layer_types": ["full_attention"]}, "layer_types"),
    "unknown layer type": ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    "swiglu_limit not a number": ({"swiglu_limit": "7"}, "swiglu_limit"),
    "swiglu_limit negative": ({"swiglu_limit": -1.0}, "swiglu_limit"),
    "swiglu_alpha above its cap": ({"swiglu_alpha": 1e6}, "swiglu_alpha"),
    "sliding_window zero": ({"sliding_window": 0}, "sliding_window"),
    "another quantization": ({"quantization_config": {"quant_method": "fp8"}}, "quant_method"),
    "quantization not an object": ({"quantization_config": [1]}, "quant_method"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_is_refused_naming_the_field(name, raises_exactly):
    change, field = BAD[name]
    with raises_exactly(CheckpointFormatError, match=field):
        ModelConfig.from_hf_config({**BASE, **change})

# ---------------------------------------------------------------- expert shards


def _expert(cfg: ModelConfig, mxfp4: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    t: dict[str, np.ndarray] = {}
    for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        w = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if mxfp4:
            t[f"{proj}.weight_blocks"], t[f"{proj}.weight_scales"] = quantize_mxfp4(w)
        else:
            t[f"{proj}.weight"] = w
        t[f"{proj}.bias"] = np.zeros(shape[0], np.float32)
    return t


MXFP4_CFG = {**BASE, "quantization_config": {"quant_method": "mxfp4"}}
BAD_SHARDS = {  # name: (config, change to a well-formed MXFP4 expert, message)
    "blocks of the wrong width": (MXFP4_CFG, lambda t: t.update({"gate_proj.weight_blocks":
                                                                  t["gate_proj.weight_blocks"][:, :1]}),
                                  "expected uint8 (32, 2, 16) / (32, 2)"),
    "scales of the wrong shape": (MXFP4_CFG, lambda t: t.update({"down_proj.weight_scales":
                                                                  t["down_proj.weight_scales"][:8]}),
                                  "weight_scales uint8 (8, 1)"),
    "transposed blocks": (MXFP4_CFG, lambda t: t.update({"up_proj.weight_blocks": np.zeros((64, 1, 16), np.uint8),
                                                         "up_proj.weight_scales": np.zeros((64, 1), np.uint8)}),
                          "expected uint8 (32, 2, 16)"),
    "blocks without scales": (MXFP4_CFG, lambda t: t.pop("up_proj.weight_scales"), "missing tensor up_proj"),
    "MXFP4 the config does not declare": (BASE, lambda t: None, "declares no quantization_config"),
    "weight beside blocks": (MXFP4_CFG, lambda t: t.update({"gate_proj.weight": np.zeros((32, 64), np.float32)}),
                             "more than one form (weight, weight_blocks)"),
    "missing bias": (MXFP4_CFG, lambda t: t.pop("down_proj.bias"), "missing tensor down_proj.bias"),
    "bias of the wrong size": (MXFP4_CFG, lambda t: t.update({"up_proj.bias": np.zeros(64, np.float32)}),
                               "up_proj.bias has shape (64,)"),
    "unknown tensor": (MXFP4_CFG, lambda t: t.update({"gate_proj.weight_scale_inv": np.ones((1, 1), np.float32)}),
                       "unexpected tensors"),
}


@pytest.mark.parametrize("name", sorted(BAD_SHARDS))
def test_malformed_expert_shard_is_refused_before_any_arithmetic(name, raises_exactly):
    config, change, message = BAD_SHARDS[name]
    cfg = ModelConfig.from_hf_config(config)
    t = _expert(ModelConfig.from_hf_config(MXFP4_CFG), mxfp4=True)
    change(t)
    with raises_exactly(CheckpointFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        expert_weights(cfg, 1, 2, t)


def test_mxfp4_expert_equals_the_float_expert_of_its_values():
    cfg = ModelConfig.from_hf_config(MXFP4_CFG)
    packed = _expert(cfg, mxfp4=True)
    plain = expert_weights(cfg, 0, 0, packed)
    plain = [to_float32(w) for w in (plain.gate, plain.up, plain.down)]
    floats = {"gate_proj.weight": plain[0], "up_proj.weight": plain[1], "down_proj.weight": plain[2],
              **{k: v for k, v in packed.items() if k.endswith(".bias")}}
    again = expert_weights(cfg, 0, 0, floats)
    for a, b in zip(plain, (again.gate.data, again.up.data, again.down.data)):
        np.testing.assert_array_equal(a, b)


def test_an_mxfp4_expert_is_multiplied_as_stored():
    # No float32 copy of the expert is made (or kept): its packed blocks are views of the shard's own arrays.
    cfg = ModelConfig.from_hf_config(MXFP4_CFG)
    t = _expert(cfg, mxfp4=True)
    w = expert_weights(cfg, 0, 0, t)
    assert w.gate.kind == "mxfp4" and np.shares_memory(w.gate.data, t["gate_proj.weight_blocks"])


# ---------------------------------------------------------------- through the installed verify-and-run


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Path:
    """make_tiny_moe's MXFP4 gpt-oss, split and signed: (work dir holding k.key / k.pub, model dir)."""
    work = tmp_path_factory.mktemp("gpt-oss")
    mtm.make_checkpoint(work / "ck", "gpt_oss", layers=2, moe_intermediate=32, mxfp4=True, experts=4)
    for args in (("keygen", "--out", "k", "--no-passphrase"), ("split", "-q", work / "ck", work / "model"),
                 ("sign", work / "model", "--key", "k.key")):
        r = _cli("shardtool", *args, cwd=work)
        assert r.returncode == 0, r.stderr
    return work


def test_signed_expert_with_inconsistent_mxfp4_shapes_exits_1_with_one_line(signed, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    model = Path(shutil.copytree(signed / "model", tmp_path / "model"))
    run = ("verify-and-run", model, "--trust", signed / "k.pub", "--prompt-ids", "3,17,200", "--print-ids",
           "--max-new-tokens", 2, "--state-dir", tmp_path / "state")
    good = _cli(*run, cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    for layer in range(2):  # every expert of both layers: whichever the prompt picks is malformed
        for e in range(4):
            rel = f"experts/layer-{layer:03d}/expert-{e:04d}.safetensors"
            t = load_file(model / rel)
            t["down_proj.weight_blocks"] = np.ascontiguousarray(t["down_proj.weight_blocks"][:, :, :8])
            save_file(t, tmp_path / "x.safetensors")
            republish(model, rel, (tmp_path / "x.safetensors").read_bytes(), signed / "k.key")
    r = _cli(*run[:-1], tmp_path / "state-2", cwd=tmp_path)  # a re-signed version 1: a fresh rollback state
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "down_proj" in lines[0] and "(64, 1, 16)" in lines[0], r.stderr


def test_contract_in_the_signed_manifest_counts_mxfp4_bytes(signed):
    from shardtool.checkpoint import contract_from_config
    from shardtool.formats import MXFP4

    mxfp4_bytes = MXFP4.nbytes

    r = _cli("shardtool", "inspect", signed / "model", "--json", cwd=signed)
    assert r.returncode == 0, r.stderr
    measured = json.loads(r.stdout)["contract"]
    config = json.loads((signed / "ck" / "config.json").read_text())
    predicted = contract_from_config(config, 16)  # BF16 trunk and biases, MXFP4 expert weights
    h, i = 64, 32
    data = 2 * mxfp4_bytes(i, h) + mxfp4_bytes(h, i) + (2 * i + h) * 2  # 4.25 bits per weight + BF16 biases
    assert predicted["bytes_per_expert"] == data == 3520
    assert data < measured["bytes_per_expert"] < data + 4096  # the file: its safetensors header on top
    assert measured["params_total"] == predicted["params_total"]
