"""Stored weight dtypes (F32, F16, BF16, F8_E4M3 with block scales, MXFP4 blocks with E8M0 scales) to float32.

The numpy references themselves live on the base floor beside the table of stored formats (`shardtool.blockquant`,
named by `shardtool.formats`); the model's code imports them from here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shardtool import formats
from shardtool.blockquant import (BF16, COMPUTE_DTYPES, FLOAT8, FP4_E2M1, MXFP4_NAN_SCALE, dequantize,
                                  mxfp4_to_float32, quantize_mxfp4, to_float32)
from shardtool.errors import CheckpointFormatError

DEFAULT_BLOCK = formats.FP8.block  # DeepSeek-V3 `quantization_config.weight_block_size`
MXFP4_GROUP = formats.MXFP4.block[1]
__all__ = ["BF16", "COMPUTE_DTYPES", "DEFAULT_BLOCK", "FLOAT8", "FP4_E2M1", "MXFP4_GROUP", "MXFP4_NAN_SCALE",
           "dequantize", "finite", "mxfp4_to_float32", "quantize_mxfp4", "to_float32", "weight_f32"]


def finite(array: np.ndarray, what: str) -> np.ndarray:
    """A small float32 vector (norm weights, biases), refused by name when a value is NaN or infinite."""
    if not np.isfinite(array).all():
        raise CheckpointFormatError(f"{what}: a NaN or infinite value")
    return array


def weight_f32(tensors: Mapping[str, np.ndarray], name: str, block: tuple[int, int] = DEFAULT_BLOCK) -> np.ndarray:
    """Tensor `name` as float32, dequantizing FP8 with its `<name>_scale_inv` sibling (`x.weight_scale_inv`)."""
    a = tensors[name]
    if a.dtype != FLOAT8:
        return to_float32(a, name)
    scale_name = name + "_scale_inv"
    if scale_name not in tensors:
        raise CheckpointFormatError(f"{name}: float8 weight without {scale_name}")
    return dequantize(a, tensors[scale_name], block, name)
