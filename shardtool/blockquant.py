"""The numpy reference of every stored weight format's packing: `shardtool.formats` names each format's row and
points its pack/unpack here (split writes these bytes, the runtime's native kernels must agree with them).

shardtool's own block formats quantize along a projection's input axis in blocks of `QBLOCK` weights that share
one float16 scale `d`, in the spirit of GGUF's Q8_0 and Q4_0. A projection `<proj>` of shape [out, in] (in a
multiple of QBLOCK) is stored as two safetensors tensors beside each other in the expert's shard:

- int8 ("q8", 8.5 bits/weight): `<proj>.weight` I8 [out, in] and `<proj>.weight_scale` F16 [out, in/32];
  w[r, c] = q[r, c] * d[r, c // 32].
- int4 ("q4", 4.5 bits/weight): `<proj>.weight_q4` U8 [out, in/2] and `<proj>.weight_scale` F16 [out, in/32].
  In block b of row r, byte j (0..15) holds element 32b + j in its low nibble and 32b + j + 16 in its high one
  (Q4_0's order); w = (nibble - 8) * d.

The formats others write are here too: DeepSeek's block-scaled FP8 (`dequantize`, `quantize_fp8`) and gpt-oss's
MXFP4 (`mxfp4_to_float32`, `quantize_mxfp4`). Scales are finite by construction; a reader must refuse a non-finite
one. Pure numpy over arrays, no I/O.
"""

from __future__ import annotations

from functools import cache

import ml_dtypes
import numpy as np

from shardtool import formats
from shardtool.errors import CheckpointFormatError

QBLOCK = formats.INT8.block[1]  # (int4's too)
FLOAT8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
COMPUTE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16, FLOAT8)
FP8_BLOCK = formats.FP8.block  # DeepSeek-V3 `quantization_config.weight_block_size`
# MXFP4 (OCP Microscaling, as gpt-oss stores its experts): FP4 E2M1 values, two per byte, in groups of 32 that
# share one E8M0 scale byte 2^(s - 127). The value of each 4-bit code (sign bit, then magnitude):
MXFP4_GROUP = formats.MXFP4.block[1]
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
MXFP4_NAN_SCALE = 0xFF  # E8M0's NaN encoding
_MXFP4_CHUNK = 1 << 16  # bytes of blocks per table look-up (its int64 indices and numpy's buffer: < 2 MiB)


def _blocks(w: np.ndarray) -> np.ndarray:  # [R, C] -> [R, C/32, 32] float32
    rows, cols = w.shape
    if cols % QBLOCK:
        raise ValueError(f"{cols} inputs is not a multiple of the quantization block of {QBLOCK}")
    return np.asarray(w, np.float32).reshape(rows, cols // QBLOCK, QBLOCK)


def quantize_q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """# [R, C] float -> q [R, C] int8, d [R, C/32] float16  (Q8_0: d = absmax / 127, q = round(w / d))"""
    b = _blocks(w)
    d = (np.abs(b).max(axis=-1) / 127.0).astype(np.float16)  # [R, G]
    d32 = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d32 > 0, np.rint(b / np.where(d32 > 0, d32, 1)), 0)
    return np.clip(q, -127, 127).astype(np.int8).reshape(w.shape), d


def dequantize_q8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """# [R, C] int8, [R, C/32] float16 -> [R, C] float32"""
    rows, cols = q.shape
    return (q.reshape(rows, cols // QBLOCK, QBLOCK).astype(np.float32)
            * d.astype(np.float32)[..., None]).reshape(rows, cols)


def quantize_q4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """# [R, C] float -> packed [R, C/2] uint8, d [R, C/32] float16  (Q4_0: d = the block's value of largest
    magnitude / -8, q = clamp(round(w / d) + 8, 0, 15))"""
    b = _blocks(w)
    rows, groups, _ = b.shape
    peak = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]  # [R, G], signed
    d = (peak / -8.0).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d32 != 0, np.rint(b / np.where(d32 != 0, d32, 1)), 0) + 8
    q = np.clip(q, 0, 15).astype(np.uint8)  # [R, G, 32]
    packed = q[..., :QBLOCK // 2] | (q[..., QBLOCK // 2:] << 4)  # [R, G, 16]
    return packed.reshape(rows, groups * QBLOCK // 2), d


def dequantize_q4(packed: np.ndarray, d: np.ndarray) -> np.ndarray:
    """# [R, C/2] uint8, [R, C/32] float16 -> [R, C] float32"""
    rows, half = packed.shape
    groups = half * 2 // QBLOCK
    p = packed.reshape(rows, groups, QBLOCK // 2)
    q = np.concatenate([p & 0x0F, p >> 4], axis=-1).astype(np.int8) - 8  # [R, G, 32]
    return (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(rows, groups * QBLOCK)


def to_float32(a: np.ndarray, name: str = "") -> np.ndarray:
    """A float32 C-contiguous array; no copy when it already is one. FP8 must go through `dequantize`."""
    if a.dtype == FLOAT8:
        raise CheckpointFormatError(f"{name}: float8 weight without its weight_scale_inv")
    if a.dtype not in COMPUTE_DTYPES:
        raise CheckpointFormatError(f"{name}: unsupported weight dtype {a.dtype}",
                                    hint="expected float32, float16, bfloat16 or float8_e4m3fn")
    return np.ascontiguousarray(a, dtype=np.float32)


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = FP8_BLOCK,
               name: str = "") -> np.ndarray:  # [M, N] fp8, [ceil(M/b0), ceil(N/b1)] -> [M, N] f32
    """Block-scaled FP8 as DeepSeek-V3 stores it: w[i, j] * scale_inv[i // b0, j // b1].

    Memory is O(weight) whatever the block size (which the signed config.json chooses): the scales are
    spread over columns only ([ceil(M/b0), N], never more elements than the weight), then each band of b0
    rows is scaled in place through a broadcasting view. A block grid expanded to full blocks before
    cropping would cost b0 * b1 floats per block: 256 MiB for one 8192x8192 block of a 32x32 weight.
    """
    if w.ndim != 2 or scale_inv.ndim != 2:
        raise CheckpointFormatError(f"{name}: fp8 weight and scale must be 2-D, got {w.shape} and {scale_inv.shape}")
    b0, b1 = block
    m, n = w.shape
    expected = (-(-m // b0), -(-n // b1))
    if scale_inv.shape != expected:
        raise CheckpointFormatError(f"{name}: weight_scale_inv shape {scale_inv.shape} does not fit weight "
                                    f"{w.shape} with {b0}x{b1} blocks", hint=f"expected {expected}")
    scale = to_float32(scale_inv, name + "_scale_inv")
    columns = scale[:, np.arange(n) // b1]  # [ceil(M/b0), N]
    out = w.astype(np.float32)
    whole = m // b0  # bands of exactly b0 rows; a ragged last band follows
    if whole:
        bands = out[:whole * b0].reshape(whole, b0, n)  # a view: scaled in place
        bands *= columns[:whole, None, :]
    if m % b0:
        out[whole * b0:] *= columns[whole]
    return out


@cache
def _mxfp4_pairs() -> np.ndarray:
    """# [256 * 256] uint64: for (scale byte << 8 | packed byte), its two float32 weights (low nibble first) as one
    8-byte word. Each is an FP4 value times a power of two: exact, or inf where 2^(s - 127) overflows. 512 KiB."""
    codes = np.arange(256)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = np.ldexp(np.float32(1.0), np.arange(256, dtype=np.int32) - 127).astype(np.float32)
        pairs = np.empty((256, 256, 2), np.float32)
        pairs[:, :, 0] = FP4_E2M1[codes & 0x0F][None, :] * scale[:, None]
        pairs[:, :, 1] = FP4_E2M1[codes >> 4][None, :] * scale[:, None]
    return pairs.view(np.uint64).reshape(256 * 256)


def mxfp4_to_float32(blocks: np.ndarray, scales: np.ndarray, name: str = "") -> np.ndarray:
    """# [R, G, 16] uint8, [R, G] uint8 -> [R, G*32] float32 (MXFP4, as transformers' convert_moe_packed_tensors)

    Byte j of a group holds element 2j in its low nibble and 2j+1 in its high one; the group is scaled by
    2^(scale - 127), exactly (a power of two). A scale of 0xFF (NaN in the MX format) is refused: it would
    make every weight of its group infinite. One table look-up per byte gives both of its weights already
    scaled (`_mxfp4_pairs`); the look-up indices are made for at most _MXFP4_CHUNK bytes at a time.
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointFormatError(f"{name}: MXFP4 blocks and scales must be U8, got {blocks.dtype} and "
                                    f"{scales.dtype}")
    if blocks.ndim != 3 or blocks.shape[2] != MXFP4_GROUP // 2 or scales.shape != blocks.shape[:2]:
        raise CheckpointFormatError(f"{name}: MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match",
                                    hint=f"expected blocks [rows, groups, {MXFP4_GROUP // 2}] and scales "
                                         f"[rows, groups]")
    if np.any(scales == MXFP4_NAN_SCALE):
        raise CheckpointFormatError(f"{name}: MXFP4 scale 0xFF (NaN) in the weights")
    rows, groups, half = blocks.shape
    out = np.empty(blocks.shape, np.uint64)
    table = _mxfp4_pairs()
    step = max(1, _MXFP4_CHUNK // max(1, groups * half))  # rows per look-up: bounded temporaries
    for r in range(0, rows, step):
        index = (scales[r:r + step].astype(np.intp) << 8)[..., None] | blocks[r:r + step]  # [r, G, 16]
        np.take(table, index, out=out[r:r + step], mode="clip")  # "clip" never buffers; every index is in range
    return out.view(np.float32).reshape(rows, groups * 2 * half)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """# [R, C] float (C a multiple of 32) -> blocks [R, C/32, 16] uint8, scales [R, C/32] uint8: the inverse of
    `mxfp4_to_float32` (each group's absmax scaled to at most 6, values rounded to the nearest E2M1 code), for
    building MXFP4 test checkpoints."""
    rows, cols = w.shape
    groups = w.astype(np.float32).reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    absmax = np.abs(groups).max(axis=-1)
    exponent = np.ceil(np.log2(np.maximum(absmax, np.float32(2.0 ** -126)) / 6.0)).astype(np.int32)
    exponent = np.clip(exponent, -127, 127)
    scaled = np.abs(groups) / np.ldexp(np.float32(1.0), exponent)[..., None]
    magnitude = np.abs(scaled[..., None] - FP4_E2M1[:8]).argmin(axis=-1).astype(np.uint8)  # codes 0..7
    codes = magnitude | np.where(groups < 0, np.uint8(8), np.uint8(0))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (exponent + 127).astype(np.uint8)


def quantize_fp8(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `dequantize` (per-block absmax to 448), for building FP8 test checkpoints."""
    b0, b1 = block
    m, n = w.shape
    absw = np.abs(w.astype(np.float32))
    # Per-block absmax by reducing over each block's rows, then its columns: O(weight) for any block size.
    blocks = np.maximum.reduceat(np.maximum.reduceat(absw, np.arange(0, m, b0), axis=0), np.arange(0, n, b1), axis=1)
    scale_inv = np.where(blocks > 0, blocks / 448.0, 1.0).astype(np.float32)
    full = scale_inv[np.arange(m) // b0][:, np.arange(n) // b1]
    return (w / full).astype(FLOAT8), scale_inv


# The table's uniform signatures (`shardtool.formats.Format.pack` / `unpack`): pack (w [out, in], block) -> (data,
# scale or None); unpack (data, scale or None, block) -> [out, in] float32.
def pack_f32(w: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, None]:
    return np.ascontiguousarray(w, np.float32), None


def pack_f16(w: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, None]:
    return np.ascontiguousarray(w, np.float16), None


def pack_bf16(w: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, None]:
    return np.ascontiguousarray(w, BF16), None


def unpack_float(data: np.ndarray, scale: None, block: tuple[int, int] | None) -> np.ndarray:
    return np.ascontiguousarray(data, dtype=np.float32)


def pack_fp8(w: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    return quantize_fp8(w, block or FP8_BLOCK)


def unpack_fp8(data: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    return dequantize(data, scale, block or FP8_BLOCK)


def pack_q8(w: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    return quantize_q8(w)


def unpack_q8(data: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    return dequantize_q8(data, scale)


def pack_q4(w: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    return quantize_q4(w)


def unpack_q4(data: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    return dequantize_q4(data, scale)


def pack_mxfp4(w: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    return quantize_mxfp4(w)


def unpack_mxfp4(data: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    return mxfp4_to_float32(data, scale)


def pack_of(fmt: formats.Format):
    """The format's numpy pack: w [out, in] float, block -> (data, scale or None) (the row's `reference` names it)."""
    return globals()[fmt.reference[0]]


def unpack_of(fmt: formats.Format):
    """The format's numpy unpack: (data, scale, block) -> [out, in] float32."""
    return globals()[fmt.reference[1]]
