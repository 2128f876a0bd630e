"""Concurrency: two audits and a verify-and-run over one directory (and one rollback state) at once all give the
right answer, on an intact model and on a tampered one; two publishers signing at once both keep their signature."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import _crashkit as ck
from shardtool.keys import load_public_key
from shardtool.manifest import verify_manifest

EXPERT = "experts/layer-000/expert-0001.safetensors"


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Path:
    from shardtool.checkpoint import split_checkpoint

    base = tmp_path_factory.mktemp("concurrency")
    ckpt = ck.make_checkpoint(base / "hf", layers=2, experts=2, experts_per_tok=2, hidden=32, moe_intermediate=16,
                              intermediate=48, vocab=300)
    split_checkpoint(ckpt, base / "model", model_id="crash/concurrent")
    for name in ("A", "B"):
        assert ck.run("shardtool", "keygen", "--out", base / name, "--no-passphrase", cwd=base).returncode == 0
    assert ck.run("shardtool", "sign", base / "model", "--key", base / "A.key", cwd=base).returncode == 0
    return base


def _three_at_once(model: Path, base: Path, state: Path, cwd: Path) -> list[subprocess.CompletedProcess]:
    trust = ["--trust", base / "A.pub", "--state-dir", state]
    commands = [("shardtool", "audit", model, *trust, "--json", "-q"),
                ("shardtool", "audit", model, *trust, "--json", "-q", "--workers", "1"),
                ("verify-and-run", model, *trust, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--print-ids",
                 "-q")]
    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda c: ck.run(*c, cwd=cwd), commands))


def test_crash_concurrency_audits_and_run_intact(signed, tmp_path):
    model = shutil.copytree(signed / "model", tmp_path / "model")
    alone = ck.run("verify-and-run", model, "--trust", signed / "A.pub", "--state-dir", tmp_path / "alone",
                   "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--print-ids", "-q", cwd=tmp_path)
    assert alone.returncode == 0 and alone.stdout.strip(), alone.stderr
    for round_ in range(2):  # the second round finds the version already recorded by the first
        a1, a2, run = _three_at_once(model, signed, tmp_path / "state", tmp_path)
        for a in (a1, a2):
            assert a.returncode == 0 and '"ok": true' in a.stdout, (round_, a.stderr)
        assert run.returncode == 0 and run.stdout == alone.stdout, (round_, run.stderr)


def test_crash_concurrency_audits_and_run_tampered(signed, tmp_path):
    model = shutil.copytree(signed / "model", tmp_path / "model")
    data = bytearray((model / EXPERT).read_bytes())
    data[-1] ^= 1
    (model / EXPERT).write_bytes(bytes(data))
    a1, a2, run = _three_at_once(model, signed, tmp_path / "state", tmp_path)
    for a in (a1, a2):
        assert a.returncode == 1 and '"finding": "digest-mismatch"' in a.stdout and EXPERT in a.stdout, a.stderr
    assert run.returncode == 1 and run.stdout == "" and "[DigestMismatchError]" in run.stderr, run.stderr


def test_crash_concurrency_two_publishers_sign_at_once(signed, tmp_path):
    """Through the CLI: A's manifest, then B and a third key C sign at the same moment; all three remain."""
    model = shutil.copytree(signed / "model", tmp_path / "model")
    assert ck.run("shardtool", "keygen", "--out", tmp_path / "C", "--no-passphrase", cwd=tmp_path).returncode == 0
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda k: ck.run("shardtool", "sign", model, "--key", k, cwd=tmp_path),
                                [signed / "B.key", tmp_path / "C.key"]))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    keys = [load_public_key(p) for p in (signed / "A.pub", signed / "B.pub", tmp_path / "C.pub")]
    assert len(verify_manifest((model / "manifest.msgpack").read_bytes(), keys, 3).signers) == 3


def test_crash_concurrency_sign_read_modify_write_is_serialised(signed, tmp_path, monkeypatch):
    """In-process, with the window between reading and rewriting the manifest held open for 0.3 s: without a
    lock B and C both read A's one-signature manifest and whichever writes last drops the other's signature."""
    import shardtool.manifest as manifest_pkg
    from shardtool.cli import manifest_cmd

    model = shutil.copytree(signed / "model", tmp_path / "model")
    assert ck.run("shardtool", "keygen", "--out", tmp_path / "C", "--no-passphrase", cwd=tmp_path).returncode == 0
    real_load = manifest_pkg.load_manifest

    def slow_load(path):
        m = real_load(path)
        time.sleep(0.3)
        return m

    monkeypatch.setattr(manifest_pkg, "load_manifest", slow_load)
    errors = []

    def sign(key):
        try:
            manifest_cmd.sign(directory=model, key=key, manifest_file=None, passphrase_file=None, json_out=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=sign, args=(k,)) for k in (signed / "B.key", tmp_path / "C.key")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    keys = [load_public_key(p) for p in (signed / "A.pub", signed / "B.pub", tmp_path / "C.pub")]
    assert len(verify_manifest((model / "manifest.msgpack").read_bytes(), keys, 1).signers) == 3
