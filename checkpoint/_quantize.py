"""`split --quantize int8|int4`: which expert tensors are quantized, and the bytes of each quantized tensor.

The formats are rows of `shardtool.formats` (their one home); this module decides, while planning, which routed-expert
projections become `<proj>.weight` I8 (or `<proj>.weight_q4` U8) + `<proj>.weight_scale` F16, and computes their
bytes from the float source tensor while streaming, one projection at a time. Only the float (F32/F16/BF16)
`gate_proj`/`up_proj`/`down_proj` weights of routed experts are quantized; trunk tensors, routers, shared
experts and expert biases stay as stored, and experts already stored FP8 (block-scaled) or MXFP4 are kept as
stored: the runtime executes those formats natively.

With `trunk` (`split --quantize int8 --quantize-trunk`, int8 only) the trunk's float linear weights are quantized
too, as llama.cpp's Q8_0 does: every `*_proj.weight` of a decoder layer (attention, shared and dense MLPs) and
`lm_head.weight`. Routers, norms, biases, the embedding table (rows are looked up, not multiplied) and MLA's
`kv_b_proj` (split per head, so expanded to float32 once) stay as stored, and so does a weight whose input width
is not a multiple of the block.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Sequence

from shardtool import blockquant, formats
from shardtool.checkpoint._expert_check import check_forms
from shardtool.checkpoint._plan_records import Piece, ShardPlan
from shardtool.errors import CheckpointFormatError, UsageError
from shardtool.families import EXPERT_PROJECTIONS

if TYPE_CHECKING:
    import numpy as np

METHODS = formats.SPLIT_METHODS
FLOAT_DTYPES = tuple(f.dtype for f in formats.FLOATS)
DATA, SCALE = "data", "scale"
# stored dtype of a kept `<proj>.weight` -> what to call it (the runtime runs it)
_KEPT = {formats.FP8.dtype: "FP8 block-scaled"}


@dataclass(frozen=True)
class QuantizeReport:
    """What `--quantize` did to the routed experts (and with `--quantize-trunk` to the trunk), for split's output."""

    method: str
    projections: int                 # expert projections quantized (over all experts)
    kept: Mapping[str, int]          # already-quantized projections kept as stored, by format ("MXFP4", ...)
    trunk: int = 0                   # trunk linear weights quantized (--quantize-trunk)
    trunk_kept: int = 0              # trunk linear weights kept float: input width not a multiple of the block

    def lines(self) -> list[str]:
        fmt = formats.BY_NAME[self.method]
        bits, block = fmt.bits_per_weight(), fmt.block[1]
        trunk = (f"{self.trunk} trunk linear weight(s) quantized too; routers, norms and the embedding kept as "
                 f"stored" if self.trunk else "trunk, routers and shared experts kept as stored")
        out = [f"quantized {self.projections} routed-expert projection(s) to block {self.method} "
               f"({bits:g} bits per weight, float16 scale per {block} weights); {trunk}"] \
            if self.projections or self.trunk else []
        if self.trunk_kept:
            out.append(f"note: {self.trunk_kept} trunk linear weight(s) kept as stored (input width not a multiple "
                       f"of {block})")
        out += [f"note: {n} routed-expert projection(s) already stored {fmt} kept as stored (the runtime executes "
                f"them natively)" for fmt, n in sorted(self.kept.items())]
        return out


TRUNK_METHODS = formats.TRUNK_METHODS  # a trunk at 4 bits loses too much of the attention (not offered)


def check_method(method: str | None, trunk: bool = False) -> None:
    if method is not None and method not in METHODS:
        raise UsageError(f"--quantize must be one of {', '.join(METHODS)}, got {method!r:.40}")
    if trunk and method not in TRUNK_METHODS:
        raise UsageError(f"--quantize-trunk needs --quantize {' or '.join(TRUNK_METHODS)}, got "
                         f"{'no --quantize' if method is None else f'--quantize {method}'}")


def _trunk_weight(name: str) -> bool:
    """A trunk tensor `--quantize-trunk` quantizes: a decoder layer's `*_proj.weight` (not MLA's kv_b_proj) or the
    LM head."""
    return name == "lm_head.weight" or (name.endswith("_proj.weight") and not name.endswith("kv_b_proj.weight"))


def _projection(name: str) -> str | None:
    """The projection of a canonical expert tensor name `<proj>.weight`, else None."""
    proj, _, suffix = name.partition(".")
    return proj if suffix == "weight" and proj in EXPERT_PROJECTIONS else None


def quantize_plans(plans: Sequence[ShardPlan], method: str, *, trunk: bool = False,
                   ) -> tuple[list[ShardPlan], QuantizeReport]:
    """The plans with every float routed-expert projection replaced by its quantized data + scale pieces (with
    `trunk`, the trunk's float linear weights too, `_trunk_weight`).

    Refuses (CheckpointFormatError, before anything is written) a projection in more than one form, not 2-D, with
    no rows or no columns, or whose input width is not a multiple of the block. Its shape against config.json is
    every split's check (`_expert_check.check_expert_plans`), made before this."""
    check_method(method, trunk)
    out: list[ShardPlan] = []
    done = trunk_done = trunk_kept = 0
    kept: Counter[str] = Counter()
    for plan in plans:
        if plan.kind != "expert":
            if trunk and plan.kind == "trunk":
                plan, n, k = _quantized_trunk(plan, method)
                trunk_done, trunk_kept = trunk_done + n, trunk_kept + k
            out.append(plan)
            continue
        check_forms(plan)
        pieces: list[Piece] = []
        for p in plan.pieces:
            proj = _projection(p.name)
            if proj is None:
                if p.name.endswith(f".{formats.MXFP4.data}"):
                    kept["MXFP4"] += 1
                pieces.append(p)
                continue
            if p.dtype not in FLOAT_DTYPES:
                if p.dtype not in _KEPT:
                    raise CheckpointFormatError(
                        f"layer {plan.layer} expert {plan.expert}: {p.source.name!r} is stored {p.dtype}; "
                        f"--quantize takes float ({'/'.join(FLOAT_DTYPES)}) routed-expert projections and keeps "
                        f"FP8 (F8_E4M3 with weight_scale_inv) and MXFP4 ones as stored, nothing else")
                kept[_KEPT[p.dtype]] += 1
                pieces.append(p)
                continue
            pieces += _quantized_pieces(plan, p, proj, method)
            done += 1
        out.append(replace(plan, pieces=tuple(pieces)))
    return out, QuantizeReport(method, done, dict(kept), trunk_done, trunk_kept)


def _quantized_trunk(plan: ShardPlan, method: str) -> tuple[ShardPlan, int, int]:
    """A trunk plan with its float 2-D linear weights quantized; (plan, weights quantized, weights kept float)."""
    pieces: list[Piece] = []
    done = kept = 0
    names = {p.name for p in plan.pieces}
    for p in plan.pieces:
        if not (_trunk_weight(p.name) and p.dtype in FLOAT_DTYPES and len(p.shape) == 2 and all(p.shape)):
            pieces.append(p)
            continue
        base = p.name.removesuffix(".weight")
        stray = [f"{base}.{s}" for s in formats.FORM_SUFFIXES if s != "weight" and f"{base}.{s}" in names]
        if stray:  # the runtime's one-form rule would refuse the shard: refused here, before anything is written
            raise CheckpointFormatError(f"{plan.path}: {p.source.name!r} ({p.dtype}) has {stray[0]!r} beside it; "
                                        f"a weight is stored in exactly one form")
        if p.shape[1] % formats.BY_NAME[method].block[1]:
            kept += 1
            pieces.append(p)
            continue
        pieces += _block_pieces(p, base, method)
        done += 1
    return replace(plan, pieces=tuple(pieces)), done, kept


def _quantized_pieces(plan: ShardPlan, p: Piece, proj: str, method: str) -> list[Piece]:
    if len(p.shape) != 2:
        raise CheckpointFormatError(f"layer {plan.layer} expert {plan.expert}: {p.source.name!r} has shape "
                                    f"{list(p.shape)}, expected a 2-D [out, in] projection to quantize")
    rows, cols = p.shape
    if rows == 0 or cols == 0:
        raise CheckpointFormatError(f"layer {plan.layer} expert {plan.expert}: {p.source.name!r} has shape "
                                    f"{list(p.shape)}, an empty projection cannot be quantized")
    block = formats.BY_NAME[method].block[1]
    if cols % block:
        raise CheckpointFormatError(f"cannot quantize {p.source.name!r} (layer {plan.layer} expert {plan.expert} "
                                    f"{p.name}): its input width {cols} is not a multiple of the block of "
                                    f"{block}", hint="split it without --quantize")
    return _block_pieces(p, proj, method)


def _block_pieces(p: Piece, base: str, method: str) -> list[Piece]:
    """# a float [out, in] piece -> its data (`<base>.weight` I8, or `<base>.weight_q4` U8 [out, in/2]) and scale
    (`<base>.weight_scale` F16 [out, in/32]) pieces in `method` (its row's tensors), from the same source tensor."""
    rows, cols = p.shape
    fmt = formats.BY_NAME[method]
    data = replace(p, name=f"{base}.{fmt.data}", dtype=fmt.dtype, shape=fmt.data_shape(rows, cols),
                   quant=(method, DATA))
    scale = replace(p, name=f"{base}.{fmt.scale}", dtype=fmt.scale_dtype, shape=fmt.scale_shape(rows, cols),
                    quant=(method, SCALE))
    return [data, scale]


def float_shape(p: Piece) -> tuple[int, int]:
    """[out, in] of the float projection a quantized data or scale piece is computed from."""
    method, part = p.quant or ("", "")
    rows, width = p.shape
    fmt = formats.BY_NAME.get(method)
    per = 1 if fmt is None else fmt.block[1] if part == SCALE else fmt.per_item
    return rows, width * per


def quantize(p: Piece, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """# [out, in] float32 -> (data, scale) in the piece's method; refuses a weight whose scales are not finite
    (a non-finite source weight, or a block too large for a float16 scale)"""
    import numpy as np

    fmt = formats.BY_NAME[p.quant[0] if p.quant else ""]
    with np.errstate(over="ignore", invalid="ignore"):  # a scale beyond float16 is refused below, not warned
        q, d = blockquant.pack_of(fmt)(w, None)
    if not np.all(np.isfinite(d)):
        raise CheckpointFormatError(f"cannot quantize {p.source.name!r}: a block's scale is not finite in "
                                    "float16 (a NaN/inf weight, or a weight beyond float16's range)")
    return q, d
