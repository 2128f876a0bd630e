"""Tiny random transformers models as the reference for the numpy forward pass (imports torch lazily)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from shardtool.families import BY_NAME
from shardtool.blockquant import quantize_fp8
from shardtool.runtime.model import dequantize
from shardtool.runtime.model._dtypes import quantize_mxfp4

_SMALL = dict(vocab_size=256, hidden_size=64, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, initializer_range=0.05)


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    return {
        # sliding_window=5 < prompt length, so the windowed mask is exercised in prefill and decode.
        "mixtral": lambda: tf.MixtralConfig(
            **_SMALL, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=6, num_experts_per_tok=2, sliding_window=5),
        # Shared expert behind a sigmoid gate, q/k/v bias, un-normalized top-k, a dense layer (mlp_only_layers).
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            **_SMALL, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False, mlp_only_layers=[1]),
        # Per-head q/k norm, head_dim != hidden/heads, decoder_sparse_step=2 (layers 0, 2 dense), tied embeddings.
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **_SMALL, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
            decoder_sparse_step=2, tie_word_embeddings=True),
        # q/k norm over the whole projection, clip_qkv small enough to clip.
        "olmoe": lambda: tf.OlmoeConfig(
            **_SMALL, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=8, num_experts_per_tok=2, clip_qkv=0.8, norm_topk_prob=False),
        # MLA with q_lora_rank, interleaved rope, group-limited sigmoid routing, one dense layer first.
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **_SMALL, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, norm_topk_prob=True),
        # q_lora_rank=None, YaRN with mscale != mscale_all_dim (cos/sin and softmax scale both change),
        # rope_interleave off, 4 groups pick 2, top-3 without normalization.
        "deepseek_v3_yarn": lambda: tf.DeepseekV3Config(
            **{**_SMALL, "max_position_embeddings": 128}, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=1.5,
            first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, norm_topk_prob=False, rope_interleave=False,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                          "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}),
        # Llama 4: dense and MoE layers interleaved, a shared expert, the top-1 sigmoid router scaling the expert
        # input, attention chunks of 5 (< the 8-token prompt), a NoPE layer (2) whose temperature tuning acts
        # from position 1 on (floor_scale 2), L2 q/k norm on the RoPE layers.
        "llama4": lambda: tf.Llama4TextConfig(
            **_SMALL, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=1,
            interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1], attention_chunk_size=5, floor_scale=2,
            attn_scale=0.5, use_qk_norm=True),
        # Llama 4 with top-2 (each expert gets its own scaled input), MoE layers listed, llama3 RoPE scaling
        # with a medium band, no q/k norm, no chunking, NoPE layer 1 without temperature tuning.
        "llama4_llama3": lambda: tf.Llama4TextConfig(
            **_SMALL, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, moe_layers=[0, 2],
            no_rope_layers=[1, 0, 1], attention_chunk_size=None, attn_temperature_tuning=False, use_qk_norm=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        # Sinks, router and expert biases, a SwiGLU limit small enough to clamp, sliding_window=5 < prompt length on
        # the sliding layers (0, 2) only, YaRN (the config-class default, truncate off), head_dim != hidden/heads.
        "gpt_oss": lambda: tf.GptOssConfig(
            **_SMALL, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, num_local_experts=8, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.6),
    }


FAMILY_CASES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v3_yarn", "llama4",
                "llama4_llama3", "gpt_oss")


def build(case: str, seed: int = 0):
    """A random tiny transformers model for `case`, eager attention, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _configs()[case]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        # transformers initializes norms to 1 and biases to 0, which would hide a skipped norm or bias.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            elif name.endswith((".bias", "_bias")):
                p.copy_(0.1 * torch.randn(p.shape))
            elif name.endswith(".sinks"):  # gpt-oss: as large as the attention logits, so they take real weight
                p.copy_(torch.randn(p.shape))
        for layer in model.model.layers:
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                # Non-zero, and as large as the score spread, so the bias really changes which experts win.
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.05)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def config_dict(model) -> dict[str, Any]:
    """config.json as save_pretrained writes it."""
    return json.loads(model.config.to_json_string(use_diff=False))


def state_dict(model) -> dict[str, np.ndarray]:
    """The in-memory state dict (transformers v5: fused 3-D expert tensors) as float32 numpy."""
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def saved_state(model, directory: Path) -> dict[str, np.ndarray]:
    """What save_pretrained writes (per-expert tensors, legacy Mixtral names), read back as numpy."""
    from safetensors.numpy import load_file

    model.save_pretrained(directory)
    out: dict[str, np.ndarray] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def is_quantized_linear(name: str, array: np.ndarray) -> bool:
    """The tensors DeepSeek-V3 stores in FP8: 2-D projection weights; not embeddings, head, router or norms."""
    projection = name.endswith(("proj.weight", "proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight"))
    return array.ndim == 2 and projection


def lower_precision(state: Mapping[str, np.ndarray], kind: str,
                    block: tuple[int, int]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(stored, dequantized): `stored` as a checkpoint would hold it, `dequantized` the float32 it means."""
    stored: dict[str, np.ndarray] = {}
    exact: dict[str, np.ndarray] = {}
    for name, a in state.items():
        if kind in ("bfloat16", "float16") and a.ndim >= 1 and not name.endswith("e_score_correction_bias"):
            low = a.astype(ml_dtypes.bfloat16 if kind == "bfloat16" else np.float16)
            stored[name], exact[name] = low, low.astype(np.float32)
        elif kind == "float8" and is_quantized_linear(name, a):
            q, scale = quantize_fp8(a, block)
            stored[name], stored[name + "_scale_inv"] = q, scale
            exact[name] = dequantize(q, scale, block)
        else:
            stored[name], exact[name] = a, a
    return stored, exact


def load_weights(model, directory: Path, weights: Mapping[str, np.ndarray]):
    """A fresh transformers model of `model`'s config with `weights` (on-disk names), via from_pretrained."""
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    model.config.save_pretrained(directory)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype="float32").eval()
    loaded.generation_config.eos_token_id = None
    loaded.generation_config.pad_token_id = 0
    return loaded


def fused_layout(config: Mapping[str, Any]) -> str:
    """How the family of a config.json dict fuses its expert tensors (the family table's row)."""
    return next(f.fused_layout for f in BY_NAME.values() if config["model_type"] in f.model_types)


MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def to_mxfp4(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gpt-oss's fused expert weights ([E, in, out], as save_pretrained writes them) as the released checkpoints
    store them: U8 `*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32]; everything else unchanged."""
    out: dict[str, np.ndarray] = {}
    for name, a in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            pairs = [quantize_mxfp4(np.ascontiguousarray(a[e].T)) for e in range(a.shape[0])]
            out[name + "_blocks"] = np.stack([b for b, _ in pairs])
            out[name + "_scales"] = np.stack([s for _, s in pairs])
        else:
            out[name] = a
    return out


def load_mxfp4(directory: Path):
    """transformers' own reading of an MXFP4 checkpoint (its dequantization to float32 on a CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    loaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    loaded.generation_config.eos_token_id = None
    loaded.generation_config.pad_token_id = 0
    return loaded


def write_mxfp4(model, directory: Path) -> dict[str, np.ndarray]:
    """`model` saved as an MXFP4 checkpoint in `directory` (config with quantization_config); the stored tensors."""
    from safetensors.numpy import save_file

    stored = to_mxfp4(saved_state(model, directory))
    for f in directory.glob("*.safetensors*"):
        f.unlink()
    save_file({k: np.ascontiguousarray(v) for k, v in stored.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return stored
