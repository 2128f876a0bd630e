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

from shardtool import blockquant, formats
from shardtool.errors import CheckpointFormatError
from shardtool.safetensors_format import numpy_dtype

from ._dtypes import DEFAULT_BLOCK

KINDS = formats.KERNELS  # the kernel kind of each stored format (shardtool.formats), the extension's names
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
    names = {s: t.get(f"{proj}.{s}") for s in formats.FORM_SUFFIXES}
    forms = [s for s in formats.FORM_DATA if names[s] is not None]
    if len(forms) != 1:
        if not forms:
            raise missing("weight")
        raise CheckpointFormatError(f"{where}: {proj} is stored in more than one form ({', '.join(forms)})")
    form = forms[0]
    w = names[form]
    fmt = formats.stored(form, _STORED_DTYPE.get(w.dtype, ""))
    uses = (form,) if fmt is None else fmt.tensors
    stray = [s for s in formats.FORM_SUFFIXES if s not in uses and names[s] is not None]
    if stray:  # a tensor of another stored form: the checkpoint is not what its writer meant
        raise CheckpointFormatError(f"{where}: {proj}.{stray[0]} beside {proj}.{form} of dtype {w.dtype} (that "
                                    f"form has {' and '.join(f'{proj}.{s}' for s in uses)} only)")
    if fmt is not None and fmt.kernel in _PACK_BLOCKS:
        return _PACK_BLOCKS[fmt.kernel](fmt, w, names[fmt.scale], proj, shape, where, mxfp4)
    if w.shape != shape:
        raise CheckpointFormatError(f"{where}: {proj}.weight has shape {w.shape}, expected {shape}")
    if fmt is formats.FP8:
        s = names[fmt.scale]
        if s is None:
            raise missing(fmt.scale)
        if not (isinstance(fp8_block, tuple) and len(fp8_block) == 2
                and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1 for b in fp8_block)):
            raise CheckpointFormatError(f"{where}: {proj}: FP8 block {fp8_block!r} is not two integers >= 1")
        b0, b1 = fp8_block
        want = (-(-out_f // b0), -(-in_f // b1))
        if s.shape != want:
            raise CheckpointFormatError(f"{where}: {proj}.weight_scale_inv has shape {s.shape}, expected {want} "
                                        f"for {shape} in {b0}x{b1} blocks")
        what = f"{where}: {proj}.{fmt.scale}"
        scale = _finite_scale(s, what).astype(np.float32)
        if np.abs(scale).max(initial=0) > FP8_SCALE_MAX:
            raise CheckpointFormatError(f"{what}: a scale above {float(FP8_SCALE_MAX):.6g} (448 times it, the "
                                        f"largest float8 weight, overflows float32)")
        data = _aligned(w)
        _refuse_nonfinite(data, fmt.kernel, f"{where}: {proj}.weight")
        return Packed(fmt.kernel, shape, data, _aligned(scale), fp8_block)
    if fmt is None:
        raise CheckpointFormatError(f"{where}: {proj}.weight has unsupported dtype {w.dtype}",
                                    hint="expected float32, float16, bfloat16, float8_e4m3fn or int8")
    data = _aligned(w)
    _refuse_nonfinite(data, fmt.kernel, f"{where}: {proj}.weight")
    return Packed(fmt.kernel, shape, data)


# numpy dtype -> its safetensors name, for the dtypes a format stores its data in (what `formats.stored` reads)
_STORED_DTYPE = {numpy_dtype(f.dtype): f.dtype for f in formats.TABLE}
# the largest FP8 block scale whose product with the largest float8_e4m3fn value (448) is a finite float32
FP8_SCALE_MAX = np.float32(np.finfo(np.float32).max) / np.float32(448)  # 7.595588e35 (448 times it rounds to FLT_MAX)
MXFP4_SCALE_MAX = 0xFC  # 2^(0xFC - 127) = 2^125: times 6 (the largest E2M1 value) is finite; 2^126 * 6 is not


def _aligned(a: np.ndarray) -> np.ndarray:
    """`a` C-contiguous and aligned to its items (the extension refuses anything else; a view into a safetensors
    file may start at any byte): no copy when it already is."""
    f = a.flags
    return a if f.c_contiguous and f.aligned else np.require(a, requirements=["C", "A"])  # flags: no np.require cost


# per kind: the raw integer view and the mask whose bits all set mean inf or NaN (float8_e4m3fn: 0x7F/0xFF, NaN)
_NONFINITE = {formats.F32.kernel: (np.uint32, 0x7F800000), formats.F16.kernel: (np.uint16, 0x7C00),
              formats.BF16.kernel: (np.uint16, 0x7F80), formats.FP8.kernel: (np.uint8, 0x7F)}
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


_SCALE_KINDS = {numpy_dtype(f.dtype): f.kernel for f in formats.FLOATS}  # a float scale's dtype -> its scan


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


def _pack_block(fmt: formats.Format, data: np.ndarray, scale: np.ndarray | None, proj: str, shape: tuple[int, int],
                where: str, mxfp4: bool) -> Packed:
    """shardtool's block int8/int4 (`fmt`): data and a float16 scale per block of a row."""
    out_f, in_f = shape
    block = fmt.block[1]
    if scale is None:
        raise CheckpointFormatError(f"{where}: missing tensor {proj}.{fmt.scale} beside its {fmt.name} weight")
    if in_f % block:
        raise CheckpointFormatError(f"{where}: {proj} has {in_f} inputs, not a multiple of the quantization block "
                                    f"of {block}")
    want_data = fmt.data_shape(out_f, in_f)
    want_dtype, scale_dtype = numpy_dtype(fmt.dtype), numpy_dtype(fmt.scale_dtype)
    want_scale = fmt.scale_shape(out_f, in_f)
    if data.dtype != want_dtype or data.shape != want_data:
        raise CheckpointFormatError(f"{where}: {proj}.{fmt.data} is {data.dtype} {data.shape}, expected {want_dtype} "
                                    f"{want_data} for {shape}")
    if scale.dtype != scale_dtype or scale.shape != want_scale:
        raise CheckpointFormatError(f"{where}: {proj}.{fmt.scale} is {scale.dtype} {scale.shape}, "
                                    f"expected {scale_dtype} {want_scale}")
    scale = _finite_scale(scale, f"{where}: {proj}.{fmt.scale}")
    return Packed(fmt.kernel, shape, _aligned(data), scale)


def _pack_mxfp4(fmt: formats.Format, blocks: np.ndarray, scales: np.ndarray | None, proj: str,
                shape: tuple[int, int], where: str, allowed: bool) -> Packed:
    out_f, in_f = shape
    group = fmt.block[1]
    if scales is None:
        raise CheckpointFormatError(f"{where}: missing tensor {proj}.{fmt.scale} beside {proj}.{fmt.data}")
    if not allowed:
        raise CheckpointFormatError(f"{where}: {proj} is stored as MXFP4 blocks, but config.json declares no "
                                    f"quantization_config with quant_method {fmt.quant_method!r}")
    if in_f % group:
        raise CheckpointFormatError(f"{where}: {proj} has {in_f} inputs, not a multiple of the MXFP4 group of "
                                    f"{group}")
    want_blocks, want_scales = fmt.data_shape(out_f, in_f), fmt.scale_shape(out_f, in_f)
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
    return Packed(fmt.kernel, shape, _aligned(blocks), _aligned(scales))


# The block formats' loaders, by kernel kind: the formats whose data tensor is not a plain `<proj>.weight` of the
# weight's shape, or is int8 (a format added with scales of its own layout adds its loader here).
_PACK_BLOCKS = {formats.INT8.kernel: _pack_block, formats.INT4.kernel: _pack_block,
                formats.MXFP4.kernel: _pack_mxfp4}
# The buffer each kind's data and scale are handed to the extension as (bf16 and fp8 have no buffer format).
_RAW = {formats.BF16.kernel: np.uint16, formats.FP8.kernel: np.uint8}


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
    return _dense_t(x, w.data if w.kind == formats.F32.kernel else to_float32(w))


def _dense_t(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """# [m, in], [out, in] float32 -> [m, out]. One row (every decode step) goes through gemv: OpenBLAS runs a 1-row
    sgemm multi-threaded, which costs 10-100x more than gemv on a small or busy machine."""
    if x.shape[0] == 1:
        return (f @ x[0])[None, :]
    return x @ f.T


def to_float32(w: Packed) -> np.ndarray:
    """# Packed [out, in] -> [out, in] float32: the reference expansion (tests; never per use on the decode path),
    its format's numpy unpack (`shardtool.formats`)"""
    fmt = formats.BY_KERNEL.get(w.kind)
    if fmt is None:
        raise CheckpointFormatError(f"unknown packed weight kind {w.kind!r}")
    return blockquant.unpack_of(fmt)(w.data, w.scale, w.block)


def from_float(w: np.ndarray, kind: str, block: tuple[int, int] = DEFAULT_BLOCK) -> Packed:
    """# [out, in] float -> that weight stored as `kind` (the formats' own quantizers): for tests and benchmarks."""
    shape = (w.shape[0], w.shape[1])
    fmt = formats.BY_KERNEL.get(kind)
    if fmt is None:
        raise ValueError(f"unknown packed weight kind {kind!r}")
    data, scale = blockquant.pack_of(fmt)(w, block)
    return Packed(kind, shape, data, scale, block if fmt.block_from_config else None)

