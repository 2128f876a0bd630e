"""bench_loadgen.py: guidellm, unchanged (from .venv-loadgen, `make bench-loadgen`), runs a few seconds straight at
`shardtool serve` on a tiny f32 Mixtral whose every token is an end-of-sequence token: each request answered in full
(guidellm's `ignore_eos`, honoured, is all that keeps it from ending at its first token) and the figures parsed from
guidellm's own JSON report.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import _harness, bench_loadgen, bench_serve
from examples.make_tiny_moe import make_checkpoint

KNOBS = dict(layers=2, experts=4, experts_per_tok=2, hidden=128, intermediate=256, moe_intermediate=256, heads=4,
             kv_heads=2, vocab=512, dtype="f32")
SWEEP = bench_loadgen.Sweep(streams=(2,), seconds=4, prompt_tokens=16, output_tokens=8)


@pytest.mark.slow
@pytest.mark.skipif(bool(bench_loadgen.available()), reason=bench_loadgen.available() or "guidellm is installed")
def test_guidellm_runs_unchanged_against_serve(tmp_path):
    ck, key = tmp_path / "ck", tmp_path / "bench"
    make_checkpoint(ck, "mixtral", **KNOBS)
    config = json.loads((ck / "config.json").read_text())
    config["eos_token_id"] = list(range(KNOBS["vocab"]))  # without ignore_eos, every answer is one token long
    (ck / "config.json").write_text(json.dumps(config))
    subprocess.run([str(_harness.VENV_BIN / "shardtool"), "keygen", "--out", str(key), "--no-passphrase"], check=True,
                   capture_output=True)
    model = _harness.split_and_sign(ck, tmp_path / "model", bench_serve.MODEL_ID, [], key.with_suffix(".key"))

    def start() -> bench_serve.Server:
        return bench_serve.Server.of(tmp_path, [
            str(_harness.VENV_BIN / "shardtool"), "serve", str(model), "--trust", str(key.with_suffix(".pub")),
            "--port", "0", "--model-id", bench_serve.MODEL_ID, "--state-dir", str(tmp_path / "state"),
            "--memory-budget", "1GiB", "--max-context", "64", "--max-batch", "2", "--threads", "1"])

    [level] = bench_loadgen.against(tmp_path, "shardtool serve", start, model, SWEEP)  # the tokenizer: signed dir
    assert level.streams == 2
    assert level.successful > 0 and level.errored == 0, level
    assert 0 < level.ttft_p50_ms <= level.ttft_p99_ms, level
    assert 0 < level.itl_p50_ms <= level.itl_p99_ms, level
    assert level.output_tokens_per_s > 0, level
    report = json.loads((tmp_path / "guidellm-shardtool.json").read_text())
    done = report["benchmarks"][0]["requests"]["successful"]
    assert done and {r["output_tokens"] for r in done} == {SWEEP.output_tokens}
