"""The split planner: which output file each tensor of a checkpoint goes to, and how it is cut (`plan_split`).

Pure functions of config.json and the tensor names/shapes (see docs/shard-layout.md for the layout); what a
family's tensors look like comes from the family table (shardtool/families.py); the plan it returns is made of
the records in `_plan_records.py`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping

from shardtool.checkpoint._plan_records import Cut, Piece, ShardPlan
from shardtool.errors import CheckpointFormatError, UsageError
from shardtool.families import (BY_NAME, EXPERT_PROJ_ALIASES, FUSED, PER_EXPERT, detect_family,
                                expert_count, text_config)
from shardtool.hf_config import CONTRACT_INT_CAPS, ConfigReader
from shardtool.safetensors_format import TensorInfo
from shardtool.layout import EMBED, EXTRA, HEAD, expert_path, trunk_path
from shardtool.manifest import MAX_ENTRIES, MAX_EXPERT, MAX_LAYER

def compile_expert_pattern(pattern: str) -> re.Pattern[str]:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise UsageError(f"--expert-pattern is not a valid regular expression: {e}") from None
    missing = {"layer", "expert"} - set(rx.groupindex)
    if missing:
        raise UsageError(f"--expert-pattern lacks the named group(s) {', '.join(sorted(missing))}",
                         hint=r"e.g. 'model\.layers\.(?P<layer>\d+)\.moe\.experts\.(?P<expert>\d+)\.'")
    return rx


@dataclass(frozen=True)
class _Routed:
    layer: int
    expert: int | None   # None for a fused tensor (all experts)
    name: str            # canonical name (per-expert) or the fused projection key
    prefix: str


def _classify(name: str, custom: re.Pattern[str] | None) -> _Routed | None:
    if custom is not None:
        m = custom.match(name)
        if m:
            canonical = m.groupdict().get("name") or name[m.end():].lstrip(".")
            if not canonical:
                raise UsageError(f"--expert-pattern matches all of {name!r}, leaving no tensor name",
                                 hint="add a named group 'name' or stop the pattern before the projection name")
            matched = m.group(0)
            prefix = matched[:matched.index("layers.")] if "layers." in matched else "model."
            return _Routed(_index(m["layer"], name), _index(m["expert"], name), canonical, prefix)
    m = PER_EXPERT.fullmatch(name)
    if m:
        proj = EXPERT_PROJ_ALIASES.get(m["proj"], m["proj"])
        return _Routed(int(m["layer"]), int(m["expert"]), f"{proj}.{m['suffix']}", m["prefix"])
    m = FUSED.fullmatch(name)
    if m:
        return _Routed(int(m["layer"]), None, f"{m['proj']}:{m['part'] or 'weight'}", m["prefix"])
    return None


def _index(digits: str | None, name: str) -> int:
    """A layer or expert number matched by --expert-pattern (whose groups could match anything)."""
    if digits is None or not digits.isascii() or not digits.isdigit():
        raise UsageError(f"--expert-pattern matched {digits!r} as a layer/expert number in {name!r}",
                         hint="the groups 'layer' and 'expert' must match digits, e.g. (?P<layer>\\d+)")
    return int(digits)


def _check_index(value: int, cap: int, what: str, name: str) -> int:
    """Layer and expert numbers must fit the manifest format (manifest/_records.py), checked while planning."""
    if value > cap:
        raise CheckpointFormatError(f"tensor {name!r} has {what} {value}, beyond the largest the manifest format "
                                    f"allows ({cap})")
    return value


def _fused_cuts(family: str, key: str, info: TensorInfo, hidden: int | None) -> list[tuple[str, Cut]]:
    """Canonical (name, cut) pairs for one fused tensor, per the family's layout."""
    proj, part = key.split(":")
    shape = info.shape
    slice_shape = shape[1:]

    def bad(expected: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"fused tensor {info.name!r} has shape {list(shape)}, expected {expected} "
                                     f"for the {family} layout")

    canon = {"weight": "weight", "bias": "bias", "blocks": "weight_blocks", "scales": "weight_scales"}[part]
    layout = BY_NAME[family].fused_layout if family in BY_NAME else "out_in"
    interleaved = layout == "in_out_interleaved"
    # Which axis of S carries the output features, and whether the weight is stored [in, out].
    if part == "weight" and layout != "out_in":
        axis, transpose = 1, True        # [E, H, 2I] and [E, I, H]: nn.Linear orientation is the transpose
    else:
        axis, transpose = 0, False       # [E, 2I, H], [E, H, I], biases [E, 2I], MXFP4 blocks [E, 2I, G, 16]
    if len(slice_shape) < axis + 1 or (transpose and len(slice_shape) != 2):
        raise bad("a 3-D [E, in, out] tensor" if transpose else "[E, out, ...]")
    if part in ("weight", "blocks", "scales") and len(slice_shape) < 2:
        raise bad("[E, out, in, ...]")
    if hidden is not None and part == "weight":
        in_axis = 0 if transpose else 1
        if proj == "gate_up_proj" and slice_shape[in_axis] != hidden:
            raise bad(f"hidden_size {hidden} on axis {in_axis + 1}")
        if proj == "down_proj" and slice_shape[axis] != hidden:
            raise bad(f"hidden_size {hidden} on axis {axis + 1}")
    if proj == "down_proj":
        return [(f"down_proj.{canon}", Cut(axis, 0, 1, slice_shape[axis], transpose))]
    two_i = slice_shape[axis]
    if two_i % 2:
        raise bad("an even gate+up width")
    half = two_i // 2
    if interleaved:  # gate = [..., ::2], up = [..., 1::2]
        return [(f"gate_proj.{canon}", Cut(axis, 0, 2, half, transpose)),
                (f"up_proj.{canon}", Cut(axis, 1, 2, half, transpose))]
    return [(f"gate_proj.{canon}", Cut(axis, 0, 1, half, transpose)),
            (f"up_proj.{canon}", Cut(axis, half, 1, half, transpose))]


# The producer's caps (split, inspect, the contract): arithmetic caps, and no more layers than a manifest names.
PRODUCER_INT_CAPS = {**CONTRACT_INT_CAPS, "num_hidden_layers": MAX_LAYER + 1}


def config_reader(config: Mapping[str, Any]) -> ConfigReader:
    """config.json's language-model fields, read with the producer's caps."""
    return ConfigReader(text_config(config), int_caps=PRODUCER_INT_CAPS)


def decoder_layers(config: Mapping[str, Any]) -> int | None:
    """num_hidden_layers; layers stored at or past it are DeepSeek multi-token-prediction layers."""
    return config_reader(config).int("num_hidden_layers", None, minimum=0)


def expected_experts(config: Mapping[str, Any]) -> int | None:
    """Routed experts per layer as config.json states it; None for a --expert-pattern layout."""
    family = BY_NAME.get(detect_family(config, custom_ok=True))
    if family is None:
        return None
    return expert_count(family, config_reader(config))[1]


def plan_split(config: Mapping[str, Any], tensors: Mapping[str, tuple[TensorInfo, str]], *,
               expert_pattern: str | None = None) -> tuple[str, list[ShardPlan]]:
    """(family, output files) for a checkpoint whose tensors are `name -> (info, source file)`."""
    custom = compile_expert_pattern(expert_pattern) if expert_pattern else None
    family = detect_family(config, custom_ok=custom is not None)
    n_layers = decoder_layers(config)
    hidden = config_reader(config).int("hidden_size", None, minimum=0)

    routed = _routed_tensors(tensors, custom)
    prefix = _model_prefix(routed, family, custom)
    layer_rx = re.compile(re.escape(prefix) + r"layers\.(\d+)\.(.+)")

    def is_extra_layer(layer: int) -> bool:  # DeepSeek MTP layers sit at index >= num_hidden_layers
        return n_layers is not None and layer >= n_layers

    trunk: dict[str, list[Piece]] = defaultdict(list)
    trunk_layer: dict[str, int | None] = {}
    experts: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for name, (info, file) in tensors.items():
        r = routed.get(name)
        if r is not None and not is_extra_layer(r.layer):
            if r.expert is not None:
                experts[(r.layer, r.expert)].append(Piece(r.name, info.dtype, info.shape, info, file))
                continue
            _add_fused(experts, family, name, r, info, file, hidden)
            continue
        m = layer_rx.fullmatch(name)
        if m:
            layer = _check_index(int(m[1]), MAX_LAYER, "layer", name)
            path = trunk_path(layer)
            trunk[path].append(Piece(m[2], info.dtype, info.shape, info, file))
            trunk_layer[path] = layer
        else:
            path = _non_layer_file(name, prefix)
            trunk[path].append(Piece(name, info.dtype, info.shape, info, file))
            trunk_layer[path] = None

    _check_experts(experts, expected_experts(config))
    order = lambda p: (p.file, p.source.start, p.expert or 0, p.cut.start if p.cut else 0)  # noqa: E731
    plans = [ShardPlan(path, "trunk", trunk_layer[path], None, tuple(sorted(pieces, key=order)))
             for path, pieces in trunk.items()]
    plans += [ShardPlan(expert_path(layer, e), "expert", layer, e,
                        tuple(sorted(pieces, key=order)))
              for (layer, e), pieces in experts.items()]
    for plan in plans:
        _check_unique(plan)
    # Process outputs in source order so the source files are read front to back.
    plans.sort(key=lambda p: order(p.pieces[0]))
    return family, plans


def _routed_tensors(tensors: Mapping[str, tuple[TensorInfo, str]], custom: re.Pattern[str] | None
                    ) -> dict[str, _Routed]:
    """The routed-expert tensors by name, their layer and expert numbers checked against the manifest's caps."""
    routed = {name: r for name in tensors if (r := _classify(name, custom)) is not None}
    for name, r in routed.items():
        _check_index(r.layer, MAX_LAYER, "layer", name)
        if r.expert is not None:
            _check_index(r.expert, MAX_EXPERT, "expert", name)
    return routed


def _model_prefix(routed: Mapping[str, _Routed], family: str, custom: re.Pattern[str] | None) -> str:
    """The one prefix ("model.", "model.language_model.", ...) the expert tensors sit under, which the trunk's
    names are read against."""
    prefixes = {r.prefix for r in routed.values()}
    if not routed:
        raise CheckpointFormatError(
            f"no routed-expert tensors found in this {family} checkpoint",
            hint="is it a dense model? for an unusual layout pass --expert-pattern REGEX")
    if len(prefixes) > 1 and custom is None:
        raise CheckpointFormatError(f"expert tensors under several model prefixes: {sorted(prefixes)}")
    return prefixes.pop() if len(prefixes) == 1 else "model."


def _add_fused(experts: dict[tuple[int, int], list[Piece]], family: str, name: str, r: _Routed, info: TensorInfo,
               file: str, hidden: int | None) -> None:
    """One fused [E, ...] tensor's pieces, a cut of it per canonical tensor, added to each of its E experts."""
    if len(info.shape) < 2 or info.shape[0] == 0:
        raise CheckpointFormatError(f"fused expert tensor {name!r} has shape {list(info.shape)}, "
                                    "expected [E, ...]")
    _check_index(info.shape[0] - 1, MAX_EXPERT, "expert", name)
    for canonical, c in _fused_cuts(family, r.name, info, hidden):
        out_shape = c.out_shape(info.shape[1:])
        for e in range(info.shape[0]):
            experts[(r.layer, e)].append(Piece(canonical, info.dtype, out_shape, info, file, e, c))
        if len(experts) > MAX_ENTRIES:  # before a hostile [10^6, 0] tensor per layer eats the memory
            raise CheckpointFormatError(f"more than {MAX_ENTRIES} expert files, the most a manifest holds")


def _non_layer_file(name: str, prefix: str) -> str:
    if name == f"{prefix}embed_tokens.weight":
        return EMBED
    if name in (f"{prefix}norm.weight", f"{prefix}norm.bias") or name.endswith("lm_head.weight"):
        return HEAD
    return EXTRA


def _check_experts(experts: Mapping[tuple[int, int], list[Piece]], expected: int | None) -> None:
    by_layer: dict[int, dict[int, list[Piece]]] = defaultdict(dict)
    for (layer, e), pieces in experts.items():
        by_layer[layer][e] = pieces
    if by_layer and expected is not None and not 0 < expected <= MAX_EXPERT + 1:
        raise CheckpointFormatError(f"the number of routed experts per layer is {expected}, expected 1 to "
                                    f"{MAX_EXPERT + 1}", path="config.json")
    for layer, found in sorted(by_layer.items()):
        count = expected if expected is not None else max(found) + 1
        missing = sorted(set(range(count)) - set(found))
        extra = sorted(set(found) - set(range(count)))
        if missing or extra:
            detail = []
            if missing:
                detail.append(f"missing expert(s) {_ranges(missing)}")
            if extra:
                detail.append(f"unexpected expert(s) {_ranges(extra)}")
            raise CheckpointFormatError(f"layer {layer}: {'; '.join(detail)} (expected {count} experts)")
        reference = {p.name: (p.dtype, p.shape) for p in found[0]}
        for e, pieces in sorted(found.items()):
            got = {p.name: (p.dtype, p.shape) for p in pieces}
            if got != reference:
                diff = sorted(set(got.items()) ^ set(reference.items()))
                raise CheckpointFormatError(f"layer {layer} expert {e}: tensors differ from expert 0: "
                                            f"{', '.join(f'{n} {d}{list(s)}' for n, (d, s) in diff[:4])}")


def _check_unique(plan: ShardPlan) -> None:
    seen: dict[str, str] = {}
    for p in plan.pieces:
        if p.name in seen:
            raise CheckpointFormatError(f"{plan.path}: tensors {seen[p.name]!r} and {p.source.name!r} both map to "
                                        f"{p.name!r}")
        seen[p.name] = p.source.name


def _ranges(values: list[int]) -> str:
    shown = ", ".join(map(str, values[:8]))
    return shown + (f" and {len(values) - 8} more" if len(values) > 8 else "")
