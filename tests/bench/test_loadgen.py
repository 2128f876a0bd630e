"""bench_loadgen.py: the relay drops exactly the two vLLM extensions `serve` refuses, and guidellm, unchanged (from
.venv-loadgen, `make bench-loadgen`), runs a few seconds against `shardtool serve` on a tiny f32 Mixtral with every
request answered in full and its figures parsed from guidellm's own JSON report.
"""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import _harness, _relay, bench_loadgen, bench_serve

# name, body as guidellm (or any client) sent it, body the relay forwards
BODIES = [
    ("guidellm_streamed_completion",
     {"model": "m", "prompt": "a b", "stream": True, "max_tokens": 8, "stop": None, "ignore_eos": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     {"model": "m", "prompt": "a b", "stream": True, "max_tokens": 8, "stop": None,
      "stream_options": {"include_usage": True}}),
    ("nothing_to_drop", {"model": "m", "prompt": [5, 6], "max_tokens": 2},
     {"model": "m", "prompt": [5, 6], "max_tokens": 2}),
    ("ignore_eos_false_dropped_too", {"model": "m", "ignore_eos": False}, {"model": "m"}),
    ("stream_options_not_an_object_kept", {"stream_options": "x"}, {"stream_options": "x"}),
    ("a_field_of_the_same_name_nested_elsewhere_kept", {"logit_bias": {"ignore_eos": 1}},
     {"logit_bias": {"ignore_eos": 1}}),
    ("not_an_object", [1, 2], [1, 2]),
]


@pytest.mark.parametrize("sent, forwarded", [c[1:] for c in BODIES], ids=[c[0] for c in BODIES])
def test_the_relay_drops_exactly_the_two_extensions(sent, forwarded):
    assert _relay.strip(sent) == forwarded


KNOBS = dict(layers=2, experts=4, experts_per_tok=2, hidden=128, intermediate=256, moe_intermediate=256, heads=4,
             kv_heads=2, vocab=512, dtype="f32")
SWEEP = bench_loadgen.Sweep(streams=(2,), seconds=4, prompt_tokens=16, output_tokens=8)


@pytest.mark.slow
@pytest.mark.skipif(bool(bench_loadgen.available()), reason=bench_loadgen.available() or "guidellm is installed")
def test_guidellm_runs_unchanged_against_serve(tmp_path):
    ck, key = tmp_path / "ck", tmp_path / "bench"
    _harness.make_mixtral_without_eos(ck, KNOBS)
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
