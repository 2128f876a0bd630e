"""The one table of stored weight formats. Adding a format is adding a row here (and its kernel, and its tests).

Each row says how one projection `<proj>` [out, in] is stored: the suffix and safetensors dtype of its data tensor
and of its scale tensor, the block of weights that share one scale, the bits per weight, the numpy reference that
packs and unpacks it (`shardtool.blockquant`), the native kernel kind that multiplies by it (the runtime binds that
kind to its kernel), and its bytes for the resource contract as a function of [out, in]. Split, the shape checks,
the contract, the CLI and the runtime's loader all ask this table; `tests/test_formats.py` fails if a format's name
is spelled anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str                            # what --quantize, reports and errors call it
    kernel: str                          # the native kernel kind that runs it (the runtime's Packed.kind)
    bits: int                            # bits of one stored weight (the data tensor only)
    dtype: str                           # safetensors dtype of the data tensor
    data: str = "weight"                 # suffix of the data tensor beside `<proj>`
    per_item: int = 1                    # weights per element of the data tensor (two 4-bit weights a byte)
    grouped: bool = False                # data [out, in/block, block/per_item] (MXFP4), not [out, in/per_item]
    block: tuple[int, int] | None = None  # [rows, cols] of weights sharing one scale; None: no scale
    block_from_config: bool = False      # config.json's quantization_config.weight_block_size may choose the block
    scale: str | None = None             # suffix of the scale tensor beside `<proj>`
    scale_dtype: str | None = None       # safetensors dtype of the scale tensor as the reference writes it
    scale_bits: int = 0                  # bits of one scale
    quant_method: str | None = None      # config.json quantization_config.quant_method that declares it
    split: bool = False                  # `split --quantize NAME` writes it from float weights
    trunk: bool = False                  # ... and with --quantize-trunk, the trunk's linear weights too
    # the numpy reference, named in `shardtool.blockquant` (`blockquant.pack_of(fmt)` / `unpack_of(fmt)`: this
    # table stays free of numpy and imports nothing of ours): its pack (w [out, in] float, block) -> (data, scale or None) and unpack (data, scale, block) ->
    # [out, in] float32
    reference: tuple[str, str] = ("", "unpack_float")

    @property
    def tensors(self) -> tuple[str, ...]:
        """The suffixes of the tensors a projection stored in this format has beside `<proj>`, data first."""
        return (self.data,) if self.scale is None else (self.data, self.scale)

    def bits_per_weight(self, block: tuple[int, int] | None = None) -> float:
        """Bits per weight, its share of the scales included (8.5 for int8: 8 + 16 / 32)."""
        b0, b1 = block or self.block or (1, 1)
        return self.bits + (self.scale_bits / (b0 * b1) if self.scale else 0)

    def data_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """# [out, in] -> the stored shape of the data tensor (`cols` a multiple of the block where it packs)"""
        if self.grouped:
            b1 = self.block[1]
            return rows, cols // b1, b1 // self.per_item
        return rows, cols // self.per_item

    def weight_shape(self, stored: tuple[int, ...]) -> tuple[int, int] | None:
        """# the data tensor's stored shape -> the [out, in] weight it stands for; None: no weight's"""
        if self.grouped:
            b1 = self.block[1]
            ok = len(stored) == 3 and stored[2] == b1 // self.per_item
            return (stored[0], b1 * stored[1]) if ok else None
        return (stored[0], self.per_item * stored[1]) if len(stored) == 2 else None

    def scale_shape(self, rows: int, cols: int, block: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """# [out, in] -> the scale tensor's shape [ceil(out/b0), ceil(in/b1)]; None: no scale"""
        if self.scale is None:
            return None
        b0, b1 = block or self.block
        return -(-rows // b0), -(-cols // b1)

    def nbytes(self, rows: int, cols: int, block: tuple[int, int] | None = None) -> int:
        """Bytes of one [rows, cols] projection in this format (data plus scales): the resource contract's figure.
        A block of one row is stored whole (a ragged last block padded, as GGUF's are); a 2-D scale grid (FP8)
        covers an element-wise data tensor."""
        b0, b1 = block or self.block or (1, 1)
        width = -(-cols // b1) * b1 if b0 == 1 else cols
        scales = 0 if self.scale is None else -(-rows // b0) * -(-cols // b1) * self.scale_bits // 8
        return rows * width * self.bits // 8 + scales


F32 = Format("f32", "f32", 32, "F32", reference=("pack_f32", "unpack_float"))
F16 = Format("f16", "f16", 16, "F16", reference=("pack_f16", "unpack_float"))
BF16 = Format("bf16", "bf16", 16, "BF16", reference=("pack_bf16", "unpack_float"))
# DeepSeek-V3's block-scaled FP8: float8_e4m3fn weights, one float32 `weight_scale_inv` per 128 x 128 block
FP8 = Format("fp8", "fp8", 8, "F8_E4M3", block=(128, 128), block_from_config=True, scale="weight_scale_inv",
             scale_dtype="F32", scale_bits=32, quant_method="fp8", reference=("pack_fp8", "unpack_fp8"))
# shardtool's own block formats (GGUF's Q8_0 and Q4_0): a float16 scale per 32 weights of a row
INT8 = Format("int8", "q8", 8, "I8", block=(1, 32), scale="weight_scale", scale_dtype="F16", scale_bits=16,
              split=True, trunk=True, reference=("pack_q8", "unpack_q8"))
INT4 = Format("int4", "q4", 4, "U8", data="weight_q4", per_item=2, block=(1, 32), scale="weight_scale",
              scale_dtype="F16", scale_bits=16, split=True, reference=("pack_q4", "unpack_q4"))
# OCP Microscaling FP4 as gpt-oss stores its experts: 32 E2M1 codes in 16 bytes share one E8M0 scale byte
MXFP4 = Format("mxfp4", "mxfp4", 4, "U8", data="weight_blocks", per_item=2, grouped=True,
               block=(1, 32), scale="weight_scales", scale_dtype="U8", scale_bits=8, quant_method="mxfp4",
               reference=("pack_mxfp4", "unpack_mxfp4"))

TABLE: tuple[Format, ...] = (F32, F16, BF16, FP8, INT8, INT4, MXFP4)
BY_NAME = {f.name: f for f in TABLE}
BY_KERNEL = {f.kernel: f for f in TABLE}
KERNELS = tuple(f.kernel for f in TABLE)
FLOATS = tuple(f for f in TABLE if f.scale is None)  # stored as plain floats: no scale, nothing to dequantize
SPLIT_METHODS = tuple(f.name for f in TABLE if f.split)  # `split --quantize` choices
TRUNK_METHODS = tuple(f.name for f in TABLE if f.trunk)  # a trunk at 4 bits loses too much of the attention
# A projection `<proj>` is stored in exactly one form (the runtime's rule; split --quantize applies it too): each
# form's data tensor suffix, and every suffix of a stored form, in table order.
FORM_DATA = tuple(dict.fromkeys(f.data for f in TABLE))
FORM_SUFFIXES = tuple(dict.fromkeys(s for f in TABLE for s in f.tensors))


def stored(data: str, dtype: str) -> Format | None:
    """The format of a projection whose data tensor is `<proj>.<data>` (one of FORM_DATA) of safetensors dtype
    `dtype`: the one row with that data suffix whatever its dtype (the loader then checks the dtype), else the row
    whose dtype matches; None: no format stores that (an unsupported dtype)."""
    rows = [f for f in TABLE if f.data == data]
    if len(rows) == 1:
        return rows[0]
    return next((f for f in rows if f.dtype == dtype), None)


def declared(quant_method: object) -> Format | None:
    """The format config.json's quantization_config.quant_method declares, or None."""
    return next((f for f in TABLE if f.quant_method is not None and f.quant_method == quant_method), None)

