"""A routed expert's projections checked while planning a split, before anything is written or signed.

Every split: each `gate_proj`/`up_proj`/`down_proj` data tensor (float, FP8 or int8 `weight`, int4 `weight_q4`,
MXFP4 `weight_blocks`) must stand for the [out, in] that config.json's hidden and expert intermediate sizes give,
and the tensors shaped by it must agree: an int8/int4 weight's float16 block scales `weight_scale` [out, in/32]
(its input width a multiple of 32), MXFP4's `weight_scales` [out, in/32], FP8's `weight_scale_inv` [out/b0, in/b1]
rounded up (config.json's `weight_block_size`, 128 x 128 unless it says), a `bias` [out] (`check_expert_plans`).
Otherwise the publisher would sign shards that every run then refuses at their first use: these are the shapes the
runtime's loader (`pack`) demands, and a unit test hands it tensors of exactly these shapes. Dtypes and values stay
the loader's concern. `split --quantize` also holds each projection to exactly one stored form (`check_forms`, the
rule the runtime's loader applies to what it writes); a plain split keeps the source's tensors as they are (some
FP8 checkpoints name their block scales `weight_scale`), so only their shapes are its concern.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from shardtool import formats
from shardtool.checkpoint._plan_records import Piece, ShardPlan
from shardtool.errors import CheckpointFormatError
from shardtool.families import EXPERT_PROJECTIONS


def expected_shapes(config: Mapping[str, Any], family: str) -> dict[str, tuple[int | None, int | None]]:
    """[out, in] of each routed-expert projection as config.json states it (hidden size H, the family's expert
    intermediate size I: gate/up [I, H], down [H, I]); None where config.json does not say (a custom layout)."""
    from shardtool.checkpoint._split_plan import config_reader
    from shardtool.families import BY_NAME

    r = config_reader(config)
    h = r.int("hidden_size", None, minimum=1)
    fam = BY_NAME.get(family)
    i = r.int(fam.expert_size_key, None, minimum=1) if fam is not None else None
    return {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def fp8_block(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """config.json's FP8 `quantization_config.weight_block_size` (the table's 128 x 128 unless it says); None where
    it is not two positive integers (the runtime refuses such a config when it loads it)."""
    quant = config.get("quantization_config")
    default = list(formats.FP8.block)
    block = quant.get("weight_block_size", default) if isinstance(quant, Mapping) else default
    if (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 20 for b in block)):
        return block[0], block[1]
    return None


def check_expert_plans(plans: Sequence[ShardPlan], shapes: Mapping[str, tuple[int | None, int | None]],
                       block: tuple[int, int] | None = formats.FP8.block) -> None:
    """Every routed-expert projection's data tensor of the shape `shapes` (from `expected_shapes`) gives, read as
    the weight its form stands for, and the tensors beside it (`beside`) of the shapes that weight gives them;
    `block`: FP8's scale block (`fp8_block`). Raises CheckpointFormatError naming the source tensor."""
    for plan in plans:
        if plan.kind != "expert":
            continue
        named = {p.name: p for p in plan.pieces}
        for p in plan.pieces:
            proj, _, form = p.name.partition(".")
            if proj not in EXPERT_PROJECTIONS or form not in _WEIGHT_OF_FORM:
                continue
            weight = _WEIGHT_OF_FORM[form](tuple(p.shape))
            check_shape(plan, p, proj, weight, shapes.get(proj, (None, None)))
            assert weight is not None  # (check_shape refused every other)
            for suffix, want in beside(form, p.dtype, weight, block).items():
                other = named.get(f"{proj}.{suffix}")
                if want is None:
                    raise CheckpointFormatError(f"layer {plan.layer} expert {plan.expert}: {proj} (from "
                                                f"{p.source.name!r}) has {weight[1]} inputs, not a multiple of the "
                                                f"quantization block of {_block_of(form, p.dtype)}")
                if other is not None and tuple(other.shape) != want:
                    raise CheckpointFormatError(f"layer {plan.layer} expert {plan.expert}: {proj}.{suffix} (from "
                                                f"{other.source.name!r}) has shape {list(other.shape)}, expected "
                                                f"{list(want)} beside its {list(weight)} weight")


def beside(form: str, dtype: str, weight: tuple[int, int],
           block: tuple[int, int] | None) -> dict[str, tuple[int, ...] | None]:
    """# a projection's form, its data tensor's dtype, the [out, in] weight it stands for -> {suffix: shape} of each
    tensor beside it that the weight shapes (None: the weight cannot have it, an input width no block divides)"""
    out, inputs = weight
    shapes: dict[str, tuple[int, ...] | None] = {"bias": (out,)}
    fmt = formats.stored(form, dtype)
    if fmt is None or fmt.scale is None:
        return shapes
    if fmt.split:  # shardtool's own blocks: the input width a multiple of the block (the loader's rule)
        shapes[fmt.scale] = fmt.scale_shape(out, inputs) if inputs % fmt.block[1] == 0 else None
    elif fmt.block_from_config:
        if block is not None:
            shapes[fmt.scale] = fmt.scale_shape(out, inputs, block)
    else:
        shapes[fmt.scale] = fmt.scale_shape(out, inputs)
    return shapes


def _block_of(form: str, dtype: str) -> int | None:
    fmt = formats.stored(form, dtype)
    return None if fmt is None or fmt.block is None else fmt.block[1]


def check_shape(plan: ShardPlan, p: Piece, proj: str, shape: tuple[int, ...] | None,
                expected: tuple[int | None, int | None]) -> None:
    """`p`, projection `proj` of an expert, standing for a weight of `shape` ([out, in]; None: its stored shape is
    no weight's), agrees with `expected` wherever config.json states a size."""
    if shape is not None and all(want is None or got == want for got, want in zip(shape, expected)):
        return
    want = [w if w is not None else "any" for w in expected]
    raise CheckpointFormatError(f"layer {plan.layer} expert {plan.expert}: {proj} (from {p.source.name!r}) has shape "
                                f"{list(p.shape)}, config.json's hidden and expert intermediate sizes give {want} "
                                f"for {proj}")


# formats.FORM_DATA, each read as the [out, in] weight it stands for (its first row's `weight_shape`: every row
# storing its data under one suffix packs it alike). None: a stored shape that is no weight's.
_WEIGHT_OF_FORM = {data: next(f for f in formats.TABLE if f.data == data).weight_shape for data in formats.FORM_DATA}


def check_forms(plan: ShardPlan) -> None:
    """Each routed-expert projection of `plan` in exactly one stored form (`formats.stored(...).tensors`, the rule
    the runtime applies when it loads the shard): refused here, before anything is written or signed."""
    by_proj: dict[str, dict[str, Piece]] = {}
    for p in plan.pieces:
        proj, _, suffix = p.name.partition(".")
        if proj in EXPERT_PROJECTIONS and suffix in formats.FORM_SUFFIXES:
            by_proj.setdefault(proj, {})[suffix] = p
    where = f"layer {plan.layer} expert {plan.expert}"
    for proj, have in by_proj.items():
        forms = [s for s in formats.FORM_DATA if s in have]
        if len(forms) != 1:
            names = ", ".join(repr(p.source.name) for p in have.values())
            raise CheckpointFormatError(f"{where}: {proj} is stored in {'more than one form' if forms else 'no form'} "
                                        f"({', '.join(forms) or 'no data tensor'}): {names}; expected exactly one")
        form = forms[0]
        fmt = formats.stored(form, have[form].dtype)
        uses = (form,) if fmt is None else fmt.tensors
        for s in formats.FORM_SUFFIXES:
            if s in have and s not in uses:
                raise CheckpointFormatError(f"{where}: {have[s].source.name!r} beside {proj}.{form} of dtype "
                                            f"{have[form].dtype}: that form has "
                                            f"{' and '.join(f'{proj}.{u}' for u in uses)} only")
            if s in uses and s not in have:
                raise CheckpointFormatError(f"{where}: {have[form].source.name!r} ({have[form].dtype}) without "
                                            f"{proj}.{s}")
