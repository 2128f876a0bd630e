"""How weights reach the forward pass: the `WeightProvider` protocol and an in-memory provider.

The forward pass never opens a file. The verifying shard store implements `WeightProvider` for real
checkpoints; `DictWeightProvider` serves a flat Hugging Face state dict (tests, small models).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np

from shardtool import formats
from shardtool.errors import CheckpointFormatError
from shardtool.families import EXPERT_PROJ_ALIASES, FUSED, PER_EXPERT

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

_EXPERT_SUFFIXES = (*formats.FORM_SUFFIXES, "bias")  # every stored form's tensors (shardtool.formats)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_T = TypeVar("_T")


class Tensors(dict):
    """One shard's arrays by name, and what the forward pass derives from them once (`derived`): checked, packed
    weights that are views of these arrays, so they live exactly as long as the shard (cached or in use) and add
    no bytes beyond it."""

    __slots__ = ("memo",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memo: dict[str, object] = {}


def derived(arrays: Mapping[str, np.ndarray], key: str, owner: object,
            make: Callable[[Mapping[str, np.ndarray]], _T]) -> _T:
    """`make(arrays)`, computed once per `Tensors`, `key` and `owner` (the config it was checked against) and kept
    beside them; recomputed each time for any other mapping (a provider that does not hand out `Tensors`)."""
    memo = getattr(arrays, "memo", None)
    if memo is None:
        return make(arrays)
    hit = memo.get(key)
    if hit is not None and hit[0] is owner:
        return hit[1]  # type: ignore[return-value]
    value = make(arrays)
    memo[key] = (owner, value)
    return value


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
        up_proj.weight [I, H], down_proj.weight [H, I] (+ *.weight_scale_inv; gpt-oss: *.bias, and MXFP4
        *.weight_blocks + *.weight_scales instead of *.weight). All ids are asked for at once so an
        implementation can load them in parallel."""
        ...


@runtime_checkable
class Prefetcher(Protocol):
    """A provider that can start loading experts before the forward pass asks for them: how the lookahead reaches
    I/O without knowing what is behind it. `lookahead`: whether it takes guesses now (it may refuse them, e.g. when
    its cache cannot hold them beside the layer computing)."""

    lookahead: bool

    def prefetch_experts(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Start loading routed experts `expert_ids` of `layer` (most wanted first); errors surface only when the
        forward pass asks for them."""
        ...


class DictWeightProvider:
    """A `WeightProvider` over a flat Hugging Face state dict of numpy arrays.

    Accepts both what `save_pretrained` writes (per-expert tensors; Mixtral's `block_sparse_moe.experts.E.w1`)
    and what transformers v5 `state_dict()` holds (fused `mlp.experts.gate_up_proj [E, 2I, H]`,
    `mlp.experts.down_proj [E, H, I]`), and serves experts under the canonical names.
    """

    def __init__(self, state: Mapping[str, np.ndarray], *, fused_layout: str = "out_in"):
        """`fused_layout`: how fused [E, ...] expert tensors are laid out (the family table's `fused_layout`)."""
        self._embed = Tensors()
        self._head = Tensors()
        self._layers: dict[int, Tensors] = {}
        self._experts: dict[int, dict[int, Tensors]] = {}
        fused: dict[int, dict[str, np.ndarray]] = {}
        for name, array in state.items():
            if name == "model.embed_tokens.weight":
                self._embed[name] = array
            elif name in ("model.norm.weight", "lm_head.weight"):
                self._head[name] = array
            elif (m := PER_EXPERT.fullmatch(name)) and m["prefix"] == "model." and m["suffix"] in _EXPERT_SUFFIXES:
                layer, expert, proj = int(m["layer"]), int(m["expert"]), m["proj"]
                proj = EXPERT_PROJ_ALIASES.get(proj, proj)
                self._experts.setdefault(layer, {}).setdefault(expert, Tensors())[f"{proj}.{m['suffix']}"] = array
            elif (m := FUSED.fullmatch(name)) and m["prefix"] == "model.":
                part = f"_{m['part']}" if m["part"] else ""
                fused.setdefault(int(m["layer"]), {})[m["proj"] + part] = array
            elif m := _LAYER.fullmatch(name):
                self._layers.setdefault(int(m[1]), Tensors())[m[2]] = array
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


def _unfuse(layer: int, parts: Mapping[str, np.ndarray], layout: str) -> dict[int, Tensors]:
    """# the fused [E, ...] tensors of one layer -> per expert, under the canonical names (views).

    "out_in": gate_up_proj [E, 2I, H] = cat(gate, up), down_proj [E, H, I]; "in_out": [E, H, 2I] and [E, I, H]
    (transposed per expert); "in_out_interleaved" (gpt-oss): as in_out with gate/up alternating. Biases
    gate_up_proj_bias [E, 2I] / down_proj_bias [E, H] and MXFP4 `*_blocks` [E, out, G, 16] / `*_scales`
    [E, out, G] are always output-major. Shapes against the config are checked when an expert is used.
    """
    if layout not in ("out_in", "in_out", "in_out_interleaved"):
        raise CheckpointFormatError(f"unknown fused expert layout {layout!r}")
    transposed = layout != "out_in"
    interleaved = layout == "in_out_interleaved"
    gate_up = [k for k in parts if k.startswith("gate_up_proj")]
    down = [k for k in parts if k.startswith("down_proj")]
    counts = {parts[k].shape[0] if parts[k].ndim else 0 for k in parts}
    if not gate_up or not down or len(counts) != 1 or any(parts[k].ndim < 2 for k in parts):
        raise CheckpointFormatError(f"layer {layer}: fused experts need gate_up_proj and down_proj tensors with one "
                                    f"leading expert axis", hint=f"got {sorted((k, parts[k].shape) for k in parts)}")
    n = counts.pop()
    _check_fused_shapes(layer, parts, n, transposed)
    experts: dict[int, Tensors] = {e: Tensors() for e in range(n)}
    for key, array in parts.items():
        proj, _, part = key.partition("_proj")
        suffix = {"": "weight", "_bias": "bias", "_blocks": "weight_blocks", "_scales": "weight_scales"}[part]
        for e, x in experts.items():
            piece = array[e].T if part == "" and transposed else array[e]  # output features first
            if proj == "down":
                x[f"down_proj.{suffix}"] = piece
                continue
            rows = piece.shape[0]
            if rows % 2:
                raise CheckpointFormatError(f"layer {layer}: fused {key} has an odd gate+up width {rows}")
            gate, up = (piece[0::2], piece[1::2]) if interleaved else (piece[:rows // 2], piece[rows // 2:])
            x[f"gate_proj.{suffix}"], x[f"up_proj.{suffix}"] = gate, up
    return experts


def _check_fused_shapes(layer: int, parts: Mapping[str, np.ndarray], n: int, transposed: bool) -> None:
    """Every fused part agrees with the intermediate and hidden sizes its down projection implies."""
    group = formats.MXFP4.block[1]
    if "down_proj" in parts:
        d = parts["down_proj"]
        if d.ndim != 3:
            raise CheckpointFormatError(f"layer {layer}: fused down_proj has shape {d.shape}, expected 3-D")
        i, h = (d.shape[1], d.shape[2]) if transposed else (d.shape[2], d.shape[1])
    elif "down_proj_blocks" in parts and parts["down_proj_blocks"].ndim == 4:
        _, h, groups, _ = parts["down_proj_blocks"].shape
        i = groups * group
    else:
        raise CheckpointFormatError(f"layer {layer}: fused experts need down_proj or a 4-D down_proj_blocks",
                                    hint=f"got {sorted((k, parts[k].shape) for k in parts)}")
    expected = {"gate_up_proj": (n, h, 2 * i) if transposed else (n, 2 * i, h),
                "down_proj": (n, i, h) if transposed else (n, h, i),
                "gate_up_proj_bias": (n, 2 * i), "down_proj_bias": (n, h),
                "gate_up_proj_blocks": (n, 2 * i, h // group, group // 2), "gate_up_proj_scales": (n, 2 * i, h // group),
                "down_proj_blocks": (n, h, i // group, group // 2), "down_proj_scales": (n, h, i // group)}
    for key, array in parts.items():
        if array.shape != expected[key]:
            raise CheckpointFormatError(f"layer {layer}: fused {key} has shape {array.shape}, expected "
                                        f"{expected[key]} beside the others", hint=f"intermediate {i}, hidden {h}")
