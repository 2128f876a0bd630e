"""Family detection, tensor mapping errors and checkpoint-directory validation, as tables of named cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from shardtool.checkpoint import detect_family, prepare_split
from shardtool.families import SUPPORTED_FAMILIES
from shardtool.errors import CheckpointFormatError, UsageError

DETECT = {
    "mixtral-by-model-type": ({"model_type": "mixtral"}, "mixtral"),
    "qwen2-moe": ({"model_type": "qwen2_moe"}, "qwen2_moe"),
    "qwen3-moe": ({"model_type": "qwen3_moe"}, "qwen3_moe"),
    "olmoe": ({"model_type": "olmoe"}, "olmoe"),
    "deepseek-v3": ({"model_type": "deepseek_v3"}, "deepseek_v3"),
    "kimi-k2-model-type": ({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}, "deepseek_v3"),
    "kimi-k2-by-architecture-only": ({"model_type": "kimi_k3_future", "architectures": ["DeepseekV3ForCausalLM"]},
                                     "deepseek_v3"),
    "gpt-oss": ({"model_type": "gpt_oss"}, "gpt_oss"),
    "llama4-multimodal": ({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}, "llama4"),
    "llama4-text": ({"model_type": "llama4_text"}, "llama4"),
}


@pytest.mark.parametrize("case", sorted(DETECT))
def test_detect_family(case: str) -> None:
    config, family = DETECT[case]
    assert detect_family(config) == family


@pytest.mark.parametrize("config", [{"model_type": "llama"}, {}, {"architectures": "not-a-list"},
                                    {"model_type": 3}], ids=["dense-llama", "empty", "bad-architectures", "int"])
def test_unknown_family_lists_supported_ones(config: dict, raises_exactly) -> None:
    with raises_exactly(CheckpointFormatError) as info:
        detect_family(config)
    for family in SUPPORTED_FAMILIES:
        assert family in info.value.one_line()
    assert "--expert-pattern" in info.value.one_line()


H, I, E = 8, 4, 4


def _experts(layer: int, experts: range, *, skip: tuple = ()) -> dict[str, np.ndarray]:
    out = {}
    for e in experts:
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            if (e, proj) not in skip:
                out[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = np.full(shape, e, np.float32)
    return out


def _base(layers: int = 1) -> dict[str, np.ndarray]:
    t = {"model.embed_tokens.weight": np.zeros((16, H), np.float32), "model.norm.weight": np.ones(H, np.float32),
         "lm_head.weight": np.zeros((16, H), np.float32)}
    for layer in range(layers):
        t[f"model.layers.{layer}.mlp.gate.weight"] = np.zeros((E, H), np.float32)
        t.update(_experts(layer, range(E)))
    return t


CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": H, "num_experts": E,
          "num_experts_per_tok": 2, "moe_intermediate_size": I, "intermediate_size": 2 * I, "vocab_size": 16,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}


def write(root: Path, files: dict[str, dict[str, np.ndarray]], *, config: Any = CONFIG,
          index: Any = "auto", extra: dict[str, bytes] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for fname, tensors in files.items():
        safetensors.numpy.save_file(tensors, root / fname)
    if index == "auto" and len(files) > 1:
        index = {"metadata": {}, "weight_map": {n: f for f, ts in files.items() for n in ts}}
    if index not in ("auto", None):
        (root / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    for name, data in (extra or {}).items():
        (root / name).write_bytes(data)
    return root


def _two_files() -> dict[str, dict[str, np.ndarray]]:
    t = _base()
    names = sorted(t)
    return {"model-00001-of-00002.safetensors": {n: t[n] for n in names[:5]},
            "model-00002-of-00002.safetensors": {n: t[n] for n in names[5:]}}


def _index_with(**changes: Any) -> dict:
    files = _two_files()
    wm = {n: f for f, ts in files.items() for n in ts}
    wm.update(changes.get("update", {}))
    for n in changes.get("drop", ()):
        del wm[n]
    return {"weight_map": wm}


_FIRST = sorted(_base())[0]
_LAST = sorted(_base())[-1]
# Named bad checkpoints: (files, write() keyword arguments, error class, message fragment).
BAD = {
    "no-config": (_two_files(), {"config": None}, CheckpointFormatError, "config.json not found"),
    "config-not-json": ({"model.safetensors": _base()}, {"config": "{nope"}, CheckpointFormatError, "not valid JSON"),
    "config-duplicate-key": ({"model.safetensors": _base()}, {"config": '{"model_type": "x", "model_type": "y"}'},
                             CheckpointFormatError, "twice"),
    "config-not-object": ({"model.safetensors": _base()}, {"config": "[1]"}, CheckpointFormatError, "JSON object"),
    "no-weights": ({}, {}, CheckpointFormatError, "no safetensors"),
    "two-files-no-index": (_two_files(), {"index": None}, CheckpointFormatError, "no model.safetensors.index.json"),
    "index-names-missing-file": (_two_files(), {"index": _index_with(update={_FIRST: "model-00009-of-00009.safetensors"})},
                                 CheckpointFormatError, "model-00009-of-00009.safetensors"),
    "index-maps-tensor-to-wrong-file": (_two_files(), {"index": _index_with(update={_FIRST: "model-00002-of-00002.safetensors"})},
                                        CheckpointFormatError, "wrongly"),
    "index-lacks-a-tensor": (_two_files(), {"index": _index_with(drop=[_LAST])}, CheckpointFormatError,
                             "not in the index"),
    "index-path-traversal": (_two_files(), {"index": _index_with(update={_FIRST: "../model.safetensors"})},
                             CheckpointFormatError, "plain file name"),
    "index-not-json": (_two_files(), {"index": "{"}, CheckpointFormatError, "not valid JSON"),
    "index-without-weight-map": (_two_files(), {"index": {"metadata": {}}}, CheckpointFormatError, "weight_map"),
    "tensor-in-two-files": ({"model-00001-of-00002.safetensors": _base(), "model-00002-of-00002.safetensors":
                             {_FIRST: _base()[_FIRST]}}, {"index": {"weight_map": {**{n: "model-00001-of-00002.safetensors"
                                                                                       for n in _base()},
                                                                                    _FIRST: "model-00002-of-00002.safetensors"}}},
                            CheckpointFormatError, "in both"),
    "missing-expert": ({"model.safetensors": {**{k: v for k, v in _base().items() if ".experts.2." not in k}}}, {},
                       CheckpointFormatError, "missing expert(s) 2"),
    "more-experts-than-config": ({"model.safetensors": {**_base(), **_experts(0, range(E, E + 1))}}, {},
                                 CheckpointFormatError, "unexpected expert(s) 4"),
    "expert-lacks-a-projection": ({"model.safetensors": {**{k: v for k, v in _base().items()
                                                             if k != "model.layers.0.mlp.experts.3.up_proj.weight"}}},
                                  {}, CheckpointFormatError, "expert 3"),
    "dense-model": ({"model.safetensors": {k: v for k, v in _base().items() if ".experts." not in k}}, {},
                    CheckpointFormatError, "no routed-expert tensors"),
    "fused-shape-not-matching-hidden": ({"model.safetensors": {
        **{k: v for k, v in _base().items() if ".experts." not in k},
        "model.layers.0.mlp.experts.gate_up_proj": np.zeros((E, 2 * I, H + 1), np.float32),
        "model.layers.0.mlp.experts.down_proj": np.zeros((E, H, I), np.float32)}}, {}, CheckpointFormatError,
        "hidden_size"),
    "fused-odd-gate-up": ({"model.safetensors": {
        **{k: v for k, v in _base().items() if ".experts." not in k},
        "model.layers.0.mlp.experts.gate_up_proj": np.zeros((E, 2 * I + 1, H), np.float32),
        "model.layers.0.mlp.experts.down_proj": np.zeros((E, H, I), np.float32)}}, {}, CheckpointFormatError, "even"),
    "corrupt-safetensors-header": ({"model.safetensors": _base()}, {"extra": {}}, CheckpointFormatError, "header"),
    "config-lacks-contract-fields": ({"model.safetensors": _base()}, {"config": {**CONFIG, "vocab_size": None}},
                                     CheckpointFormatError, "lacks vocab_size"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_refused(case: str, tmp_path: Path, raises_exactly) -> None:
    files, kw, error, fragment = BAD[case]
    root = write(tmp_path / "ckpt", files, **kw)
    if case == "corrupt-safetensors-header":
        path = root / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[8] = ord("[")
        path.write_bytes(bytes(data))
    with raises_exactly(error) as info:
        prepare_split(root)
    assert fragment in info.value.one_line()


@pytest.mark.parametrize("pattern,fragment", [("(", "not a valid regular expression"),
                                              (r"model\.layers\.(?P<layer>\d+)\.", "expert"),
                                              (r"(?P<layer>\d+)(?P<expert>\d+)", None)],
                         ids=["invalid-regex", "missing-expert-group", "matches-whole-name"])
def test_bad_expert_pattern_is_a_usage_error(pattern: str, fragment: str | None, tmp_path: Path,
                                             raises_exactly) -> None:
    t = {"model.embed_tokens.weight": np.zeros((4, H), np.float32), "12": np.zeros(2, np.float32)}
    root = write(tmp_path / "ckpt", {"model.safetensors": t})
    with raises_exactly(UsageError) as info:
        prepare_split(root, expert_pattern=pattern)
    if fragment:
        assert fragment in info.value.one_line()


def test_side_files_are_copied_and_other_weight_formats_skipped(tmp_path: Path) -> None:
    root = write(tmp_path / "ckpt", {"model.safetensors": _base()},
                 extra={"tokenizer.json": b"{}", "README.md": b"# hi", "pytorch_model.bin": b"\0" * 10,
                        ".gitattributes": b"*"})
    job = prepare_split(root)
    side = {o.path: o.kind for o in job.outputs if o.copy_from}
    assert side == {"config.json": "config", "tokenizer.json": "tokenizer", "README.md": "other"}
    assert job.checkpoint.skipped == ("pytorch_model.bin",)


def _fused_join_round_trip(root: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    from shardtool.checkpoint import parse_safetensors, split_checkpoint

    from ckpt_helpers import join_unsigned, tensors_of

    split_checkpoint(root, tmp_path / "out", model_id="t")
    join_unsigned(tmp_path / "out", tmp_path / "rebuilt")
    assert tensors_of(tmp_path / "rebuilt") == tensors_of(root)
    return parse_safetensors((tmp_path / "out/experts/layer-000/expert-0001.safetensors").read_bytes())[0]


def test_gpt_oss_mxfp4_blocks_are_cut_per_expert(tmp_path: Path) -> None:
    """The released gpt-oss layout: U8 MXFP4 blocks/scales [E, out, in/32(, 16)], gate/up rows interleaved. The
    widths are one block of 32 (hidden and intermediate), so the blocks stand for the config's shapes."""
    rng = np.random.default_rng(0)
    h = i = 32  # one MXFP4 block per row
    t = {
        "model.embed_tokens.weight": np.zeros((16, h), np.float32),
        "model.layers.0.mlp.router.weight": np.zeros((E, h), np.float32),
        "model.layers.0.mlp.experts.gate_up_proj_blocks": rng.integers(0, 255, (E, 2 * i, h // 32, 16), dtype=np.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": rng.integers(0, 255, (E, 2 * i, h // 32), dtype=np.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_bias": rng.standard_normal((E, 2 * i)).astype(np.float32),
        "model.layers.0.mlp.experts.down_proj_blocks": rng.integers(0, 255, (E, h, i // 32, 16), dtype=np.uint8),
        "model.layers.0.mlp.experts.down_proj_scales": rng.integers(0, 255, (E, h, i // 32), dtype=np.uint8),
        "model.layers.0.mlp.experts.down_proj_bias": rng.standard_normal((E, h)).astype(np.float32),
    }
    config = {"model_type": "gpt_oss", "num_hidden_layers": 1, "hidden_size": h, "num_local_experts": E,
              "num_experts_per_tok": 2, "intermediate_size": i, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 4, "vocab_size": 16}
    root = write(tmp_path / "ckpt", {"model.safetensors": t}, config=config)
    shard = _fused_join_round_trip(root, tmp_path)
    gu = t["model.layers.0.mlp.experts.gate_up_proj_blocks"][1]
    assert np.array_equal(shard["gate_proj.weight_blocks"], gu[0::2])
    assert np.array_equal(shard["up_proj.weight_blocks"], gu[1::2])
    assert np.array_equal(shard["up_proj.weight_scales"], t["model.layers.0.mlp.experts.gate_up_proj_scales"][1][1::2])
    assert np.array_equal(shard["down_proj.weight_blocks"], t["model.layers.0.mlp.experts.down_proj_blocks"][1])
    assert np.array_equal(shard["gate_proj.bias"], t["model.layers.0.mlp.experts.gate_up_proj_bias"][1][0::2])


def test_llama4_multimodal_prefix_and_vision_tower(tmp_path: Path) -> None:
    """Llama4ForConditionalGeneration: text under language_model.model., vision layers stay out of the text trunk."""
    p = "language_model.model."
    t = {
        f"{p}embed_tokens.weight": np.zeros((16, H), np.float32),
        f"{p}norm.weight": np.ones(H, np.float32),
        "language_model.lm_head.weight": np.zeros((16, H), np.float32),
        f"{p}layers.0.feed_forward.router.weight": np.zeros((E, H), np.float32),
        f"{p}layers.0.feed_forward.experts.gate_up_proj": np.arange(E * H * 2 * I, dtype=np.float32).reshape(E, H, 2 * I),
        f"{p}layers.0.feed_forward.experts.down_proj": np.arange(E * I * H, dtype=np.float32).reshape(E, I, H),
        f"{p}layers.0.feed_forward.shared_expert.gate_proj.weight": np.zeros((I, H), np.float32),
        "vision_model.model.layers.0.mlp.fc1.weight": np.zeros((4, 4), np.float32),
        "multi_modal_projector.linear_1.weight": np.zeros((4, 4), np.float32),
    }
    config = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
              "text_config": {"model_type": "llama4_text", "num_hidden_layers": 1, "hidden_size": H,
                              "num_local_experts": E, "num_experts_per_tok": 1, "intermediate_size": I,
                              "intermediate_size_mlp": 2 * I, "vocab_size": 16, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "head_dim": 4}}
    root = write(tmp_path / "ckpt", {"model.safetensors": t}, config=config)
    job = prepare_split(root)
    files = {o.path: {p.name for p in o.pieces} for o in job.outputs if not o.copy_from}
    assert files["trunk/embed.safetensors"] == {f"{p}embed_tokens.weight"}
    assert files["trunk/head.safetensors"] == {f"{p}norm.weight", "language_model.lm_head.weight"}
    assert files["trunk/layer-000.safetensors"] == {"feed_forward.router.weight",
                                                    "feed_forward.shared_expert.gate_proj.weight"}
    assert files["trunk/extra.safetensors"] == {"vision_model.model.layers.0.mlp.fc1.weight",
                                                "multi_modal_projector.linear_1.weight"}
    shard = _fused_join_round_trip(root, tmp_path)
    gu = t[f"{p}layers.0.feed_forward.experts.gate_up_proj"][1]
    assert np.array_equal(shard["gate_proj.weight"], gu[:, :I].T)
    assert np.array_equal(shard["up_proj.weight"], gu[:, I:].T)
    assert np.array_equal(shard["down_proj.weight"], t[f"{p}layers.0.feed_forward.experts.down_proj"][1].T)
