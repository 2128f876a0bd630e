"""The native kernels behind `_packed.matmul_t` against the numpy reference: every stored kind, one row and several,
one thread and two, the AVX2 kernels and the plain C ones; hostile buffers refused with ValueError."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from shardtool import blockquant
from shardtool.runtime.model import _dtypes, _packed

_kernels = pytest.importorskip("shardtool.runtime.model._kernels", reason="the extension is not built (optional)")
from shardtool.runtime.model._packed import Packed

from _isa import SIMD, isa  # noqa: E402,F401  (the fixture: every instruction set the CPU has)


def make(kind: str, out: int, inp: int, rng: np.random.Generator, block=(128, 128)) -> Packed:
    w = rng.standard_normal((out, inp)).astype(np.float32)
    return _packed.from_float(w * 3 if kind == "fp8" else w, kind, block)


def check(x: np.ndarray, w: Packed) -> np.ndarray:
    """The kernel's product equals x @ W.T in float64 (W expanded by the reference) within float32 accumulation
    error: |error| <= in * 2^-23 * (|x| @ |W|.T), elementwise; for the block kinds (q8, q4, mxfp4), whose one-row
    AVX2 kernels take x as int16 with a power-of-two scale per block of 32, also 2^-15 * the block's largest |x|
    per weight. A wrong element or scale is off by O(|product|)."""
    f = _packed.to_float32(w).astype(np.float64)
    x64 = x.astype(np.float64)
    y = _packed.matmul_t(x, w)
    assert y.dtype == np.float32 and y.shape == (x.shape[0], w.shape[0])
    bound = w.shape[1] * 2.0 ** -23 * (np.abs(x64) @ np.abs(f).T) + 1e-30
    if w.kind in ("q8", "q4", "mxfp4"):
        peaks = np.repeat(np.abs(x64).reshape(x.shape[0], -1, blockquant.QBLOCK).max(axis=-1), blockquant.QBLOCK, -1)
        bound += 2.0 ** -15 * (peaks @ np.abs(f).T)
    err = np.abs(y - x64 @ f.T)
    assert np.all(err <= bound), f"{w.kind}: worst error {float((err / bound).max()):.3g} x the bound"
    return y


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("kind", _packed.KINDS)
def test_each_kind_matches_the_reference(isa, kind, m, threads):
    assert _packed.kernels() == isa
    rng = np.random.default_rng(hash((kind, m, threads)) & 0xFFFF)
    _packed.set_threads(threads)
    block = kind in ("q8", "q4", "mxfp4")
    # ragged row counts (odd, not a multiple of the split), inputs with SIMD tails for the float kinds
    for out, inp in [(37, 96 if block else 100), (1, 32), (3, 64 if block else 7), (8, 32 if block else 13),
                     (129, 320 if block else 333)]:
        x = rng.standard_normal((m, inp)).astype(np.float32)
        check(x, make(kind, out, inp, rng))


@pytest.mark.skipif("avx512" not in SIMD, reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("kind", ["q8", "q4", "mxfp4", "f32", "f16", "bf16"])
def test_avx512_kernels_are_the_ones_that_run(kind):
    """With 'avx512' chosen, a one-row product goes through the 512-bit kernels: they group the float sums
    differently from the AVX2 ones, so over many rows some results differ in their last bits (and all agree within the
    reference's bound, `check`). Were the AVX-512 branch skipped, every row would equal AVX2's. x's blocks span
    2^-12..2^12: with x of one magnitude, MXFP4's power-of-two scales keep every partial sum exact in either order."""
    rng = np.random.default_rng(11)
    w = make(kind, 256, 512, rng)
    x = (rng.standard_normal((1, 512)) * np.repeat(2.0 ** rng.integers(-12, 13, 16), 32)).astype(np.float32)
    got = {}
    try:
        for level in ("avx2", "avx512"):
            assert _kernels.use_simd(level) == level
            got[level] = check(x, w)
    finally:
        _kernels.use_simd(True)
    assert not np.array_equal(got["avx2"], got["avx512"])


def test_use_simd_takes_a_bool_or_a_level_name_only():
    try:
        assert _kernels.use_simd("plain") == "plain" and _kernels.use_simd(False) == "plain"
        assert _kernels.use_simd(True) == SIMD[-1]
        for bad in ("avx2\x00junk", "AVX2", "sse", ""):
            with pytest.raises(ValueError, match="use_simd: expected"):
                _kernels.use_simd(bad)
        for bad in (b"plain", 2, 1.0, None, [1]):
            with pytest.raises(TypeError, match="use_simd: expected a bool"):
                _kernels.use_simd(bad)
        assert _kernels.isa() == SIMD[-1]  # a refused call changes nothing
    finally:
        _kernels.use_simd(True)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_float_kinds_at_every_tail_length(isa, kind):
    """The one-row float kernels step 32, 16 or 8 weights at a time and finish the rest by masked loads or one by one:
    every input length up to 80 (each step's remainder, and four-row groups with a leftover row) against the
    reference."""
    rng = np.random.default_rng(5)
    for inp in range(1, 81):
        check(rng.standard_normal((1, inp)).astype(np.float32), make(kind, 6, inp, rng))


@pytest.mark.parametrize("kind", ["q8", "q4", "mxfp4"])
def test_one_row_block_products_do_not_depend_on_the_row_grouping(isa, kind):
    """The AVX2 and AVX-512 one-row q8/q4/mxfp4 kernels take four weight rows at a time; each row's sum must be formed
    exactly as the single-row kernel forms it (ragged row counts, block counts around the eight-block scale chunks)."""
    rng = np.random.default_rng(7)
    for out, inp in [(7, 32), (13, 96), (9, 256), (11, 288), (6, 544)]:
        w = make(kind, out, inp, rng)
        x = (rng.standard_normal((1, inp)) * 3).astype(np.float32)
        rows = [_packed.matmul_t(x, Packed(kind, (1, inp), w.data[r:r + 1].copy(), w.scale[r:r + 1].copy()))
                for r in range(out)]
        assert np.array_equal(_packed.matmul_t(x, w), np.concatenate(rows, axis=1)), (out, inp)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "fp8"])
def test_a_prefill_rows_bits_do_not_depend_on_how_many_rows_came_with_it(isa, kind):
    """Several x rows (prefill) are taken three at a time, in tiles of x that stay in L1, the rest two or one at a
    time; every row's sum is formed in the same order whichever of them computed it, so each row of an m-row product
    is the bits of the same row in a two-row product (row counts around the tile and the threes, inputs with SIMD
    tails, weight row counts not a multiple of four)."""
    rng = np.random.default_rng(13)
    for out, inp in [(1024, 512), (512, 1024), (37, 100), (9, 333)]:
        w = make(kind, out, inp, rng)
        x = rng.standard_normal((70, inp)).astype(np.float32)
        pairs = np.concatenate([_packed.matmul_t(x[i:i + 2], w) for i in range(0, 70, 2)])
        for m in (3, 4, 5, 7, 17, 67, 70):
            assert np.array_equal(_packed.matmul_t(x[:m], w), pairs[:m]), (out, inp, m)


@pytest.mark.parametrize("kind", _packed.KINDS)
def test_a_products_bits_do_not_depend_on_the_thread_count(isa, kind):
    """Rows are computed four at a time (each a quarter's stream) and the rest one by one by a kernel that sums in
    another order; each thread's share of the rows is a multiple of four, so the same rows are left over, and every
    output is the same bits, on one thread or two (row counts whose even split is not a multiple of four)."""
    rng = np.random.default_rng(11)
    for out, inp in [(1000, 64), (1027, 96), (130, 160)]:  # (each above the size that splits a product)
        w = make(kind, out, inp, rng)
        for m in (1, 3):
            x = rng.standard_normal((m, inp)).astype(np.float32)
            _packed.set_threads(1)
            one = _packed.matmul_t(x, w)
            _packed.set_threads(2)
            assert np.array_equal(_packed.matmul_t(x, w), one), (out, inp, m)


@pytest.mark.parametrize("block", [(7, 24), (128, 128), (1, 1), (300, 5), (2, 300)])
def test_fp8_ragged_blocks(isa, block):
    rng = np.random.default_rng(block[0] * 1000 + block[1])
    for threads in (1, 2):
        _packed.set_threads(threads)
        for m in (1, 3):
            x = rng.standard_normal((m, 300)).astype(np.float32)
            check(x, make("fp8", 37, 300, rng, block))


@pytest.mark.parametrize("kind", ["q8", "q4", "mxfp4"])
def test_block_kinds_with_a_non_finite_input(isa, kind):
    """x with inf/NaN cannot be scaled to int16: the float kernels run and inf/NaN propagate as in the reference."""
    rng = np.random.default_rng(11)
    w = make(kind, 9, 64, rng)
    for bad in (np.inf, np.nan):
        x = rng.standard_normal((1, 64)).astype(np.float32)
        x[0, 40] = bad
        with np.errstate(invalid="ignore"):
            want = _packed.to_float32(w).astype(np.float64) @ x[0].astype(np.float64)
        got = _packed.matmul_t(x, w)[0]
        assert not np.isfinite(want).any()
        np.testing.assert_array_equal(got, want.astype(np.float32))  # the same infinities, NaN where NaN


@pytest.mark.parametrize("kind", ["q8", "q4", "mxfp4"])
def test_block_kinds_at_the_edges_of_the_int16_input(isa, kind):
    """Blocks of x whose peak rounds up to 2^15 (saturated), all-zero blocks, huge and tiny blocks."""
    rng = np.random.default_rng(12)
    w = make(kind, 20, 192, rng)
    x = rng.standard_normal((1, 192)).astype(np.float32)
    x[0, 0] = np.nextafter(np.float32(1), np.float32(0))  # the largest float below 1: * 2^15 rounds to 32768
    x[0, 1:32] = rng.uniform(-1, 1, 31)
    x[0, 32:64] = 0
    x[0, 64:96] *= np.float32(1e30)
    x[0, 96:128] = -x[0, 0]
    check(x, w)
    x[0, :] = rng.standard_normal(192).astype(np.float32) * np.float32(1e-36)  # 2^-k below the normal floats
    y = _packed.matmul_t(x, w)[0].astype(np.float64)
    want = _packed.to_float32(w).astype(np.float64) @ x[0].astype(np.float64)
    assert np.all(np.abs(y - want) <= 1e-3 * np.abs(_packed.to_float32(w)).astype(np.float64) @ np.abs(x[0]))


def test_block_kinds_at_the_largest_accepted_scales_with_a_huge_input(isa):
    """A block of zero weights under the largest scale `pack` accepts (MXFP4 0xFC, float16 65504) and x huge there:
    the reference gives that block 0; scaling x to int16 must not make the block's scale infinite (0 * inf = NaN)."""
    rng = np.random.default_rng(13)
    for kind, peak in [("mxfp4", 2.0 ** 20), ("q8", 2.0 ** 126), ("q4", 2.0 ** 126)]:
        w = make(kind, 4, 64, rng)
        if kind == "mxfp4":
            data, scale = w.data.copy(), w.scale.copy()
            data[:, 0] = 0
            scale[:, 0] = 0xFC
        else:
            data, scale = w.data.copy(), w.scale.copy()
            data[:, :16 if kind == "q4" else 32] = 0x88 if kind == "q4" else 0  # q4: code 8 is zero
            scale[:, 0] = 65504
        w = Packed(kind, w.shape, data, scale)
        x = rng.standard_normal((1, 64)).astype(np.float32)
        x[0, :32] = rng.uniform(-1, 1, 32) * peak
        want = _packed.to_float32(w).astype(np.float64) @ x[0].astype(np.float64)
        got = _packed.matmul_t(x, w)[0]
        assert np.all(np.isfinite(want)) and np.all(np.isfinite(got)), (kind, got)
        check(x, w)


def one_hot_rows(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [v, 0, ..., 0] (16 inputs, so the SIMD path reads them) and x = e0: y[r] is exactly element v."""
    rows = np.zeros((data.size, 16), data.dtype)
    rows[:, 0] = data
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 1
    return rows, x


def test_every_fp8_and_half_value_exactly(isa):
    """Each of the 256 float8_e4m3fn bytes (NaN included) and 65536 float16 / bfloat16 bit patterns."""
    for kind, raw, dtype in [("fp8", np.arange(256, dtype=np.uint8), _dtypes.FLOAT8),
                             ("f16", np.arange(65536, dtype=np.uint32).astype(np.uint16), np.float16),
                             ("bf16", np.arange(65536, dtype=np.uint32).astype(np.uint16), _dtypes.BF16)]:
        rows, x = one_hot_rows(raw.view(dtype))
        scale = np.ones((-(-rows.shape[0] // 128), 1), np.float32) if kind == "fp8" else None
        w = Packed(kind, rows.shape, rows, scale, (128, 128) if kind == "fp8" else None)
        np.testing.assert_array_equal(_packed.matmul_t(x, w)[0], _packed.to_float32(w)[:, 0], err_msg=kind)


def test_every_mxfp4_byte_and_scale(isa):
    """Each packed byte (both nibbles, x selecting one) under every E8M0 scale whose weights stay finite (up to
    2^125: 6 * 2^126 overflows float32, and the unselected nibble's inf times x's 0 would be NaN): exact."""
    codes = np.arange(256, dtype=np.uint8)
    for nibble in (0, 1):
        blocks = np.zeros((256 * 253, 1, 16), np.uint8)
        blocks[:, 0, 0] = np.tile(codes, 253)
        scales = np.repeat(np.arange(253, dtype=np.uint8), 256)[:, None]
        w = Packed("mxfp4", (blocks.shape[0], 32), blocks, scales)
        x = np.zeros((1, 32), np.float32)
        x[0, nibble] = 1
        want = _packed.to_float32(w)[:, nibble]
        np.testing.assert_array_equal(_packed.matmul_t(x, w)[0], want)


def test_reference_path_gives_the_same_result(monkeypatch):
    rng = np.random.default_rng(7)
    for kind in _packed.KINDS:
        w = make(kind, 33, 64, rng)
        x = rng.standard_normal((2, 64)).astype(np.float32)
        native = _packed.matmul_t(x, w)
        monkeypatch.setattr(_packed, "_native", None)
        assert _packed.kernels() is None
        reference = _packed.matmul_t(x, w)
        monkeypatch.undo()
        np.testing.assert_allclose(native, reference, rtol=1e-4, atol=1e-4 * float(np.abs(reference).max()))


def test_environment_variable_forces_the_reference():
    code = "from shardtool.runtime.model import _packed; print(_packed.kernels())"
    for value, want in [("0", "None"), ("1", SIMD[-1])]:
        env = {**os.environ, "SHARDTOOL_KERNELS": value}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == want


def misaligned(a: np.ndarray) -> np.ndarray:
    """A writable copy of `a` starting one byte past an aligned address (a safetensors view may start anywhere)."""
    buf = np.zeros(a.nbytes + 16, np.uint8)
    start = (-buf.ctypes.data) % 16 + 1
    v = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    v[...] = a
    return v


def call(**change):
    """One valid q8 product through the extension, with `change` substituted."""
    rng = np.random.default_rng(1)
    q, d = blockquant.quantize_q8(rng.standard_normal((4, 64)).astype(np.float32))
    args = dict(kind="q8", x=np.ones((2, 64), np.float32), data=q, scale=d, y=np.empty((2, 4), np.float32), m=2,
                out=4, inp=64, b0=0, b1=0, threads=1)
    args.update(change)
    _kernels.matmul(*args.values())
    return args["y"]


def test_a_valid_call_works():
    call()


@pytest.mark.parametrize("change, message", [
    (dict(x=np.ones((2, 128), np.float32)[:, ::2]), "x: expected a C-contiguous"),
    (dict(x=np.ones((2, 64), np.float64)), "x: expected format 'f'"),
    (dict(x=np.ones((2, 63), np.float32)), "x: expected 128 items"),
    (dict(data=np.zeros((4, 64), np.uint8)), "data: expected format 'b'"),
    (dict(data=np.zeros((4, 60), np.int8)), "data: expected 256 items"),
    (dict(data=np.zeros((4, 64), np.int8).T), "data: expected a C-contiguous"),
    (dict(scale=np.ones((4, 1), np.float16)), "scale: expected 8 items"),
    (dict(scale=np.ones((4, 2), np.float32)), "scale: expected format 'e'"),
    (dict(scale=None), "a scale is required"),
    (dict(y=np.empty((2, 3), np.float32)), "y: expected 8 items"),
    (dict(y=np.frombuffer(bytes(32), np.float32)), "y: expected a C-contiguous writable"),
    (dict(m=3), "x: expected 192 items"),
    (dict(inp=48, data=np.zeros((4, 48), np.int8)), "not a multiple of 32"),
    (dict(kind="q5"), "unknown weight kind"),
    (dict(threads=0), "threads=0"),
    (dict(m=0), "out of range"),
    (dict(out=-1), "out of range"),
    (dict(out=2 ** 40), "out of range"),
    (dict(out=-2 ** 70), "out=-1180591620717411303424 out of range"),
    (dict(m=2 ** 70), "m=1180591620717411303424 out of range"),
    (dict(threads=2 ** 40), "threads=1099511627776"),
    (dict(threads=2 ** 100), "threads=1267650600228229401496703205376 out of range"),
    (dict(b0=2 ** 64), "b0=18446744073709551616 out of range"),
    (dict(x=misaligned(np.ones((2, 64), np.float32))), "x: address not aligned to its 4-byte items"),
    (dict(scale=misaligned(np.ones((4, 2), np.float16))), "scale: address not aligned to its 2-byte items"),
    (dict(y=misaligned(np.empty((2, 4), np.float32))), "y: address not aligned to its 4-byte items"),
])
def test_hostile_buffers_are_refused(change, message, raises_exactly):
    with raises_exactly(ValueError, match=message):
        call(**change)


def test_integer_arguments_of_another_type_are_a_type_error():
    for change in (dict(threads=1.0), dict(m="2"), dict(b0=None)):
        with pytest.raises(TypeError, match="expected an int"):
            call(**change)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_a_misaligned_weight_is_refused(kind):
    w = misaligned(make(kind, 4, 64, np.random.default_rng(2)).data)
    raw = w.view(np.uint16) if kind == "bf16" else w
    with pytest.raises(ValueError, match=f"data: address not aligned to its {w.itemsize}-byte items"):
        _kernels.matmul(kind, np.ones((1, 64), np.float32), raw, None, np.empty((1, 4), np.float32), 1, 4, 64, 0, 0,
                        1)


@pytest.mark.parametrize("kind, dtype", [("f32", np.float32), ("f16", np.float16), ("bf16", np.uint16),
                                         ("fp8", np.uint8)])
def test_nonfinite_scan_checks_its_buffer(kind, dtype, raises_exactly):
    a = np.zeros(64, dtype)
    assert _kernels.nonfinite(kind, a) == -1
    assert _kernels.nonfinite(kind, a[:0]) == -1
    with raises_exactly(ValueError, match="data: expected format"):
        _kernels.nonfinite(kind, np.zeros(64, np.int64))
    with raises_exactly(ValueError, match="data: expected a C-contiguous"):
        _kernels.nonfinite(kind, np.zeros(128, dtype)[::2])
    if a.itemsize > 1:
        with raises_exactly(ValueError, match="data: address not aligned"):
            _kernels.nonfinite(kind, misaligned(a))
    with raises_exactly(ValueError, match="is not f32, f16, bf16 or fp8"):
        _kernels.nonfinite("q8", a)


def test_hostile_buffers_of_other_kinds():
    x = np.ones((1, 64), np.float32)
    y = np.empty((1, 4), np.float32)
    with pytest.raises(ValueError, match="no scale expected"):
        _kernels.matmul("f32", x, np.zeros((4, 64), np.float32), np.ones(4, np.float16), y, 1, 4, 64, 0, 0, 1)
    with pytest.raises(ValueError, match="block"):
        _kernels.matmul("fp8", x, np.zeros((4, 64), np.uint8), np.ones((1, 1), np.float32), y, 1, 4, 64, 0, 0, 1)
    with pytest.raises(ValueError, match="scale: expected 2 items"):  # fp8 [ceil(4/2), ceil(64/64)] scales
        _kernels.matmul("fp8", x, np.zeros((4, 64), np.uint8), np.ones((1, 1), np.float32), y, 1, 4, 64, 2, 64, 1)
    with pytest.raises(ValueError, match="data: expected 128 items"):  # q4: two weights a byte
        _kernels.matmul("q4", x, np.zeros((4, 64), np.uint8), np.ones((4, 2), np.float16), y, 1, 4, 64, 0, 0, 1)
    with pytest.raises(ValueError, match="scale: expected format 'B'"):  # mxfp4: E8M0 bytes
        _kernels.matmul("mxfp4", x, np.zeros((4, 2, 16), np.uint8), np.ones((4, 2), np.float16), y, 1, 4, 64, 0, 0,
                        1)
    buf = np.zeros(4 * 64 + 4, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        _kernels.matmul("f32", x, buf[:256], None, buf[252:256], 1, 4, 64, 0, 0, 1)
    # a Packed built around the checks of `pack` still cannot make the kernel read out of bounds
    with pytest.raises(ValueError, match="data: expected 256 items"):
        _packed.matmul_t(x, Packed("bf16", (4, 64), np.zeros((4, 63), _dtypes.BF16)))


def test_set_threads_checks_its_argument():
    for bad in (0, -1, _packed.MAX_THREADS + 1, 1.5, True, "2"):
        with pytest.raises(ValueError):
            _packed.set_threads(bad)  # type: ignore[arg-type]


def test_concurrent_callers_and_a_forked_child_get_right_products():
    """Two Python threads using the pool at once (one computes alone while the other holds it), then a child
    forked after the pool started (its workers do not exist there) builds its own pool."""
    rng = np.random.default_rng(3)
    w = make("bf16", 301, 512, rng)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    _packed.set_threads(2)
    try:
        want = _packed.to_float32(w).astype(np.float64) @ x[0].astype(np.float64)
        failures = []

        def work():
            for _ in range(200):
                if not np.allclose(_packed.matmul_t(x, w)[0], want, rtol=1e-4, atol=1e-3):
                    failures.append(1)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not failures
        child = multiprocessing.get_context("fork").Process(target=_child_product, args=(x, w, want))
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
            pytest.fail("the forked child hung in the kernel's thread pool")
        assert child.exitcode == 0
    finally:
        _packed.set_threads(1)


def _child_product(x, w, want):
    os._exit(0 if np.allclose(_packed.matmul_t(x, w)[0], want, rtol=1e-4, atol=1e-3) else 1)
