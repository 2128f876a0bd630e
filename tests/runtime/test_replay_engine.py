"""Replaying receipts on an engine the caller already built (weights verified and cached once, as a validator
checking a node's log does): the same verdict as a fresh engine for honest and dishonest receipts, no weight
read again, and an engine over other weights, another directory or too small a memory plan is refused.
`verify-receipt --sample` builds one engine for the whole sample."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from shardtool.errors import UsageError
from shardtool.keys import load_private_key, load_public_key
from shardtool.manifest import load_trusted_manifest, open_receipt, sign_receipt
from shardtool.runtime import Engine, replay_engine, replay_receipt

from _receiptkit import cli as _cli
from examples.make_tiny_moe import make_checkpoint

MODEL_ID = "test/replay-engine"
BUDGET = 1 << 30


def _model(work: Path, name: str, seed: int, version: int) -> Path:
    make_checkpoint(work / f"ck-{name}", "mixtral", experts=8, layers=2, vocab=300, dtype="f32", seed=seed)
    _cli("shardtool", "split", "-q", work / f"ck-{name}", work / name, "--model-id", MODEL_ID, "--version", version,
         cwd=work)
    _cli("shardtool", "sign", work / name, "--key", "publisher.key", cwd=work)
    return work / name


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A signed model, an honest receipt of 12 sampled tokens from verify-and-run, and dishonest receipts signed
    by the operator (one answer token changed; the prompt claimed one token longer)."""
    work = tmp_path_factory.mktemp("replay-engine")
    for name in ("publisher", "operator"):
        _cli("shardtool", "keygen", "--out", name, "--no-passphrase", cwd=work)
    model = _model(work, "model", seed=0, version=1)
    _cli("verify-and-run", "model", "--trust", "publisher.pub", "--model-id", MODEL_ID, "--prompt-ids",
         "4,5,6,7,8", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "11", "--print-ids", "-q",
         "--receipt-key", "operator.key", "--receipt-out", "run.receipt", cwd=work)
    operator = load_private_key(work / "operator.key", lambda: b"")
    honest, _ = open_receipt((work / "run.receipt").read_bytes(), [operator.public])
    tokens = list(honest.token_ids)
    tokens[5] = (tokens[5] + 1) % 300
    bad_token, _ = open_receipt(sign_receipt(replace(honest, token_ids=tuple(tokens)), operator), [operator.public])
    log = work / "log"
    log.mkdir()
    for i in range(3):
        (log / f"good-{i}.receipt").write_bytes((work / "run.receipt").read_bytes())
    (log / "bad.receipt").write_bytes(sign_receipt(replace(honest, token_ids=tuple(tokens)), operator))
    return work, model, honest, bad_token


def _manifest(work: Path, model: Path):
    return load_trusted_manifest(model / "manifest.msgpack", [load_public_key(work / "publisher.pub")], 1,
                                 work / f"state-{model.name}")


def _same(verdict: dict) -> dict:
    return {k: v for k, v in verdict.items() if k != "replay_seconds"}


def test_a_reused_engine_gives_the_fresh_verdict_without_reading_weights_again(world):
    work, model, honest, bad_token = world
    manifest = _manifest(work, model)
    fresh = {name: replay_receipt(model, manifest, r, budget=BUDGET) for name, r in
             (("honest", honest), ("bad", bad_token))}
    assert fresh["honest"]["valid"] and not fresh["bad"]["valid"]
    assert fresh["bad"]["first_divergence"]["check"] == "token"
    engine = replay_engine(model, manifest, honest.positions, budget=BUDGET)
    try:
        for name, r in (("honest", honest), ("bad", bad_token)):
            assert _same(replay_receipt(model, manifest, r, budget=BUDGET, engine=engine)) == _same(fresh[name])
        read = engine.store.stats.bytes_read
        assert read > 0
        for name, r in (("bad", bad_token), ("honest", honest), ("honest", honest)):
            assert _same(replay_receipt(model, manifest, r, budget=BUDGET, engine=engine)) == _same(fresh[name])
        assert engine.store.stats.bytes_read == read  # the second time round, every weight came from the cache
    finally:
        engine.close()


def test_an_engine_over_other_weights_or_another_directory_is_refused(world):
    work, model, honest, _ = world
    manifest = _manifest(work, model)
    other = work / "model-v2"
    if not other.exists():
        _model(work, "model-v2", seed=7, version=2)
    copy = work / "model-copy"
    if not copy.exists():
        shutil.copytree(model, copy)
    cases = [(Engine(other, _manifest(work, other), budget=BUDGET, max_batch=1), "version 2"),
             (Engine(copy, _manifest(work, copy), budget=BUDGET, max_batch=1), "model-copy"),
             (replay_engine(model, manifest, 4, budget=BUDGET), "this receipt needs")]
    try:
        for engine, needle in cases:
            with pytest.raises(UsageError, match=needle):
                replay_receipt(model, manifest, honest, budget=BUDGET, engine=engine)
            assert engine.store.stats.bytes_read == 0  # refused before anything was replayed
    finally:
        for engine, _ in cases:
            engine.close()


def test_cli_sample_builds_one_engine_and_still_finds_the_bad_receipt(world):
    work = world[0]
    proc = _cli("shardtool", "verify-receipt", "log", "model", "--operator", "operator.pub", "--trust",
                "publisher.pub", "--model-id", MODEL_ID, "--sample", "1", "--json", cwd=work, check=False)
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["sampled"] == 4 and summary["invalid"] == ["bad.receipt"]
    assert summary["replay_engines_built"] == 1
    assert [r["valid"] for r in summary["results"]] == [False, True, True, True]
