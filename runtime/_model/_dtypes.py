"""Stored weight dtypes (F32, F16, BF16, F8_E4M3 with block scales) to float32 for compute."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from shardtool.errors import CheckpointFormatError

FLOAT8 = np.dtype(ml_dtypes.float8_e4m3fn)
COMPUTE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), FLOAT8)
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3 `quantization_config.weight_block_size`


def to_float32(a: np.ndarray, name: str = "") -> np.ndarray:
    """A float32 C-contiguous array; no copy when it already is one. FP8 must go through `dequantize`."""
    if a.dtype == FLOAT8:
        raise CheckpointFormatError(f"{name}: float8 weight without its weight_scale_inv")
    if a.dtype not in COMPUTE_DTYPES:
        raise CheckpointFormatError(f"{name}: unsupported weight dtype {a.dtype}",
                                    hint="expected float32, float16, bfloat16 or float8_e4m3fn")
    return np.ascontiguousarray(a, dtype=np.float32)


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK,
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


def weight_f32(tensors: Mapping[str, np.ndarray], name: str, block: tuple[int, int] = DEFAULT_BLOCK) -> np.ndarray:
    """Tensor `name` as float32, dequantizing FP8 with its `<name>_scale_inv` sibling (`x.weight_scale_inv`)."""
    a = tensors[name]
    if a.dtype != FLOAT8:
        return to_float32(a, name)
    scale_name = name + "_scale_inv"
    if scale_name not in tensors:
        raise CheckpointFormatError(f"{name}: float8 weight without {scale_name}")
    return dequantize(a, tensors[scale_name], block, name)


def quantize_fp8(w: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `dequantize` (per-block absmax to 448), for building FP8 test checkpoints."""
    b0, b1 = block
    m, n = w.shape
    absw = np.abs(w.astype(np.float32))
    # Per-block absmax by reducing over each block's rows, then its columns: O(weight) for any block size.
    blocks = np.maximum.reduceat(np.maximum.reduceat(absw, np.arange(0, m, b0), axis=0), np.arange(0, n, b1), axis=1)
    scale_inv = np.where(blocks > 0, blocks / 448.0, 1.0).astype(np.float32)
    full = scale_inv[np.arange(m) // b0][:, np.arange(n) // b1]
    return (w / full).astype(FLOAT8), scale_inv
