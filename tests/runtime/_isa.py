"""The `isa` fixture of the native-kernel tests: each test runs on the AVX2 kernels (where the CPU has them) and on
the plain C ones, and leaves the extension as it found it (AVX2 where available, one thread)."""

from __future__ import annotations

import pytest

from shardtool.runtime._model import _packed

_kernels = pytest.importorskip("shardtool.runtime._model._kernels", reason="the extension is not built (optional)")

SIMD = ["plain"] + (["avx2"] if _kernels.use_simd(True) == "avx2" else [])


@pytest.fixture(params=SIMD)
def isa(request):
    assert _kernels.use_simd(request.param == "avx2") == request.param
    yield request.param
    _kernels.use_simd(True)
    _packed.set_threads(1)
