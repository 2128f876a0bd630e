"""gpt-oss numerics (transformers v5 `modeling_gpt_oss.py`): attention sinks, top-k-then-softmax routing, the
clamped SwiGLU of its experts, and reading one expert's tensors (float or MXFP4 blocks + scales, with biases).

Pure functions on float32 arrays; `_layers.py` and `_forward.py` call them where the config says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from shardtool import formats
from shardtool.errors import CheckpointFormatError

from ._config import ModelConfig
from ._dtypes import finite, weight_f32
from ._packed import Packed, pack


def sink_softmax(scores: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """# [kvh, g, T, S] (masked keys -inf), [kvh, g] -> [kvh, g, T, S]  (GptOssAttention's eager softmax)

    Each head's learned sink logit joins its softmax as one more key with no value, then is dropped: the
    probabilities of the real keys sum to less than one. Shifted by the row maximum over keys and sink, as
    transformers does, so the exponentials never overflow.
    """
    sink = sinks.astype(np.float32)[:, :, None, None]  # [kvh, g, 1, 1]
    top = np.maximum(np.max(scores, axis=-1, keepdims=True), sink)
    e = np.exp(scores - top)
    return e / (np.sum(e, axis=-1, keepdims=True) + np.exp(sink - top))


def route_topk_softmax(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """# [T, E] (biased) logits -> weights [T, k], expert ids [T, k], selection scores [T, E]  (GptOssTopKRouter)

    The k largest logits are chosen first; their softmax (over those k only) weights the experts. The selection
    scores are the logits themselves.
    """
    idx = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    top = np.take_along_axis(logits, idx, axis=-1)
    e = np.exp(top - np.max(top, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True), idx, logits


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """# [m, I], [m, I] -> [m, I]  (GptOssExperts._apply_gate)

    gate clamped above at `limit`, up clamped to [-limit, limit]; gate * sigmoid(alpha * gate) * (up + 1). The
    sigmoid as 1 / (1 + exp(-z)), like torch.sigmoid keeping its relative accuracy for very negative gates (the
    tanh form rounds them to 0); where exp overflows the result is 0, as it should be.
    """
    gate = np.minimum(gate, np.float32(limit))
    up = np.clip(up, np.float32(-limit), np.float32(limit))
    with np.errstate(over="ignore"):
        sig = np.float32(1.0) / (np.float32(1.0) + np.exp(np.float32(-alpha) * gate))
    return (up + np.float32(1.0)) * (gate * sig)


@dataclass(frozen=True)
class ExpertWeights:
    """One gpt-oss expert, nn.Linear orientation: gate/up [I, H], down [H, I] as stored (`Packed`), biases [I], [I],
    [H] float32."""

    gate: Packed
    up: Packed
    down: Packed
    gate_bias: np.ndarray
    up_bias: np.ndarray
    down_bias: np.ndarray


def expert_weights(cfg: ModelConfig, layer: int, expert: int, t: Mapping[str, np.ndarray]) -> ExpertWeights:
    """An expert shard's tensors, each checked against the config: matrices packed as stored, biases as float32.

    A projection is `<proj>.weight` (F32/F16/BF16), shardtool's block int8/int4 (`shardtool.formats`), or MXFP4
    `<proj>.weight_blocks` [out, in/32, 16] + `<proj>.weight_scales` [out, in/32] (U8), the latter only when
    config.json declares quant_method mxfp4.
    """
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    where = f"layer {layer} expert {expert}"
    known = {f"{p}.{s}" for p in ("gate_proj", "up_proj", "down_proj")
             for s in ("bias", *formats.FORM_SUFFIXES) if s != formats.FP8.scale}  # no FP8 experts here
    unknown = sorted(set(t) - known)
    if unknown:
        raise CheckpointFormatError(f"{where}: unexpected tensors {unknown[:4]} for a {cfg.model_type} expert")
    mats = [_matrix(cfg, where, t, name, shape)
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))]
    biases = []
    for name, size in (("gate_proj.bias", i), ("up_proj.bias", i), ("down_proj.bias", h)):
        if name not in t:
            if cfg.expert_bias:
                raise CheckpointFormatError(f"{where}: missing tensor {name}")
            biases.append(np.zeros(size, np.float32))
            continue
        b = finite(weight_f32(t, name), f"{where}: {name}")
        if b.shape != (size,):
            raise CheckpointFormatError(f"{where}: {name} has shape {b.shape}, expected {(size,)}")
        biases.append(b)
    return ExpertWeights(*mats, *biases)


def _matrix(cfg: ModelConfig, where: str, t: Mapping[str, np.ndarray], proj: str,
            shape: tuple[int, int]) -> Packed:
    """One projection in whichever stored form `pack` accepts (float, shardtool's int8/int4, or MXFP4 when
    config.json declares it), checked there."""
    return pack(t, proj, shape, where, mxfp4=cfg.mxfp4)
