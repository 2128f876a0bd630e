"""The one thing pyproject.toml cannot declare stably: the C extension (setuptools' `ext-modules` table in
pyproject.toml is still experimental and warns on every install). Everything else lives in pyproject.toml.

`shardtool.runtime.model._kernels`: products with a weight in its stored dtype (runtime/model/_packed.py falls
back to numpy without it). The source picks its SIMD kernels at run time, so no -march flag: the build runs on any
x86-64 or aarch64 (its AVX-512 intrinsics need GCC 7 or Clang 4 and later; an older compiler fails the build, so
the numpy reference runs). -ffp-contract=off: a product then a sum stay two float32 roundings, never one fused
multiply-add, as in the numpy steps whose bits the fused decode kernels reproduce. The extension is optional: where it cannot be built (no C compiler) the install still
succeeds, with a warning, and the numpy reference runs.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shardtool.runtime.model._kernels", sources=["runtime/model/_kernels.c"],
                             extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-ffp-contract=off"], extra_link_args=["-pthread"],
                             optional=True)])
