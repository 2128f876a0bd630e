"""shardtool's block-quantized expert formats: the one home of their layout (split writes them, the runtime runs them).

Both quantize along a projection's input axis in blocks of `QBLOCK` weights that share one float16 scale `d`,
in the spirit of GGUF's Q8_0 and Q4_0. A projection `<proj>` of shape [out, in] (in a multiple of QBLOCK) is stored
as two safetensors tensors beside each other in the expert's shard:

- int8 ("q8", 8.5 bits/weight): `<proj>.weight` I8 [out, in] and `<proj>.weight_scale` F16 [out, in/32];
  w[r, c] = q[r, c] * d[r, c // 32].
- int4 ("q4", 4.5 bits/weight): `<proj>.weight_q4` U8 [out, in/2] and `<proj>.weight_scale` F16 [out, in/32].
  In block b of row r, byte j (0..15) holds element 32b + j in its low nibble and 32b + j + 16 in its high one
  (Q4_0's order); w = (nibble - 8) * d.

Scales are finite by construction; a reader must refuse a non-finite one. Pure numpy over arrays, no I/O.
"""

from __future__ import annotations

import numpy as np

QBLOCK = 32
Q8, Q4 = "int8", "int4"
SCALE_SUFFIX = "weight_scale"
Q4_SUFFIX = "weight_q4"
BITS_PER_WEIGHT = {Q8: 8 + 16 / QBLOCK, Q4: 4 + 16 / QBLOCK}

# A projection `<proj>` is stored in exactly one form (the runtime's rule; split --quantize applies it too):
# every tensor suffix of a stored form, and the suffix each form's data tensor has (one per form).
FORM_SUFFIXES = ("weight", "weight_scale_inv", SCALE_SUFFIX, Q4_SUFFIX, "weight_blocks", "weight_scales")
FORM_DATA = ("weight", Q4_SUFFIX, "weight_blocks")


def form_tensors(data: str, weight: str) -> tuple[str, ...]:
    """The suffixes of the one form whose data tensor is `<proj>.<data>` (one of FORM_DATA); `weight` is what
    `<proj>.weight` holds: "int8", "fp8" (float8_e4m3fn) or "float". Any other suffix beside them is a stray."""
    if data == "weight_blocks":
        return ("weight_blocks", "weight_scales")
    if data == Q4_SUFFIX or weight == "int8":
        return (data, SCALE_SUFFIX)
    if weight == "fp8":
        return ("weight", "weight_scale_inv")
    return ("weight",)


def quantized_bytes(method: str, rows: int, cols: int) -> int:
    """Bytes of one [rows, cols] projection stored in `method` (weights plus scales)."""
    blocks = rows * (cols // QBLOCK)
    return blocks * (2 + (QBLOCK if method == Q8 else QBLOCK // 2))


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
