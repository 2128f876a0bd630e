"""Human output writes sizes and rates one way (binary units: KiB, MiB, GiB, from `shardtool.text.format_size`),
and a progress bar shows no ETA before there is work to estimate it from. `--json` keeps plain byte counts."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtool.text import format_rate, format_size

BIN = Path(sys.executable).parent
MODEL_KNOBS = dict(layers=2, experts=2, experts_per_tok=2, hidden=32, moe_intermediate=16, intermediate=48,
                   heads=4, kv_heads=2, vocab=300)
# A decimal unit or a bare 'GB/s' anywhere in human text is the other unit system.
_DECIMAL = re.compile(r"\d\s?(kB|KB|MB|GB|TB)\b")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1,023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
                                     (3.5 * 2**20, "3.50 MiB"), (8 * 2**30, "8.00 GiB"), (2e9, "1.86 GiB"),
                                     (3 * 2**40, "3.00 TiB")])
def test_format_size_binary_units(n, text):
    assert format_size(n) == text
    assert format_rate(n) == text + "/s"


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(out: str) -> list[str]:
    return [line.rstrip() for line in out.replace("\n", "\r").split("\r") if line.strip()]


def test_progress_shows_no_eta_before_a_second_of_work(monkeypatch):
    from shardtool.cli import _progress

    clock, term = _Clock(), _Terminal()
    monkeypatch.setattr(_progress.time, "monotonic", clock)
    monkeypatch.setattr(_progress.sys, "stderr", term)
    with _progress.Progress(4 * 2**20, "audit", files=4) as p:
        clock.now += 0.2
        p.advance(0)  # nothing done yet: no rate to estimate from
        clock.now += 0.2
        p.file_done(2**20, 0)  # a file found in place: no work, no rate
        clock.now += 0.2
        p.advance(2**20)  # 0.6 s of work: too little to say
        clock.now += 1.4
        p.advance(2**20 // 2)  # 2 s, 1.5 MiB moved: 0.75 MiB/s, 1.5 MiB left: 2 s
    lines = _lines(term.getvalue())
    assert len(lines) == 5, lines
    assert all("ETA" not in line for line in lines[:3]), lines
    assert lines[3].endswith("ETA 2s") and "2.50 MiB" in lines[3] and "768.00 KiB/s" in lines[3], lines[3]
    assert "ETA" not in lines[4] and lines[4].endswith("in 2.0s"), lines[4]
    assert not any(_DECIMAL.search(line) for line in lines), lines


def _split_on_a_terminal(ckpt: Path, out: Path) -> str:
    """`shardtool split` with stderr on a pseudo-terminal (so the progress bar draws); what it wrote there."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([str(BIN / "shardtool"), "split", ckpt, out, "--model-id", "acme/tiny"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_split_on_a_terminal_prints_binary_units_and_no_eta_from_nothing(tmp_path):
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath

    ckpt = make_tiny_moe.make_checkpoint(tmp_path / "ckpt", "mixtral", seed=5, **MODEL_KNOBS)
    err = _split_on_a_terminal(ckpt, tmp_path / "out")
    lines = _lines(err)
    bar = [line for line in lines if line.startswith("split [")]
    assert bar and bar[-1].endswith("s") and " in " in bar[-1], lines
    assert "ETA 0s" not in err and "ETA    0s" not in err
    assert not any(_DECIMAL.search(line) for line in lines), lines
    summary = next(line for line in lines if line.startswith("split mixtral checkpoint"))
    assert re.search(r"\d KiB in [\d.]+ s \([\d.,]+ [KMG]iB/s\)", summary), summary


def test_inspect_prints_binary_units_and_json_keeps_bytes(cli, tmp_path):
    from examples import make_tiny_moe

    ckpt = make_tiny_moe.make_checkpoint(tmp_path / "ckpt", "mixtral", seed=5, **MODEL_KNOBS)
    model = tmp_path / "model"
    cli.ok("split", ckpt, model, "--model-id", "acme/tiny", "-q")
    human = cli.ok("inspect", model)
    text = human.out + human.err
    assert "at 1.86 GiB/s" in text and re.search(r"total bytes\s+[\d.]+ KiB", text), text
    assert not _DECIMAL.search(text), text
    doc = json.loads(cli.ok("inspect", model, "--json").out)
    assert isinstance(doc["contract"]["total_bytes"], int) and doc["disk_gbps"] == 2.0
