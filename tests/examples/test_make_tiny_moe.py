"""examples/make_tiny_moe.py writes checkpoints that transformers loads with no missing or unexpected keys."""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from examples import make_tiny_moe as mtm
from shardtool.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]

# 3 layers with one leading dense layer where the family has dense layers, so both kinds are covered.
KNOBS = {
    "mixtral": {"layers": 2},
    "olmoe": {"layers": 2},
    "gpt_oss": {"layers": 2},
    "qwen2_moe": {"layers": 3, "dense_layers": 1},
    "qwen3_moe": {"layers": 3, "dense_layers": 1},
    "fused": {"layers": 3, "dense_layers": 1},
    "llama4": {"layers": 3, "dense_layers": 1},
    "deepseek_v3": {"layers": 3, "dense_layers": 1},
}
H, I_DENSE, I_MOE, E, V = 64, 96, 40, 4, 512  # Knobs defaults; all distinct so transposes show up in shapes

# Names that must exist (layer 1 is a MoE layer in every family above) and the shapes transformers expects.
EXPECTED = {
    "mixtral": {
        "model.layers.1.block_sparse_moe.gate.weight": (E, H),
        "model.layers.1.block_sparse_moe.experts.3.w1.weight": (I_MOE, H),
        "model.layers.1.block_sparse_moe.experts.3.w2.weight": (H, I_MOE),
        "model.layers.1.block_sparse_moe.experts.3.w3.weight": (I_MOE, H),
        "model.layers.1.self_attn.k_proj.weight": (32, H),
    },
    "qwen2_moe": {
        "model.layers.0.mlp.gate_proj.weight": (I_DENSE, H),
        "model.layers.1.mlp.gate.weight": (E, H),
        "model.layers.1.mlp.experts.0.down_proj.weight": (H, I_MOE),
        "model.layers.1.mlp.shared_expert.up_proj.weight": (I_DENSE, H),
        "model.layers.1.mlp.shared_expert_gate.weight": (1, H),
        "model.layers.1.self_attn.q_proj.bias": (H,),
    },
    "qwen3_moe": {
        "model.layers.0.mlp.down_proj.weight": (H, I_DENSE),
        "model.layers.2.mlp.experts.3.gate_proj.weight": (I_MOE, H),
        "model.layers.1.self_attn.q_norm.weight": (16,),
        "model.layers.1.self_attn.k_norm.weight": (16,),
    },
    "fused": {
        "model.layers.1.mlp.gate.weight": (E, H),
        "model.layers.1.mlp.experts.gate_up_proj": (E, 2 * I_MOE, H),
        "model.layers.1.mlp.experts.down_proj": (E, H, I_MOE),
    },
    "olmoe": {
        "model.layers.1.mlp.experts.2.up_proj.weight": (I_MOE, H),
        "model.layers.1.self_attn.q_norm.weight": (H,),
        "model.layers.1.self_attn.k_norm.weight": (32,),
    },
    "deepseek_v3": {
        "model.layers.0.mlp.gate_proj.weight": (I_DENSE, H),
        "model.layers.1.mlp.gate.e_score_correction_bias": (E,),
        "model.layers.1.mlp.experts.3.gate_proj.weight": (I_MOE, H),
        "model.layers.1.mlp.shared_experts.down_proj.weight": (H, I_MOE),
        "model.layers.1.self_attn.q_a_proj.weight": (32, H),
        "model.layers.1.self_attn.q_b_proj.weight": (4 * 24, 32),
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": (16 + 8, H),
        "model.layers.1.self_attn.kv_b_proj.weight": (4 * 32, 16),
        "model.layers.3.enorm.weight": (H,),  # the MTP layer, index == num_hidden_layers
        "model.layers.3.hnorm.weight": (H,),
        "model.layers.3.eh_proj.weight": (H, 2 * H),
        "model.layers.3.shared_head.norm.weight": (H,),
        "model.layers.3.shared_head.head.weight": (V, H),
        "model.layers.3.mlp.experts.0.down_proj.weight": (H, I_MOE),
    },
    "gpt_oss": {
        "model.layers.1.mlp.router.weight": (E, H),
        "model.layers.1.mlp.router.bias": (E,),
        "model.layers.1.mlp.experts.gate_up_proj": (E, H, 2 * I_MOE),
        "model.layers.1.mlp.experts.gate_up_proj_bias": (E, 2 * I_MOE),
        "model.layers.1.mlp.experts.down_proj": (E, I_MOE, H),
        "model.layers.1.mlp.experts.down_proj_bias": (E, H),
        "model.layers.1.self_attn.sinks": (4,),
        "model.layers.1.self_attn.o_proj.bias": (H,),
    },
    "llama4": {
        "model.layers.0.feed_forward.gate_proj.weight": (I_DENSE, H),
        "model.layers.1.feed_forward.router.weight": (E, H),
        "model.layers.1.feed_forward.experts.gate_up_proj": (E, H, 2 * I_MOE),
        "model.layers.1.feed_forward.experts.down_proj": (E, I_MOE, H),
        "model.layers.1.feed_forward.shared_expert.down_proj.weight": (H, I_MOE),
    },
}

ROUTERS = {
    "mixtral": "model.layers.1.block_sparse_moe.gate.weight",
    "qwen2_moe": "model.layers.1.mlp.gate.weight",
    "qwen3_moe": "model.layers.1.mlp.gate.weight",
    "fused": "model.layers.1.mlp.gate.weight",
    "olmoe": "model.layers.1.mlp.gate.weight",
    "deepseek_v3": "model.layers.1.mlp.gate.weight",
    "gpt_oss": "model.layers.1.mlp.router.weight",
    "llama4": "model.layers.1.feed_forward.router.weight",
}


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def _tensors(ckpt: Path) -> dict[str, dict]:
    """name -> {dtype, shape, file} over all safetensors files of a checkpoint."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, info in _header(f).items():
            if name != "__metadata__":
                assert name not in out, f"{name} appears in two files"
                out[name] = {"dtype": info["dtype"], "shape": tuple(info["shape"]), "file": f.name}
    return out


def _array(ckpt: Path, name: str) -> np.ndarray:
    with safe_open(ckpt / "model.safetensors", "np") as f:
        return np.asarray(f.get_tensor(name), dtype=np.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {fam: mtm.make_checkpoint(root / fam, fam, **KNOBS[fam]) for fam in mtm.FAMILIES}


def test_families_are_the_documented_ones():
    assert set(mtm.FAMILIES) == set(KNOBS) == set(EXPECTED)


@pytest.mark.parametrize("family", mtm.FAMILIES)
def test_layout_files_and_tensor_names(family, checkpoints):
    ckpt = checkpoints[family]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    assert not list(ckpt.parent.glob(f".{family}.tmp*")), "temporary directory left behind"
    tensors = _tensors(ckpt)
    config, specs = mtm.build_spec(family, mtm.Knobs(**KNOBS[family]))
    assert {s.name: s.shape for s in specs} == {n: t["shape"] for n, t in tensors.items()}
    for name, shape in EXPECTED[family].items():
        assert tensors[name]["shape"] == shape, name
    assert tensors["model.embed_tokens.weight"]["shape"] == (V, H)
    assert tensors["lm_head.weight"]["shape"] == (V, H)
    bf16 = {n for n, t in tensors.items() if t["dtype"] == "BF16"}
    assert set(tensors) - bf16 == ({n for n in tensors if n.endswith("e_score_correction_bias")}), \
        "everything is BF16 except DeepSeek's F32 router bias"
    assert json.loads((ckpt / "config.json").read_text()) == config
    with safe_open(ckpt / "model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)


@pytest.mark.parametrize("family", mtm.FAMILIES)
def test_router_sends_different_tokens_to_different_experts(family, checkpoints):
    ckpt = checkpoints[family]
    x = _array(ckpt, "model.embed_tokens.weight")  # [V, H]: every token as a first-layer input
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    logits = x @ _array(ckpt, ROUTERS[family]).T  # [V, E]
    top1 = logits.argmax(-1)
    counts = np.bincount(top1, minlength=E)
    assert (counts > V // (4 * E)).all(), f"expert use is lopsided: {counts}"
    assert 0.5 < logits.std() < 5.0


@pytest.mark.parametrize("family", mtm.FAMILIES)
def test_weights_are_well_conditioned(family, checkpoints):
    ckpt = checkpoints[family]
    with safe_open(ckpt / "model.safetensors", "np") as f:
        for name in f.keys():
            a = np.asarray(f.get_tensor(name), dtype=np.float32)
            assert np.isfinite(a).all(), name
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                assert abs(a.mean() - 1.0) < 0.05 and a.std() > 0.01, name
            elif a.size >= 256:
                assert 0.01 < a.std() < 0.5 and abs(a.mean()) < 0.05, name


def test_deepseek_router_bias_is_nonzero_and_mtp_layer_complete(checkpoints):
    ckpt = checkpoints["deepseek_v3"]
    assert np.abs(_array(ckpt, "model.layers.1.mlp.gate.e_score_correction_bias")).min() > 0
    tensors = _tensors(ckpt)
    main = {n[len("model.layers.2."):] for n in tensors if n.startswith("model.layers.2.")}
    mtp = {n[len("model.layers.3."):] for n in tensors if n.startswith("model.layers.3.")}
    assert mtp - main == {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                          "shared_head.norm.weight", "shared_head.head.weight"}
    assert main <= mtp  # a full MoE decoder layer, own experts included
    cfg = json.loads((ckpt / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]) == (3, 1)
    assert (cfg["scoring_func"], cfg["topk_method"], cfg["first_k_dense_replace"]) == ("sigmoid", "noaux_tc", 1)


def test_fp8_matches_deepseek_v3_release_layout(tmp_path):
    knobs = {"layers": 2, "hidden": 192, "heads": 4, "kv_heads": 4}  # 192 = 1.5 blocks: partial blocks too
    ckpt = mtm.make_checkpoint(tmp_path / "fp8", "deepseek_v3", fp8=True, **knobs)
    plain = {s.name: s.shape for s in mtm.build_spec("deepseek_v3", mtm.Knobs(**knobs))[1]}
    tensors = _tensors(ckpt)
    scales = {n for n in tensors if n.endswith(".weight_scale_inv")}
    assert set(tensors) - scales == set(plain)
    quantized = {n[: -len("_scale_inv")] for n in scales}
    assert {n for n, t in tensors.items() if t["dtype"] == "F8_E4M3"} == quantized
    for n in quantized:  # every attention / dense / expert projection, nothing else
        assert re.search(r"\.(self_attn|mlp)\.", n) and ".gate.weight" not in n, n
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in quantized
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantized
    assert "model.layers.2.mlp.shared_experts.up_proj.weight" in quantized  # MTP layer too
    for n in ("model.layers.2.eh_proj.weight", "model.layers.1.mlp.gate.weight", "lm_head.weight"):
        assert tensors[n]["dtype"] == "BF16", n
    raw = (ckpt / "model.safetensors").read_bytes()
    header = _header(ckpt / "model.safetensors")
    base = 8 + struct.unpack("<Q", raw[:8])[0]

    def load(name, dtype):
        lo, hi = header[name]["data_offsets"]
        return np.frombuffer(raw[base + lo: base + hi], dtype=dtype).reshape(header[name]["shape"])

    for n in quantized:
        w = load(n, ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = load(n + "_scale_inv", np.float32)
        assert s.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)), n
        assert (s > 0).all() and len(np.unique(s)) == s.size, n  # per-block scales, distinguishable
        deq = w * np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
        assert 0.01 < deq.std() < 0.2 and np.isfinite(deq).all(), n
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}


def test_mxfp4_matches_gpt_oss_release_layout(tmp_path):
    """U8 blocks [E, out, in/32, 16] and scales [E, out, in/32] for the experts only; they decode (low nibble
    first, times 2^(scale - 127)) to weights of the size the BF16 variant has."""
    from shardtool.runtime.model._dtypes import mxfp4_to_float32

    ckpt = mtm.make_checkpoint(tmp_path / "mx", "gpt_oss", layers=2, moe_intermediate=32, mxfp4=True)
    tensors = _tensors(ckpt)
    u8 = {n for n, t in tensors.items() if t["dtype"] == "U8"}
    assert u8 == {f"model.layers.{i}.mlp.experts.{p}_{part}" for i in range(2) for p in ("gate_up_proj", "down_proj")
                  for part in ("blocks", "scales")}
    assert tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"]["shape"] == (E, 64, H // 32, 16)
    assert tensors["model.layers.1.mlp.experts.down_proj_scales"]["shape"] == (E, H, 1)
    assert set(tensors) - u8 == {n for n, t in tensors.items() if t["dtype"] == "BF16"}
    with safe_open(ckpt / "model.safetensors", "np") as f:
        for p in ("gate_up_proj", "down_proj"):
            blocks = f.get_tensor(f"model.layers.0.mlp.experts.{p}_blocks")
            scales = f.get_tensor(f"model.layers.0.mlp.experts.{p}_scales")
            w = mxfp4_to_float32(blocks[0], scales[0])
            assert np.isfinite(w).all() and 0.02 < w.std() < 0.5 and abs(w.mean()) < 0.05, p
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"] == mtm.MXFP4_QUANTIZATION


def test_sharding_and_index_as_hf_writes_them(tmp_path):
    ckpt = mtm.make_checkpoint(tmp_path / "sharded", "qwen3_moe", shard_size_mb=0.1, layers=3, dense_layers=1)
    shards = sorted(ckpt.glob("*.safetensors"))
    n = len(shards)
    assert n > 2
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (ckpt / "model.safetensors").exists()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    tensors = _tensors(ckpt)
    assert index["weight_map"] == {name: t["file"] for name, t in tensors.items()}
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    nbytes = {}
    for shard in shards:
        with safe_open(shard, "np") as f:
            nbytes[shard.name] = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert index["metadata"] == {"total_size": sum(nbytes.values())}
    big = max(math.prod(t["shape"]) * 2 for t in tensors.values())
    assert all(b <= max(100_000, big) for b in nbytes.values())


def test_plan_shards_follows_huggingface_hub_order():
    def spec(name, n):
        return mtm.TensorSpec(name, (n,), "f32", 0.02)  # 4 bytes per element

    specs = [spec("a", 10), spec("b", 10), spec("huge", 100), spec("c", 15), spec("d", 5)]
    plan = [[s.name for s in shard] for shard in mtm.plan_shards(specs, 80)]
    assert plan == [["huge"], ["a", "b"], ["c", "d"]]  # oversize tensor shard is emitted at once


def test_tokenizer_round_trips_and_matches_config(checkpoints):
    from tokenizers import Tokenizer

    ckpt = checkpoints["mixtral"]
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    cfg = json.loads((ckpt / "config.json").read_text())
    assert tok.get_vocab_size() == cfg["vocab_size"] == V
    text = "The miller said the river was older than the town. Zebras! 42 ünïcödé"
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode()) and max(ids) < V
    assert tok.decode(ids) == text
    assert [tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")] == [
        cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]]
    special = json.loads((ckpt / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def test_tokenizer_pads_to_large_vocab_with_reserved_tokens():
    tok = mtm.build_tokenizer(1000)
    assert tok.get_vocab_size() == 1000
    assert tok.token_to_id("<|reserved_0|>") is not None
    assert tok.decode(tok.encode("hello there").ids) == "hello there"


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, checkpoints):
    again = mtm.make_checkpoint(tmp_path / "again", "mixtral", **KNOBS["mixtral"])
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (checkpoints["mixtral"] / name).read_bytes(), name
    other = mtm.make_checkpoint(tmp_path / "other", "mixtral", seed=1, **KNOBS["mixtral"])
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype, tag", [("f32", "F32"), ("f16", "F16")])
def test_dtype_knob(tmp_path, dtype, tag):
    ckpt = mtm.make_checkpoint(tmp_path / dtype, "olmoe", dtype=dtype, layers=1)
    assert {t["dtype"] for t in _tensors(ckpt).values()} == {tag}
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == {"f32": "float32", "f16": "float16"}[dtype]


def test_tied_embeddings_drop_lm_head(tmp_path):
    ckpt = mtm.make_checkpoint(tmp_path / "tied", "mixtral", layers=1, tie_word_embeddings=True)
    assert "lm_head.weight" not in _tensors(ckpt)
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is True


BAD_KNOBS = [
    ("unknown_family", "mixtral2", {}),
    ("hidden_not_multiple_of_heads", "mixtral", {"hidden": 60, "heads": 8}),
    ("heads_not_multiple_of_kv_heads", "mixtral", {"heads": 4, "kv_heads": 3}),
    ("top_k_above_experts", "qwen3_moe", {"experts": 2, "experts_per_tok": 3}),
    ("vocab_below_byte_alphabet", "mixtral", {"vocab": 200}),
    ("fp8_outside_deepseek", "mixtral", {"fp8": True}),
    ("mxfp4_outside_gpt_oss", "mixtral", {"mxfp4": True}),
    ("mxfp4_width_not_multiple_of_32", "gpt_oss", {"mxfp4": True, "moe_intermediate": 40}),
    ("dense_layers_on_mixtral", "mixtral", {"dense_layers": 1}),
    ("mtp_outside_deepseek", "qwen3_moe", {"mtp_layers": 1}),
    ("dense_layers_above_layers", "deepseek_v3", {"layers": 2, "dense_layers": 3}),
    ("experts_not_multiple_of_groups", "deepseek_v3", {"experts": 6, "n_group": 4}),
    ("top_k_not_reachable_in_groups", "deepseek_v3", {"experts": 8, "n_group": 4, "topk_group": 1,
                                                      "experts_per_tok": 3}),
    ("unknown_dtype", "mixtral", {"dtype": "f64"}),
    ("zero_layers", "mixtral", {"layers": 0}),
    ("negative_shard_size", "mixtral", {"shard_size_mb": -1}),
    ("unknown_knob", "mixtral", {"hiden": 64}),
    ("chunk_size_outside_llama4", "mixtral", {"attention_chunk_size": 16}),
    ("nope_interval_outside_llama4", "qwen3_moe", {"nope_interval": 2}),
    ("zero_chunk_size", "llama4", {"attention_chunk_size": 0}),
]


@pytest.mark.parametrize("case, family, knobs", BAD_KNOBS, ids=[c[0] for c in BAD_KNOBS])
def test_bad_knobs_raise_usage_error(tmp_path, case, family, knobs):
    with pytest.raises(UsageError):
        mtm.make_checkpoint(tmp_path / case, family, **knobs)
    assert not (tmp_path / case).exists()


def test_existing_output_needs_overwrite_and_stale_temp_is_replaced(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    with pytest.raises(UsageError):
        mtm.make_checkpoint(out, "olmoe", layers=1)
    assert (out / "precious.txt").exists()
    stale = tmp_path / ".ck.tmp-make-tiny-moe"
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    mtm.make_checkpoint(out, "olmoe", layers=1, overwrite=True)
    assert not (out / "precious.txt").exists() and (out / "model.safetensors").stat().st_size > 1000
    assert not stale.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    mtm.make_checkpoint(empty, "olmoe", layers=1)  # an empty directory (e.g. pytest's tmp_path) is fine


def test_interrupted_write_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mtm, "_write_shards", boom)
    with pytest.raises(KeyboardInterrupt):
        mtm.make_checkpoint(tmp_path / "ck", "olmoe", layers=1)
    assert list(tmp_path.iterdir()) == []


def test_cli_main_exit_codes(tmp_path, capsys):
    assert mtm.main([str(tmp_path / "a"), "--family", "llama4", "--layers", "1", "--experts", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a")
    assert mtm.main([str(tmp_path / "b"), "--family", "mixtral", "--fp8"]) == 2
    assert "fp8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        mtm.main([str(tmp_path / "c"), "--family", "nope"])
    assert e.value.code == 2


def test_cli_runs_as_a_script(tmp_path):
    out = tmp_path / "script"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_moe.py"), str(out), "--family",
                        "gpt_oss", "--layers", "1", "--shard-size-mb", "0.05"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors.index.json").exists()


# ---------------------------------------------------------------------------------------------------------
# The oracle: transformers itself (skipped when torch / transformers are not installed).


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch", reason="torch not installed: cannot check against transformers")
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    transformers.logging.set_verbosity_error()
    return torch, transformers


@pytest.mark.oracle
@pytest.mark.parametrize("family", mtm.FAMILIES)
def test_config_loads_with_autoconfig(family, checkpoints, hf):
    _, transformers = hf
    cfg = transformers.AutoConfig.from_pretrained(checkpoints[family])
    raw = json.loads((checkpoints[family] / "config.json").read_text())
    assert cfg.model_type == raw["model_type"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (H, KNOBS[family]["layers"], V)
    assert cfg.rope_parameters["rope_theta"] == raw["rope_theta"]


@pytest.mark.oracle
@pytest.mark.parametrize("family", mtm.FAMILIES)
def test_from_pretrained_has_no_missing_or_unexpected_keys(family, checkpoints, hf):
    torch, transformers = hf
    ckpt = checkpoints[family]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert type(model).__name__ == json.loads((ckpt / "config.json").read_text())["architectures"][0]
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    if family == "deepseek_v3":
        # transformers ignores MTP layers only at DeepSeek-V3's own index (`model\.layers\.61.*`); it reports
        # ours after fusing their experts, so compare prefixes.
        assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    else:
        assert info["unexpected_keys"] == set()
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert (tok.bos_token_id, tok.eos_token_id) == (model.config.bos_token_id, model.config.eos_token_id)
    ids = tok("The river ran past the mill, and the bread was warm.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.3
    assert len(set(logits.argmax(-1).tolist())) > ids.shape[1] // 3  # predictions depend on the input


@pytest.mark.oracle
def test_from_pretrained_reads_mxfp4_experts(tmp_path, hf):
    torch, transformers = hf
    ckpt = mtm.make_checkpoint(tmp_path / "mx", "gpt_oss", layers=2, moe_intermediate=32, mxfp4=True)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, output_loading_info=True, quantization_config=transformers.Mxfp4Config(dequantize=True))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[3, 17, 200, 45, 9]])).logits[0].float()
    assert torch.isfinite(logits).all() and logits.std() > 0.3


@pytest.mark.oracle
def test_from_pretrained_reads_sharded_checkpoint(tmp_path, hf):
    _, transformers = hf
    ckpt = mtm.make_checkpoint(tmp_path / "sharded", "mixtral", shard_size_mb=0.1, layers=2)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    with safe_open(ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][
            "model.layers.1.block_sparse_moe.experts.2.w3.weight"], "np") as f:
        w3 = np.asarray(f.get_tensor("model.layers.1.block_sparse_moe.experts.2.w3.weight"), dtype=np.float32)
    # transformers>=5 fuses [w1; w3] into gate_up_proj [E, 2I, H]: up is the second half.
    fused = model.model.layers[1].mlp.experts.gate_up_proj[2, I_MOE:].detach().float().numpy()
    np.testing.assert_array_equal(fused, w3)
