"""The serving load generator (benchmarks/_serve_load.py) against the installed `shardtool serve` on an emulated
small machine (benchmarks/_machine.py): concurrent openai clients get the tokens verify-and-run gives, the windows
carry the server's expert reads and the machine's disk reads, and nothing of the machine is left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _kit.cli import argv, ok, user_env
from benchmarks import _machine, _serve_load

MIB = 2**20
MODEL_ID = "test/serve-load"
# The server's own resident set is ~90 MiB here; the rest of the cap is page cache for its libraries and the model.
MACHINE = _machine.Machine(memory_bytes=256 * MIB, read_bps=200_000_000)
KNOBS = dict(layers=3, experts=16, hidden=256, moe_intermediate=512, vocab=512, mtp_layers=0)
PROMPT = [5, 17, 300, 42]
TOKENS = 12
CLIENTS = (1, 3)


@pytest.fixture(scope="module")
def model(tiny):
    return tiny.release("deepseek_v3", model_id=MODEL_ID, **KNOBS), tiny.keypair().with_suffix(".pub")


def _serve(model, work: Path) -> list[str]:
    directory, pub = model
    return argv("shardtool", "serve", directory, "--trust", pub, "--state-dir", work / "state", "--port", "0",
                "--model-id", MODEL_ID, "--memory-budget", "40MiB", "--max-context", "64", "--max-batch", "4")


def _own_cgroups() -> list[Path]:
    return [p for p in _machine.CGROUP_ROOT.rglob(f"shardtool-machine-{os.getpid()}-*")]


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> str:
    """verify-and-run's greedy text for PROMPT, uncapped (its stdout ends with one newline)."""
    work = tmp_path_factory.mktemp("reference")
    r = ok("verify-and-run", model[0], "--trust", model[1], "--prompt-ids", ",".join(map(str, PROMPT)),
           "--max-new-tokens", TOKENS, "-q", "--memory-budget", "64MiB", state=work)
    assert r.out.endswith("\n")
    return r.out[:-1]


def test_rows_per_client_count_with_the_reference_tokens(model, reference, tmp_path):
    try:
        rows = _serve_load.measure_serving(_serve(model, tmp_path), MACHINE, model[0], model=MODEL_ID, prompt=PROMPT,
                                           max_tokens=TOKENS, clients=CLIENTS, log=tmp_path / "serve.log",
                                           env=user_env(tmp_path / "xdg"), reference=reference, ready_timeout=120)
    except _machine.MachineUnavailableError as e:
        pytest.skip(f"no emulated machine here: {e}")
    assert [r.clients for r in rows] == list(CLIENTS)
    for row in rows:
        assert row.errors == () and row.agree, row
        assert row.tokens == row.clients * TOKENS and row.tokens_per_s > 0
        assert 0 < row.latency_p50_s <= row.latency_max_s <= row.seconds
        assert row.expert_bytes_per_token is not None and row.expert_bytes_per_token > 0
        assert row.device_bytes_per_token >= 0
        assert 0 < row.server_rss_peak_bytes < row.peak_memory_bytes <= MACHINE.memory_bytes
        assert row.oom_kills == 0
    assert _own_cgroups() == []


def test_a_wrong_reference_a_missing_metric_and_a_server_that_dies(model, reference, tmp_path):
    """Each check can fail: another reference disagrees, a metric the server does not export is None, and a server
    that exits before it is ready is reported with its log, not waited for."""
    try:
        with _machine.started(_serve(model, tmp_path), MACHINE, data_dir=model[0], log=tmp_path / "serve.log",
                              env=user_env(tmp_path / "xdg")) as server:
            url = _serve_load.wait_ready(server, timeout=120)
            rows = _serve_load.serving_rows(server, url, model=MODEL_ID, prompt=PROMPT, max_tokens=TOKENS,
                                            clients=(2,), reference=reference + "x", expert_bytes_metric="no_such")
            wrong_model = _serve_load.run_clients(url, "no/such-model", PROMPT, TOKENS, 2)
    except _machine.MachineUnavailableError as e:
        pytest.skip(f"no emulated machine here: {e}")
    assert rows[0].errors == () and not rows[0].agree and rows[0].expert_bytes_per_token is None
    assert len(wrong_model.errors) == 2 and not wrong_model.agree()
    assert wrong_model.errors[0].startswith("NotFoundError: Error code: 404")

    dying = [*_serve(model, tmp_path), "--max-batch", "0"]
    with _machine.started(dying, MACHINE, data_dir=model[0], log=tmp_path / "dying.log") as server:
        with pytest.raises(RuntimeError, match="the server exited 2 before it was ready"):
            _serve_load.wait_ready(server, timeout=60)
    assert _own_cgroups() == []
