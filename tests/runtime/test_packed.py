"""`_packed.pack` against hostile signed tensors: non-finite weights and scales that overflow, misaligned and
non-contiguous views, bad FP8 blocks, tensors of another stored form. Each is one CheckpointFormatError naming the
place and the tensor, with the native scan and with the numpy fallback alike; a well-formed weight still packs."""

from __future__ import annotations

import numpy as np
import pytest

from shardtool.errors import CheckpointFormatError
from shardtool.runtime.model import _packed
from shardtool.runtime.model._dtypes import BF16, FLOAT8

WHERE = "layer 3 expert 5"


@pytest.fixture(params=["avx2", "plain", "numpy"])
def scan(request, monkeypatch):
    """Each test runs with the extension's scans (AVX2 where the CPU has it, and plain C) and the numpy fallback."""
    native = _packed._native
    if request.param == "numpy":
        monkeypatch.setattr(_packed, "_native", None)
    elif native is None or native.use_simd(request.param) != request.param:
        pytest.skip(f"no {request.param} kernels here")
    yield request.param
    if native is not None:
        native.use_simd(True)


def pack(t, shape=(4, 64), **kw):
    return _packed.pack({f"p.{k}": v for k, v in t.items()}, "p", shape, WHERE, **kw)


def fp8(raw: np.ndarray) -> np.ndarray:
    return raw.astype(np.uint8).view(FLOAT8)


def misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of `a` one byte past an aligned address, as a view into a safetensors file may be."""
    buf = np.zeros(a.nbytes + 16, np.uint8)
    start = (-buf.ctypes.data) % 16 + 1
    v = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    v[...] = a
    assert v.ctypes.data % 2 == 1
    return v


# ---------------------------------------------------------------- non-finite weights


def float_weights(dtype, bad: float, at: tuple[int, int]) -> np.ndarray:
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(dtype)
    w[at] = bad
    return w


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [(0, 0), (2, 37), (3, 63)])
def test_a_non_finite_float_weight_is_refused(scan, raises_exactly, dtype, bad, at):
    with raises_exactly(CheckpointFormatError, match=rf"^{WHERE}: p.weight: a NaN or infinite value at "
                                                    rf"\[{at[0]}, {at[1]}\]$"):
        pack({"weight": float_weights(dtype, bad, at)})


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_an_fp8_nan_byte_is_refused(scan, raises_exactly, byte):
    raw = np.full((4, 64), 0x7E, np.uint8)  # 448, the largest finite value
    raw[1, 9] = byte
    with raises_exactly(CheckpointFormatError, match=rf"^{WHERE}: p.weight: a NaN or infinite value at \[1, 9\]$"):
        pack({"weight": fp8(raw), "weight_scale_inv": np.ones((1, 1), np.float32)})


def test_every_finite_encoding_packs_and_every_other_is_found(scan):
    """All 65536 float16 / bfloat16 patterns and all 256 float8 bytes, one at a time: refused exactly when numpy
    says the value is not finite."""
    for kind, dtype, n in [("f16", np.float16, 1 << 16), ("bf16", BF16, 1 << 16), ("fp8", FLOAT8, 256)]:
        raw = np.arange(n, dtype=np.uint32).astype(np.uint16 if n > 256 else np.uint8)
        want = ~np.isfinite(raw.view(dtype).astype(np.float32))
        assert want.sum() == {"f16": 2048, "bf16": 256, "fp8": 2}[kind]
        assert _packed._first_nonfinite(raw[~want].view(dtype), kind) == -1, kind
        for i in np.flatnonzero(want):
            row = raw[:40].copy()
            row[7] = raw[i]
            assert _packed._first_nonfinite(row.view(dtype), kind) == 7, (kind, hex(int(raw[i])))


def test_the_scan_finds_the_first_bad_element_anywhere(scan):
    """Large buffers (several chunks, a ragged tail): the first bad element, not a later one, whatever its place."""
    rng = np.random.default_rng(4)
    for kind, dtype in [("f32", np.float32), ("f16", np.float16), ("bf16", BF16), ("fp8", FLOAT8)]:
        base = rng.standard_normal(50_003).astype(np.float32).astype(dtype)
        assert _packed._first_nonfinite(base, kind) == -1
        for first in (0, 1, 15, 16, 31, 63, 64, 1023, 1024, 2047, 2048, 4095, 4096, 4097, 20_000, 50_000, 50_002):
            a = base.copy()
            a[first] = np.float32("nan")
            if first + 3 < a.size:
                a[first + 3] = np.float32("inf")
            assert _packed._first_nonfinite(a, kind) == first, (kind, first)


def test_finite_weights_of_every_kind_still_pack(scan):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    for dtype, kind in [(np.float32, "f32"), (np.float16, "f16"), (BF16, "bf16")]:
        assert pack({"weight": w.astype(dtype)}).kind == kind
    p = pack({"weight": w.astype(FLOAT8), "weight_scale_inv": np.ones((1, 1), np.float32)})
    assert p.kind == "fp8" and p.scale.dtype == np.float32


# ---------------------------------------------------------------- scales whose products overflow


def test_fp8_scales_up_to_the_cap_are_accepted_and_above_it_refused(raises_exactly):
    cap = _packed.FP8_SCALE_MAX
    with np.errstate(over="ignore"):
        assert np.isfinite(cap * np.float32(448)) and not np.isfinite(np.nextafter(cap, np.float32(np.inf)) * 448)
    weight = fp8(np.full((4, 64), 0x7E, np.uint8))
    for ok in (cap, -cap):
        pack({"weight": weight, "weight_scale_inv": np.full((1, 1), ok, np.float32)})
    for bad in (np.nextafter(cap, np.float32(np.inf)), -np.nextafter(cap, np.float32(np.inf)),
                np.float32(3.4e38)):
        with raises_exactly(CheckpointFormatError, match=rf"^{WHERE}: p.weight_scale_inv: a scale above"):
            pack({"weight": weight, "weight_scale_inv": np.full((1, 1), bad, np.float32)})
    with raises_exactly(CheckpointFormatError, match="scale above"):  # bfloat16 reaches beyond the cap too
        pack({"weight": weight, "weight_scale_inv": np.full((1, 1), 1e38, np.float32).astype(BF16)})


@pytest.mark.parametrize("simd", ["plain", "avx2"])
def test_fp8_at_the_largest_accepted_scale_every_kernel_is_finite(simd):
    """At the cap (448 times it is FLT_MAX, rounded) every kernel path gives the finite reference value: the one-row
    AVX2 kernel multiplies the scale by 256, which stays finite below the cap."""
    _kernels = _packed._native
    if _kernels is None or _kernels.use_simd(simd) != simd:
        pytest.skip("no extension, or no AVX2 on this CPU")
    try:
        for byte in (0x7E, 0x01, 0x40):  # 448, the smallest subnormal, 2
            raw = np.zeros((3, 32), np.uint8)
            raw[:, 5] = byte
            w = pack({"weight": fp8(raw), "weight_scale_inv": np.full((1, 1), _packed.FP8_SCALE_MAX, np.float32)},
                     (3, 32))
            x = np.zeros((2, 32), np.float32)
            x[:, 5] = 1
            want = _packed.to_float32(w)[:, 5]
            assert np.all(np.isfinite(want))
            for m in (1, 2):
                np.testing.assert_array_equal(_packed.matmul_t(x[:m], w), np.tile(want, (m, 1)), err_msg=hex(byte))
    finally:
        _kernels.use_simd(True)


@pytest.mark.parametrize("scale, message", [(0xFD, "0xfd .its weights overflow"), (0xFE, "0xfe .its weights"),
                                            (0xFF, r"0xff \(NaN")])
def test_mxfp4_scales_above_0xfc_are_refused(raises_exactly, scale, message):
    blocks = np.full((4, 2, 16), 0x77, np.uint8)  # every weight 6, the largest E2M1 value
    scales = np.full((4, 2), 0xFC, np.uint8)
    assert pack({"weight_blocks": blocks, "weight_scales": scales}, mxfp4=True).kind == "mxfp4"
    scales[3, 1] = scale
    with raises_exactly(CheckpointFormatError, match=rf"^{WHERE}: p.weight_scales has MXFP4 scale {message}"):
        pack({"weight_blocks": blocks, "weight_scales": scales}, mxfp4=True)


# ---------------------------------------------------------------- layouts: misaligned and strided views


def test_misaligned_views_are_copied_once_and_multiply_right():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    x = misaligned(rng.standard_normal((3, 64)).astype(np.float32))
    cases = {
        "f32": {"weight": misaligned(w)},
        "f16": {"weight": misaligned(w.astype(np.float16))},
        "bf16": {"weight": misaligned(w.astype(BF16))},
        "fp8": {"weight": misaligned(w.astype(FLOAT8)), "weight_scale_inv": misaligned(np.ones((1, 1), np.float32))},
        "q8": {"weight": misaligned(np.ones((8, 64), np.int8)),
               "weight_scale": misaligned(np.full((8, 2), 0.5, np.float16))},
    }
    for kind, t in cases.items():
        p = pack(t, (8, 64))
        assert p.kind == kind
        for a in (p.data, p.scale):
            assert a is None or (a.flags.c_contiguous and a.flags.aligned)
        want = x.astype(np.float64) @ _packed.to_float32(p).astype(np.float64).T
        # (one-row q8 products take x as int16 with a scale per 32: 2^-15 of |x| per weight)
        np.testing.assert_allclose(_packed.matmul_t(x, p), want, rtol=1e-3, atol=1e-2, err_msg=kind)
        np.testing.assert_allclose(_packed.matmul_t(x[:1], p), want[:1], rtol=1e-3, atol=1e-2, err_msg=kind)


def test_an_aligned_contiguous_weight_is_not_copied():
    w = np.ones((4, 64), np.float16)
    assert pack({"weight": w}).data is w


def test_a_strided_fp8_weight_is_made_contiguous():
    d = np.ones((64, 4), np.float32).astype(FLOAT8).T  # [4, 64], not C-contiguous
    p = pack({"weight": d, "weight_scale_inv": np.full((1, 1), 2, np.float32)})
    assert p.data.flags.c_contiguous
    np.testing.assert_array_equal(_packed.matmul_t(np.ones((1, 64), np.float32), p), np.full((1, 4), 128, np.float32))


# ---------------------------------------------------------------- FP8 blocks, tensors of another form


@pytest.mark.parametrize("block", [(0, 128), (128, 0), (-1, 128), (1.5, 128), (True, 128), (128,), "128x128"])
def test_a_bad_fp8_block_is_refused(raises_exactly, block):
    with raises_exactly(CheckpointFormatError, match=rf"^{WHERE}: p: FP8 block .* is not two integers >= 1$"):
        pack({"weight": fp8(np.zeros((4, 64))), "weight_scale_inv": np.ones((1, 1), np.float32)}, fp8_block=block)


FORMS = {  # form: its tensors, well formed, for a (4, 64) weight
    "float": {"weight": np.zeros((4, 64), np.float16)},
    "fp8": {"weight": fp8(np.zeros((4, 64))), "weight_scale_inv": np.ones((1, 1), np.float32)},
    "int8": {"weight": np.zeros((4, 64), np.int8), "weight_scale": np.ones((4, 2), np.float16)},
    "int4": {"weight_q4": np.zeros((4, 32), np.uint8), "weight_scale": np.ones((4, 2), np.float16)},
    "mxfp4": {"weight_blocks": np.zeros((4, 2, 16), np.uint8), "weight_scales": np.full((4, 2), 127, np.uint8)},
}
SCALES = {"weight_scale_inv": np.ones((1, 1), np.float32), "weight_scale": np.ones((4, 2), np.float16),
          "weight_scales": np.full((4, 2), 127, np.uint8)}


@pytest.mark.parametrize("form, stray", [(f, s) for f in sorted(FORMS) for s in sorted(SCALES) if s not in FORMS[f]])
def test_a_tensor_of_another_form_is_refused(raises_exactly, form, stray):
    pack(dict(FORMS[form]), mxfp4=True)
    with raises_exactly(CheckpointFormatError, match=rf"^{WHERE}: p.{stray} beside p.weight"):
        pack({**FORMS[form], stray: SCALES[stray]}, mxfp4=True)
