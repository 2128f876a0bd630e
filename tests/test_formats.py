"""Stored-weight-format knowledge has one home, the format table (shardtool/formats.py): no other source module spells
a format's name, its kernel kind or the quant_method that declares it, so adding a format is adding a row (and its
kernel). Read from the source text with `ast`; then each row is held to what its numpy reference really writes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from _kit.source import constants
from shardtool import blockquant, formats
from shardtool.safetensors_format import numpy_dtype

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("shardtool", "keys", "manifest", "remote", "checkpoint", "runtime", "serve", "cli")
TABLE_MODULE = Path("shardtool/formats.py")
# the byte arithmetic of a row, as a number literal somewhere else (bits per weight)
ROW_FIGURES = {f.bits_per_weight() for f in formats.TABLE if f.scale is not None}


def _names() -> set[str]:
    return {n for f in formats.TABLE for n in (f.name, f.kernel, f.quant_method) if n}


def _mentions(root: Path) -> list[str]:
    """`path:line: 'literal'` for every string literal outside the table that is a format's name (or a list of them,
    "int8|int4"), and every float literal that is a row's bits per weight. Prose that mentions a format is fine."""
    names = "|".join(map(re.escape, sorted(_names(), key=len, reverse=True)))
    rx = re.compile(rf"\s*(?:{names})(?:\s*[|,/ ]\s*(?:{names}))*\s*")
    return [f"{rel}:{line}: {value!r}" for rel, line, value in constants(root, SOURCE_DIRS, TABLE_MODULE)
            if isinstance(value, str) and rx.fullmatch(value) or isinstance(value, float) and value in ROW_FIGURES]


def test_format_names_appear_only_in_the_table():
    assert _mentions(REPO) == []


def test_the_check_sees_a_format_name_outside_the_table(tmp_path):
    """The test above can fail: a planted kind test, a choice list and a bits-per-weight figure are reported; a
    sentence that mentions a format is not."""
    for folder in SOURCE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "runtime" / "bad.py").write_text('if w.kind == "q8":\n    pass\nm = "int8|int4"\nb = 4.25\n'
                                                 'ok = "stored as int8 blocks"\n')
    (tmp_path / "shardtool" / "formats.py").write_text('ROWS = ("int8", "mxfp4")\n')  # the table itself may
    assert _mentions(tmp_path) == ["runtime/bad.py:1: 'q8'", "runtime/bad.py:3: 'int8|int4'",
                                   "runtime/bad.py:4: 4.25"]


def test_rows_do_not_overlap_and_every_lookup_finds_its_row():
    for key in ("name", "kernel"):
        values = [getattr(f, key) for f in formats.TABLE]
        assert len(values) == len(set(values)), key
    for f in formats.TABLE:
        assert formats.BY_NAME[f.name] is f and formats.BY_KERNEL[f.kernel] is f
        assert formats.stored(f.data, f.dtype) is f
        assert f.quant_method is None or formats.declared(f.quant_method) is f
        assert set(f.tensors) <= set(formats.FORM_SUFFIXES) and f.data in formats.FORM_DATA


def test_the_kernel_kinds_are_the_extensions():
    """Each row's kernel kind is one the C extension knows, in its enum's order (it is looked up by name)."""
    (source,) = [p for p in (REPO / "runtime").rglob("_kernels.c")]
    names = re.search(r"KIND_NAMES\[K_COUNT\]\s*=\s*\{([^}]*)\}", source.read_text()).group(1)
    assert tuple(re.findall(r'"([^"]+)"', names)) == formats.KERNELS


@pytest.mark.parametrize("name, bits", [("f32", 32), ("f16", 16), ("bf16", 16), ("fp8", 8 + 32 / (128 * 128)),
                                        ("int8", 8.5), ("int4", 4.5), ("mxfp4", 4.25)])
def test_bits_per_weight(name, bits):
    assert formats.BY_NAME[name].bits_per_weight() == bits


# (name, [out, in], the bytes the contract counted before the table: `quantized_bytes` / `mxfp4_bytes` formulas)
CONTRACT_BYTES = [
    ("int8 [64, 96]", "int8", (64, 96), 64 * 3 * (2 + 32)),
    ("int4 [64, 96]", "int4", (64, 96), 64 * 3 * (2 + 16)),
    ("mxfp4 [64, 96]", "mxfp4", (64, 96), 64 * 3 * 17),
    ("mxfp4 ragged [5, 40]", "mxfp4", (5, 40), 5 * 2 * 17),
    ("f16 [7, 9]", "f16", (7, 9), 7 * 9 * 2),
    ("fp8 [300, 200]", "fp8", (300, 200), 300 * 200 + 3 * 2 * 4),
]


@pytest.mark.parametrize("case, name, shape, expected", CONTRACT_BYTES, ids=[c[0] for c in CONTRACT_BYTES])
def test_bytes_of_a_projection(case, name, shape, expected):
    assert formats.BY_NAME[name].nbytes(*shape) == expected


@pytest.mark.parametrize("fmt", formats.TABLE, ids=lambda f: f.name)
def test_each_rows_reference_writes_what_the_row_says(fmt):
    """The numpy reference a row names packs [out, in] into tensors of the row's dtypes and shapes, of exactly
    `nbytes` bytes, and unpacks them back to the weight (within the format's rounding)."""
    rng = np.random.default_rng(len(fmt.name))
    out, inp = 6, 4 * 32
    w = rng.standard_normal((out, inp)).astype(np.float32)
    data, scale = blockquant.pack_of(fmt)(w, fmt.block)
    assert data.dtype == numpy_dtype(fmt.dtype) and data.shape == fmt.data_shape(out, inp)
    assert fmt.weight_shape(data.shape) == (out, inp)
    if fmt.scale is None:
        assert scale is None
    else:
        assert scale.dtype == numpy_dtype(fmt.scale_dtype) and scale.shape == fmt.scale_shape(out, inp)
    assert data.nbytes + (0 if scale is None else scale.nbytes) == fmt.nbytes(out, inp)
    back = blockquant.unpack_of(fmt)(data, scale, fmt.block)
    assert back.dtype == np.float32 and back.shape == (out, inp)
    worst = np.abs(back - w).max() / np.abs(w).max()
    assert worst <= ROUNDING[fmt.name], (fmt.name, worst)


# the largest error of a weight, relative to the largest weight: half a step of the format's grid (int4: a whole
# step, its positive side ends one code short of the peak; mxfp4: one unit of E2M1 at a scale above half the peak)
ROUNDING = {"f32": 0.0, "f16": 2.0 ** -11, "bf16": 2.0 ** -8, "fp8": 2.0 ** -4, "int8": 1 / 127, "int4": 1 / 8,
            "mxfp4": 1 / 3}


# (case, data suffix, safetensors dtype, the row it is or None)
STORED = [
    ("float32 weight", "weight", "F32", "f32"),
    ("int8 weight", "weight", "I8", "int8"),
    ("fp8 weight", "weight", "F8_E4M3", "fp8"),
    ("int4 data of a wrong dtype is still int4 (the loader names the dtype)", "weight_q4", "I8", "int4"),
    ("mxfp4 blocks", "weight_blocks", "U8", "mxfp4"),
    ("a weight of no format's dtype", "weight", "I32", None),
    ("no such form", "weight_q3", "U8", None),
]


@pytest.mark.parametrize("case, data, dtype, expected", STORED, ids=[c[0] for c in STORED])
def test_stored_reads_a_projections_form(case, data, dtype, expected):
    got = formats.stored(data, dtype)
    assert (got and got.name) == expected
