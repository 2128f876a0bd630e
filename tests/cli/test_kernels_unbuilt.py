"""Without the native kernels (an install on a machine with no C compiler), a run says so instead of quietly
multiplying in numpy on the one BLAS thread it kept for the kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

BLOCK_KERNELS = textwrap.dedent("""
    import sys
    class _NoKernels:
        def find_spec(self, name, path=None, target=None):
            if name == "shardtool.runtime.model._kernels":
                raise ImportError("not built (test)")
            return None
    sys.meta_path.insert(0, _NoKernels())
""")
PROGRAM = "from shardtool.cli._common import set_compute_threads; print(set_compute_threads(1, 1))"


def _run(tmp_path: Path, *, block: bool, **env: str) -> subprocess.CompletedProcess:
    if block:
        (tmp_path / "sitecustomize.py").write_text(BLOCK_KERNELS)
    clean = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "SHARDTOOL_KERNELS")}
    clean["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + ([clean["PYTHONPATH"]] if "PYTHONPATH" in clean else []))
    return subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env={**clean, **env},
                          timeout=120)


def test_a_run_without_the_kernels_warns_once(tmp_path):
    r = _run(tmp_path, block=True)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "native kernels are not built" in line]
    assert len(lines) == 1 and "numpy" in lines[0], r.stderr


def test_no_warning_with_the_kernels_or_when_they_are_turned_off(tmp_path):
    for block, env in ((False, {}), (True, {"SHARDTOOL_KERNELS": "0"})):
        r = _run(tmp_path, block=block, **env)
        assert r.returncode == 0, r.stderr
        assert "native kernels" not in r.stderr, r.stderr
