"""bench_serve.py --vs-llama's phases for real, shortly, against `shardtool serve` on a tiny f32 Mixtral: both
endpoints, streamed and not, at 1 and 2 clients, through the bench's own client loop. (llama-server's side needs its
converter's GGUF, ~20 s of conversion alone: the bench itself checks that side.)
"""

from __future__ import annotations

import subprocess

from benchmarks import _harness, bench_serve

KNOBS = dict(layers=2, experts=4, experts_per_tok=2, hidden=128, intermediate=256, moe_intermediate=256, heads=4,
             kv_heads=2, vocab=512, dtype="f32")
TOKENS = 6
SLOTS = 2


def test_every_phase_is_answered_in_full_with_its_latencies(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_serve, "LLAMA_CLIENTS", (1, SLOTS))
    monkeypatch.setattr(bench_serve, "ONE_CLIENT_REQUESTS", 2)
    ck, key = tmp_path / "ck", tmp_path / "bench"
    _harness.make_mixtral_without_eos(ck, KNOBS)
    subprocess.run([str(_harness.VENV_BIN / "shardtool"), "keygen", "--out", str(key), "--no-passphrase"], check=True,
                   capture_output=True)
    model = _harness.split_and_sign(ck, tmp_path / "model", bench_serve.MODEL_ID, [], key.with_suffix(".key"))
    server = bench_serve.Server.of(tmp_path, [
        str(_harness.VENV_BIN / "shardtool"), "serve", str(model), "--trust", str(key.with_suffix(".pub")), "--port",
        "0", "--model-id", bench_serve.MODEL_ID, "--state-dir", str(tmp_path / "state"), "--memory-budget", "1GiB",
        "--max-context", str(bench_serve.PROMPT_ROOM + TOKENS), "--max-batch", str(SLOTS), "--threads", "1"])
    server.wait_listening(60)
    try:
        got = bench_serve._load_phases(server, TOKENS)
    finally:
        assert server.stop() == 0
    assert got["chat_prompt_tokens"] > len(bench_serve.CHAT[0]["content"].split())  # the template's tokens too
    for mode in bench_serve.MODES:
        assert got["texts"][mode]
        for clients, requests in ((1, 2), (SLOTS, SLOTS)):
            row = got[mode][clients]
            assert row["tokens"] == requests * TOKENS, (mode, clients, row)
            assert row["tokens_per_s"] > 0 and row["stream_tokens_per_s"] > 0, (mode, clients, row)
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"], (mode, clients, row)
            assert 0 < row["tpot_p50_s"] <= row["tpot_p99_s"], (mode, clients, row)
            assert row["tokens_per_chunk"] >= 1, (mode, clients, row)
            assert row["step_ms_per_token"] > 0, (mode, clients, row)  # shardtool's /metrics were read
