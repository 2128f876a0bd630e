"""A linear layer's weight as it is stored, and the product with it: the forward pass never expands a weight whole.

`pack` reads one projection's stored tensors (float32/float16/bfloat16, DeepSeek's block-scaled FP8, gpt-oss's
MXFP4, shardtool's block int8/int4 of `shardtool.blockquant`), checks their dtypes, shapes and scales (and that
every weight is finite and no product of a weight by its scale overflows float32), and returns a `Packed`;
`matmul_t(x, w)` multiplies by it in the stored dtype. This module holds the numpy reference for each kind; the
native kernels (the C extension `_kernels`, built by the project's install) replace it for every kind and
must agree with it. Without the extension, or with the environment variable SHARDTOOL_KERNELS=0 when this module is
imported, the reference runs. `set_threads(n)` sets how many threads one native product may use (default 1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from shardtool import blockquant
from shardtool.errors import CheckpointFormatError

from ._dtypes import (BF16, DEFAULT_BLOCK, FLOAT8, MXFP4_GROUP, dequantize, mxfp4_to_float32, quantize_fp8,
                      quantize_mxfp4)

KINDS = ("f32", "f16", "bf16", "fp8", "q8", "q4", "mxfp4")
MAX_THREADS = 64  # the extension's cap


def _load_kernels():
    if os.environ.get("SHARDTOOL_KERNELS", "1") == "0":
        return None
    try:
        from . import _kernels
    except ImportError:  # not built (e.g. a source tree used without `make install`): the numpy reference runs
        return None
    return _kernels


_native = _load_kernels()
_threads = 1


def kernels() -> str | None:
    """The native kernels in use: their instruction set ("avx512", "avx2" or "plain"), or None (the numpy reference).
    "avx512": one-row products with block (q8, q4, mxfp4), float32 and float16 weights on AVX-512, the rest on AVX2."""
    return None if _native is None else _native.isa()


def set_threads(n: int) -> None:
    """Threads one native product may split its output rows over (1..MAX_THREADS); the reference ignores it."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"kernel threads must be an integer in 1..{MAX_THREADS}, got {n!r}")
    _threads = n


@dataclass(frozen=True, slots=True)
class Packed:
    """# one weight [out, in] in its stored form

    kind "f32"/"f16"/"bf16": data [out, in] in that dtype; "fp8": data float8_e4m3fn [out, in], scale float32
    [ceil(out/b0), ceil(in/b1)], block (b0, b1); "q8": data int8 [out, in], scale float16 [out, in/32]; "q4": data
    uint8 [out, in/2], scale float16 [out, in/32]; "mxfp4": data uint8 [out, in/32, 16], scale uint8 [out, in/32].
    """
    kind: str
    shape: tuple[int, int]
    data: np.ndarray
    scale: np.ndarray | None = None
    block: tuple[int, int] | None = None
    # what the extension is handed: (kind, data (bf16 as a uint16 view, fp8 as uint8), scale, out, in, b0, b1), made
    # once here so that a product pays no per-call Python work for it
    native: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raw = _RAW.get(self.kind)
        b0, b1 = self.block or (0, 0)
        object.__setattr__(self, "native", (self.kind, self.data if raw is None else self.data.view(raw), self.scale,
                                            self.shape[0], self.shape[1], b0, b1))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)


def pack(t: Mapping[str, np.ndarray], proj: str, shape: tuple[int, int], where: str, *,
         fp8_block: tuple[int, int] = DEFAULT_BLOCK, mxfp4: bool = False) -> Packed:
    """Projection `proj` (e.g. "gate_proj", "self_attn.q_proj") of tensors `t`, expected [out, in] = `shape`.

    Exactly one stored form must be present: `<proj>.weight` (float, FP8 + `weight_scale_inv`, or int8 +
    `weight_scale`), `<proj>.weight_q4` + `weight_scale`, or (when `mxfp4`) `weight_blocks` + `weight_scales`, and
    no tensor of another form. Anything else (a NaN or infinite weight or scale, a scale whose products overflow) is
    a CheckpointFormatError naming `where` and the tensor. The data is returned aligned and C-contiguous (copied once
    if it was not: a view into a safetensors file may start at any byte)."""
    def missing(name: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{where}: missing tensor {proj}.{name}")

    out_f, in_f = shape
    names = {s: t.get(f"{proj}.{s}") for s in blockquant.FORM_SUFFIXES}
    forms = [s for s in blockquant.FORM_DATA if names[s] is not None]
    if len(forms) != 1:
        if not forms:
            raise missing("weight")
        raise CheckpointFormatError(f"{where}: {proj} is stored in more than one form ({', '.join(forms)})")
    form = forms[0]
    w = names[form]
    uses = blockquant.form_tensors(form, "int8" if w.dtype == np.int8 else "fp8" if w.dtype == FLOAT8 else "float")
    stray = [s for s in blockquant.FORM_SUFFIXES if s not in uses and names[s] is not None]
    if stray:  # a tensor of another stored form: the checkpoint is not what its writer meant
        raise CheckpointFormatError(f"{where}: {proj}.{stray[0]} beside {proj}.{form} of dtype {w.dtype} (that "
                                    f"form has {' and '.join(f'{proj}.{s}' for s in uses)} only)")
    if form == "weight_blocks":
        return _pack_mxfp4(w, names["weight_scales"], proj, shape, where, mxfp4)
    if form == blockquant.Q4_SUFFIX or w.dtype == np.int8:
        return _pack_block(form, w, names[blockquant.SCALE_SUFFIX], proj, shape, where)
    if w.shape != shape:
        raise CheckpointFormatError(f"{where}: {proj}.weight has shape {w.shape}, expected {shape}")
    if w.dtype == FLOAT8:
        s = names["weight_scale_inv"]
        if s is None:
            raise missing("weight_scale_inv")
        if not (isinstance(fp8_block, tuple) and len(fp8_block) == 2
                and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1 for b in fp8_block)):
            raise CheckpointFormatError(f"{where}: {proj}: FP8 block {fp8_block!r} is not two integers >= 1")
        b0, b1 = fp8_block
        want = (-(-out_f // b0), -(-in_f // b1))
        if s.shape != want:
            raise CheckpointFormatError(f"{where}: {proj}.weight_scale_inv has shape {s.shape}, expected {want} "
                                        f"for {shape} in {b0}x{b1} blocks")
        what = f"{where}: {proj}.weight_scale_inv"
        scale = _finite_scale(s, what).astype(np.float32)
        if np.abs(scale).max(initial=0) > FP8_SCALE_MAX:
            raise CheckpointFormatError(f"{what}: a scale above {float(FP8_SCALE_MAX):.6g} (448 times it, the "
                                        f"largest float8 weight, overflows float32)")
        data = _aligned(w)
        _refuse_nonfinite(data, "fp8", f"{where}: {proj}.weight")
        return Packed("fp8", shape, data, _aligned(scale), fp8_block)
    kind = _FLOAT_KINDS.get(w.dtype)
    if kind is None:
        raise CheckpointFormatError(f"{where}: {proj}.weight has unsupported dtype {w.dtype}",
                                    hint="expected float32, float16, bfloat16, float8_e4m3fn or int8")
    data = _aligned(w)
    _refuse_nonfinite(data, kind, f"{where}: {proj}.weight")
    return Packed(kind, shape, data)


_FLOAT_KINDS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BF16: "bf16"}
# the largest FP8 block scale whose product with the largest float8_e4m3fn value (448) is a finite float32
FP8_SCALE_MAX = np.float32(np.finfo(np.float32).max) / np.float32(448)  # 7.595588e35 (448 times it rounds to FLT_MAX)
MXFP4_SCALE_MAX = 0xFC  # 2^(0xFC - 127) = 2^125: times 6 (the largest E2M1 value) is finite; 2^126 * 6 is not


def _aligned(a: np.ndarray) -> np.ndarray:
    """`a` C-contiguous and aligned to its items (the extension refuses anything else; a view into a safetensors
    file may start at any byte): no copy when it already is."""
    f = a.flags
    return a if f.c_contiguous and f.aligned else np.require(a, requirements=["C", "A"])  # flags: no np.require cost


# per kind: the raw integer view and the mask whose bits all set mean inf or NaN (float8_e4m3fn: 0x7F/0xFF, NaN)
_NONFINITE = {"f32": (np.uint32, 0x7F800000), "f16": (np.uint16, 0x7C00), "bf16": (np.uint16, 0x7F80),
              "fp8": (np.uint8, 0x7F)}
_SCAN_CHUNK = 1 << 20  # elements per numpy pass of the fallback scan (bounded temporaries)


def _first_nonfinite(a: np.ndarray, kind: str) -> int:
    """The C-order index of the first inf/NaN element of the C-contiguous aligned `a` stored as `kind`, or -1."""
    flat = a.reshape(-1)
    if _native is not None:
        return _native.nonfinite(kind, flat if kind not in _RAW else flat.view(_RAW[kind]))
    raw, mask = _NONFINITE[kind]
    v, m = flat.view(raw), raw(mask)
    for c in range(0, v.size, _SCAN_CHUNK):
        hits = np.flatnonzero((v[c:c + _SCAN_CHUNK] & m) == m)
        if hits.size:
            return c + int(hits[0])
    return -1


def _refuse_nonfinite(a: np.ndarray, kind: str, what: str) -> None:
    at = _first_nonfinite(a, kind)
    if at >= 0:
        index = tuple(int(i) for i in np.unravel_index(at, a.shape))
        raise CheckpointFormatError(f"{what}: a NaN or infinite value at {list(index)}")


_SCALE_KINDS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BF16: "bf16"}


def _finite_scale(s: np.ndarray, what: str) -> np.ndarray:
    """`s` aligned and C-contiguous (`_aligned`), once every scale in it is checked finite (one native scan: a
    streamed expert's three scales are checked on every load)."""
    kind = _SCALE_KINDS.get(s.dtype)
    if kind is None:
        raise CheckpointFormatError(f"{what} has dtype {s.dtype}, expected a float")
    s = _aligned(s)
    if s.size and _first_nonfinite(s, kind) >= 0:
        raise CheckpointFormatError(f"{what}: a scale is NaN or infinite")
    return s


def _pack_block(form: str, data: np.ndarray, scale: np.ndarray | None, proj: str, shape: tuple[int, int],
                where: str) -> Packed:
    out_f, in_f = shape
    q4 = form == blockquant.Q4_SUFFIX
    if scale is None:
        raise CheckpointFormatError(f"{where}: missing tensor {proj}.{blockquant.SCALE_SUFFIX} beside its "
                                    f"{'int4' if q4 else 'int8'} weight")
    if in_f % blockquant.QBLOCK:
        raise CheckpointFormatError(f"{where}: {proj} has {in_f} inputs, not a multiple of the quantization block "
                                    f"of {blockquant.QBLOCK}")
    want_data = (out_f, in_f // 2) if q4 else (out_f, in_f)
    want_dtype = np.dtype(np.uint8) if q4 else np.dtype(np.int8)
    want_scale = (out_f, in_f // blockquant.QBLOCK)
    if data.dtype != want_dtype or data.shape != want_data:
        raise CheckpointFormatError(f"{where}: {proj}.{form} is {data.dtype} {data.shape}, expected {want_dtype} "
                                    f"{want_data} for {shape}")
    if scale.dtype != np.float16 or scale.shape != want_scale:
        raise CheckpointFormatError(f"{where}: {proj}.{blockquant.SCALE_SUFFIX} is {scale.dtype} {scale.shape}, "
                                    f"expected float16 {want_scale}")
    scale = _finite_scale(scale, f"{where}: {proj}.{blockquant.SCALE_SUFFIX}")
    return Packed("q4" if q4 else "q8", shape, _aligned(data), scale)


def _pack_mxfp4(blocks: np.ndarray, scales: np.ndarray | None, proj: str, shape: tuple[int, int], where: str,
                allowed: bool) -> Packed:
    out_f, in_f = shape
    if scales is None:
        raise CheckpointFormatError(f"{where}: missing tensor {proj}.weight_scales beside {proj}.weight_blocks")
    if not allowed:
        raise CheckpointFormatError(f"{where}: {proj} is stored as MXFP4 blocks, but config.json declares no "
                                    f"quantization_config with quant_method 'mxfp4'")
    if in_f % MXFP4_GROUP:
        raise CheckpointFormatError(f"{where}: {proj} has {in_f} inputs, not a multiple of the MXFP4 group of "
                                    f"{MXFP4_GROUP}")
    groups = in_f // MXFP4_GROUP
    want_blocks, want_scales = (out_f, groups, MXFP4_GROUP // 2), (out_f, groups)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape != want_blocks \
            or scales.shape != want_scales:
        raise CheckpointFormatError(f"{where}: MXFP4 {proj}.weight_blocks {blocks.dtype} {blocks.shape} / "
                                    f"weight_scales {scales.dtype} {scales.shape}, expected uint8 {want_blocks} / "
                                    f"{want_scales} for {shape}")
    top = int(scales.max(initial=0))
    if top > MXFP4_SCALE_MAX:
        raise CheckpointFormatError(f"{where}: {proj}.weight_scales has MXFP4 scale {top:#04x} "
                                    f"({'NaN' if top == 0xFF else 'its weights overflow float32'}; at most "
                                    f"{MXFP4_SCALE_MAX:#04x})")
    return Packed("mxfp4", shape, _aligned(blocks), _aligned(scales))


# The buffer each kind's data and scale are handed to the extension as (bf16 and fp8 have no buffer format).
_RAW = {"bf16": np.uint16, "fp8": np.uint8}


def matmul_t(x: np.ndarray, w: Packed | np.ndarray) -> np.ndarray:
    """# [m, in] float32, [out, in] -> [m, out] float32  (x @ W.T; a `Packed` weight in its stored dtype)

    A `Packed` weight: native when the extension is in use, each weight row read once, in its stored dtype, on up to
    `set_threads` threads; otherwise (and for empty shapes) `matmul_t_reference`. A float32 array: one BLAS product
    (`_dense_t`)."""
    if type(w) is not Packed:
        return _dense_t(x, w)
    out_f, in_f = w.shape
    m, columns = x.shape[0], x.shape[1]
    if _native is None or not (m and out_f and in_f):
        return matmul_t_reference(x, w)
    if columns != in_f:
        raise ValueError(f"x has {columns} columns, the weight {in_f} inputs")
    x = _float32_rows(x)
    y = np.empty((m, out_f), np.float32)
    _native.product(w.native, x, y, _threads)
    return y


def _float32_rows(x: np.ndarray) -> np.ndarray:
    """# [m, in] -> [m, in] float32, C-contiguous and aligned: x itself when it already is (every decode step),
    checked by flags instead of np.require, whose argument parsing costs as much as a small product."""
    f = x.flags
    if x.dtype == np.float32 and f.c_contiguous and f.aligned:
        return x
    return np.require(x, np.float32, ["C", "A"])


def matmul_t_reference(x: np.ndarray, w: Packed) -> np.ndarray:
    """The numpy reference of `matmul_t`: expands the weight, then one BLAS product (one row goes through gemv)."""
    return _dense_t(x, w.data if w.kind == "f32" else to_float32(w))


def _dense_t(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """# [m, in], [out, in] float32 -> [m, out]. One row (every decode step) goes through gemv: OpenBLAS runs a 1-row
    sgemm multi-threaded, which costs 10-100x more than gemv on a small or busy machine."""
    if x.shape[0] == 1:
        return (f @ x[0])[None, :]
    return x @ f.T


def to_float32(w: Packed) -> np.ndarray:
    """# Packed [out, in] -> [out, in] float32: the reference expansion (tests; never per use on the decode path)"""
    if w.kind in ("f32", "f16", "bf16"):
        return np.ascontiguousarray(w.data, dtype=np.float32)
    if w.kind == "fp8":
        return dequantize(w.data, w.scale, w.block)
    if w.kind == "q8":
        return blockquant.dequantize_q8(w.data, w.scale)
    if w.kind == "q4":
        return blockquant.dequantize_q4(w.data, w.scale)
    if w.kind == "mxfp4":
        return mxfp4_to_float32(w.data, w.scale)
    raise CheckpointFormatError(f"unknown packed weight kind {w.kind!r}")


def from_float(w: np.ndarray, kind: str, block: tuple[int, int] = DEFAULT_BLOCK) -> Packed:
    """# [out, in] float -> that weight stored as `kind` (the formats' own quantizers): for tests and benchmarks."""
    shape = (w.shape[0], w.shape[1])
    if kind in ("f32", "f16", "bf16"):
        return Packed(kind, shape, np.ascontiguousarray(w, {"f32": np.float32, "f16": np.float16, "bf16": BF16}[kind]))
    if kind == "fp8":
        q, s = quantize_fp8(w, block)
        return Packed(kind, shape, q, s, block)
    if kind in ("q8", "q4"):
        return Packed(kind, shape, *(blockquant.quantize_q8 if kind == "q8" else blockquant.quantize_q4)(w))
    if kind == "mxfp4":
        return Packed(kind, shape, *quantize_mxfp4(w))
    raise ValueError(f"unknown packed weight kind {kind!r}")

