"""How weights reach the forward pass: the `WeightProvider` protocol and an in-memory provider.

The forward pass never opens a file. The verifying shard store implements `WeightProvider` for real
checkpoints; `DictWeightProvider` serves a flat Hugging Face state dict (tests, small models).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from shardtool.errors import CheckpointFormatError
from shardtool.families import EXPERT_PROJ_ALIASES, FUSED, PER_EXPERT

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

_EXPERT_SUFFIXES = ("weight", "weight_scale_inv", "bias")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


@runtime_checkable
class WeightProvider(Protocol):
    """Arrays in their stored dtype (float32, float16, bfloat16, float8_e4m3fn + float32 block scales).

    Optional attribute `cache_float32: bool` (default False): when true, the model keeps its float32
    conversions of trunk tensors (embed, head, layers) instead of redoing them each step. It trades
    memory for speed, so the provider (which owns the memory budget) decides.
    """

    def embed(self) -> Mapping[str, np.ndarray]:
        """{"model.embed_tokens.weight": [V, H]}"""
        ...

    def head(self) -> Mapping[str, np.ndarray]:
        """{"model.norm.weight": [H], "lm_head.weight": [V, H] (absent when tied)}"""
        ...

    def layer(self, layer: int) -> Mapping[str, np.ndarray]:
        """Trunk tensors of decoder layer `layer`, Hugging Face names without "model.layers.{layer}."."""
        ...

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Mapping[str, np.ndarray]]:
        """Routed experts of `layer`, each under the canonical names gate_proj.weight [I, H],
        up_proj.weight [I, H], down_proj.weight [H, I] (+ *.weight_scale_inv). All ids are asked for at
        once so an implementation can load them in parallel."""
        ...


class DictWeightProvider:
    """A `WeightProvider` over a flat Hugging Face state dict of numpy arrays.

    Accepts both what `save_pretrained` writes (per-expert tensors; Mixtral's `block_sparse_moe.experts.E.w1`)
    and what transformers v5 `state_dict()` holds (fused `mlp.experts.gate_up_proj [E, 2I, H]`,
    `mlp.experts.down_proj [E, H, I]`), and serves experts under the canonical names.
    """

    def __init__(self, state: Mapping[str, np.ndarray], *, cache_float32: bool = False, fused_layout: str = "out_in"):
        """`fused_layout`: the family's (shardtool/families.py): "out_in" [E, 2I, H] / [E, H, I], or "in_out"
        [E, H, 2I] / [E, I, H] (Llama 4)."""
        self.cache_float32 = cache_float32
        self._embed: dict[str, np.ndarray] = {}
        self._head: dict[str, np.ndarray] = {}
        self._layers: dict[int, dict[str, np.ndarray]] = {}
        self._experts: dict[int, dict[int, dict[str, np.ndarray]]] = {}
        fused: dict[int, dict[str, np.ndarray]] = {}
        for name, array in state.items():
            if name == "model.embed_tokens.weight":
                self._embed[name] = array
            elif name in ("model.norm.weight", "lm_head.weight"):
                self._head[name] = array
            elif (m := PER_EXPERT.fullmatch(name)) and m["prefix"] == "model." and m["suffix"] in _EXPERT_SUFFIXES:
                layer, expert, proj = int(m["layer"]), int(m["expert"]), m["proj"]
                proj = EXPERT_PROJ_ALIASES.get(proj, proj)
                self._experts.setdefault(layer, {}).setdefault(expert, {})[f"{proj}.{m['suffix']}"] = array
            elif (m := FUSED.fullmatch(name)) and m["prefix"] == "model." and m["part"] is None:
                fused.setdefault(int(m["layer"]), {})[m["proj"]] = array
            elif m := _LAYER.fullmatch(name):
                self._layers.setdefault(int(m[1]), {})[m[2]] = array
            # Anything else (rotary buffers, vision towers) is not part of the decoder.
        for layer, parts in fused.items():
            self._experts[layer] = _unfuse(layer, parts, fused_layout)

    def embed(self) -> Mapping[str, np.ndarray]:
        return self._embed

    def head(self) -> Mapping[str, np.ndarray]:
        return self._head

    def layer(self, layer: int) -> Mapping[str, np.ndarray]:
        if layer not in self._layers:
            raise CheckpointFormatError(f"no tensors for decoder layer {layer}")
        return self._layers[layer]

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Mapping[str, np.ndarray]]:
        have = self._experts.get(layer, {})
        missing = [e for e in expert_ids if e not in have]
        if missing:
            raise CheckpointFormatError(f"layer {layer}: no tensors for routed experts {missing}")
        return {e: have[e] for e in expert_ids}


def _unfuse(layer: int, parts: Mapping[str, np.ndarray], layout: str = "out_in") -> dict[int, dict[str, np.ndarray]]:
    """# gate_up_proj [E, 2I, H], down_proj [E, H, I] -> per expert gate/up [I, H], down [H, I] (views);
    "in_out": the same tensors stored transposed ([E, H, 2I], [E, I, H])."""
    gate_up, down = parts.get("gate_up_proj"), parts.get("down_proj")
    if gate_up is None or down is None or down.ndim != 3 or gate_up.ndim != 3:
        raise CheckpointFormatError(f"layer {layer}: fused experts need 3-D gate_up_proj and down_proj",
                                    hint=f"got {sorted(parts)}")
    if layout == "in_out":
        gate_up, down = gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1)
    e, h, i = down.shape
    if gate_up.shape != (e, 2 * i, h):
        raise CheckpointFormatError(f"layer {layer}: fused gate_up_proj shape {gate_up.shape}, "
                                    f"expected {(e, 2 * i, h)} beside down_proj {down.shape}")
    return {x: {"gate_proj.weight": gate_up[x, :i], "up_proj.weight": gate_up[x, i:],
                "down_proj.weight": down[x]} for x in range(e)}
