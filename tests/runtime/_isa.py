"""The `isa` fixture of the native-kernel tests: each test runs on every instruction set the CPU has (the plain C
kernels always; AVX2, and AVX-512 for the one-row block, float32 and float16 products, where available), and leaves the
extension as it found it (the best kernels, one thread)."""

from __future__ import annotations

import pytest

from shardtool.runtime.model import _packed

_kernels = pytest.importorskip("shardtool.runtime.model._kernels", reason="the extension is not built (optional)")

SIMD = [name for name in ("plain", "avx2", "avx512") if _kernels.use_simd(name) == name]
_kernels.use_simd(True)


@pytest.fixture(params=SIMD)
def isa(request):
    assert _kernels.use_simd(request.param) == request.param
    yield request.param
    _kernels.use_simd(True)
    _packed.set_threads(1)
