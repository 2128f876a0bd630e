"""`shardtool verify-receipt --sample LOGDIR` over a receipt log that others may write: every file it reads there
(NAME.receipt, NAME.trace) is opened beneath LOGDIR with no link followed, and must be a regular file.

A refused file is that receipt's verdict (NOT VALID, exit 1), named with the reason; the others are still judged.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

import _attackkit as kit
from conftest import MODEL_ID

SECRET = b"TOP-SECRET-9c2e: not a routing trace\n"


@pytest.fixture(scope="module")
def receipt_world(tmp_path_factory, releases, keys) -> Path:
    """release 2 of the model, an operator key, and one honest run's receipt and routing trace."""
    _, v2, _, _ = releases
    work = tmp_path_factory.mktemp("receipt-log")
    shutil.copytree(v2, work / "model")
    assert kit.run("shardtool", "keygen", "--out", work / "operator", "--no-passphrase", cwd=work).code == 0
    r = kit.run("verify-and-run", work / "model", "--trust", keys.pub("A"), "--model-id", MODEL_ID, "--prompt-ids",
                "4,5,6", "--max-new-tokens", "3", "--print-ids", "-q", "--receipt-key", work / "operator.key",
                "--receipt-out", work / "run.receipt", "--trace-out", work / "run.trace", cwd=work)
    assert r.code == 0, r.err
    return work


def _log(world: Path, tmp: Path) -> Path:
    """A log of one honest receipt `run.receipt` and its trace `run.trace`, and a secret file outside it."""
    log = tmp / "log"
    log.mkdir()
    shutil.copy(world / "run.receipt", log / "run.receipt")
    shutil.copy(world / "run.trace", log / "run.trace")
    (tmp / "outside").mkdir()
    (tmp / "outside" / "secret").write_bytes(SECRET)
    shutil.copy(world / "run.trace", tmp / "outside" / "run.trace")
    return log


def _args(world: Path, keys, log: Path) -> list:
    return ["verify-receipt", log, world / "model", "--operator", world / "operator.pub", "--trust", keys.pub("A"),
            "--model-id", MODEL_ID, "--sample", "1", "--json", "--state-dir", world / "state"]


def _trace_link_to_genuine_trace_outside(log: Path, tmp: Path) -> None:
    (log / "run.trace").unlink()
    (log / "run.trace").symlink_to(tmp / "outside" / "run.trace")


def _trace_link_to_secret_outside(log: Path, tmp: Path) -> None:
    (log / "run.trace").unlink()
    (log / "run.trace").symlink_to(tmp / "outside" / "secret")


def _trace_is_a_fifo(log: Path, tmp: Path) -> None:
    (log / "run.trace").unlink()
    os.mkfifo(log / "run.trace")


def _trace_is_a_directory(log: Path, tmp: Path) -> None:
    (log / "run.trace").unlink()
    (log / "run.trace").mkdir()


TRACE_CASES = {
    # Followed, the link's target passed: a trace from outside the log vouched for the receipt.
    "trace-link-to-genuine-trace-outside": (_trace_link_to_genuine_trace_outside, "is a symlink"),
    "trace-link-to-secret-outside": (_trace_link_to_secret_outside, "is a symlink"),
    # Skipped, the receipt passed without the trace that sits beside it.
    "trace-is-a-fifo": (_trace_is_a_fifo, "is a FIFO"),
    "trace-is-a-directory": (_trace_is_a_directory, "is a directory"),
}


@pytest.mark.parametrize("case", TRACE_CASES)
def test_receipt_sample_trace_not_a_regular_file_in_the_log_refused(case, receipt_world, keys, tmp_path):
    log = _log(receipt_world, tmp_path)
    clean = kit.run("shardtool", *_args(receipt_world, keys, log), cwd=tmp_path)
    assert clean.code == 0, clean.err  # (control) the honest log passes
    plant, said = TRACE_CASES[case]
    plant(log, tmp_path)
    r = kit.run("shardtool", *_args(receipt_world, keys, log), cwd=tmp_path, timeout=120)
    kit.assert_no_traceback(r)
    assert r.code == 1, r.err
    summary = json.loads(r.out)
    assert summary["invalid"] == ["run.receipt"], summary
    error = summary["results"][0]["error"]
    assert "run.trace" in error and said in error, error
    assert SECRET.decode().strip() not in r.out + r.err


def test_receipt_sample_receipt_swapped_for_a_link_after_listing_refused(receipt_world, keys, tmp_path, monkeypatch):
    """The listing keeps regular *.receipt files only; the file read later must be that kind of file too: a link
    swapped in after the listing (here: the listing is handed the link's name) is refused, not followed."""
    from shardtool.cli import main, receipt_cmd

    log = _log(receipt_world, tmp_path)
    shutil.copy(receipt_world / "run.receipt", tmp_path / "outside" / "genuine.receipt")
    (log / "swapped.receipt").symlink_to(tmp_path / "outside" / "genuine.receipt")
    monkeypatch.setattr(receipt_cmd, "_receipts_in", lambda directory: ["run.receipt", "swapped.receipt"])
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main([str(a) for a in _args(receipt_world, keys, log)])
    assert info.value.code == 1, err.getvalue()
    summary = json.loads(out.getvalue())
    assert summary["invalid"] == ["swapped.receipt"], summary
    assert "is a symlink" in summary["results"][1]["error"]
