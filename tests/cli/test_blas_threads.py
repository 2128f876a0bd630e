"""Every command that runs the model sizes the compute threads (`set_compute_threads`) before numpy loads: OpenBLAS
sizes its thread pool as it loads, and only an environment variable set before then keeps attention's products on
the one BLAS thread the native kernels leave it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Stops the command at its set_compute_threads call and says whether numpy was loaded by then.
PROGRAM = textwrap.dedent("""
    import sys
    from shardtool.cli import _common, main
    def stop(threads, readers):
        print("numpy loaded" if "numpy" in sys.modules else "numpy not loaded")
        raise SystemExit(99)
    _common.set_compute_threads = stop
    main(sys.argv[1:])
""")


@pytest.mark.parametrize("command", [
    pytest.param(["serve", "{model}", "--trust", "{key}", "--port", "0", "--memory-budget", "1GiB"], id="serve"),
    pytest.param(["verify-and-run", "{model}", "--trust", "{key}", "--prompt-ids", "1,2"], id="verify-and-run"),
])
def test_the_compute_threads_are_sized_before_numpy_loads(tmp_path: Path, command: list[str]):
    model, key = tmp_path / "model", tmp_path / "key.pub"
    model.mkdir()
    key.write_text("not read before the threads are sized\n")
    argv = [part.format(model=model, key=key) for part in command]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                                            "OMP_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", PROGRAM, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 99, (r.stdout, r.stderr[-2000:])
    assert r.stdout.strip() == "numpy not loaded"
