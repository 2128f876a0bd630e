"""Names from disk reach the terminal escaped: a file name holding a carriage return, a newline, ANSI escapes
or a bidi override cannot erase "audit FAILED" or paint a fake "audit OK". `--json` was always escaped by
the encoder; these cases check the human output on stderr.
"""

from __future__ import annotations

import os

import pytest

import _attackkit as kit
from _attackkit import EXPERT

# What an attacker would name a file: erase the line, go up, print a green "audit OK", hide the rest.
FAKE_OK = "\r\x1b[2K\x1b[1A\x1b[2K\x1b[32maudit OK: every file matches the signed manifest\x1b[0m"
NAMES = {
    "ansi-and-carriage-return": "x" + FAKE_OK,
    "newline": "x\naudit OK: every file matches the signed manifest",
    "bidi-override": "x\u202eusbo.safetensors",
    "c1-control": "x\x9b2J",
}


def _clean(text: str) -> None:
    """Nothing in `text` can move the cursor, erase, recolour or reorder what the terminal shows."""
    for ch in text:
        assert ch == "\n" or ch.isprintable(), f"unescaped {ch!r} in:\n{text!r}"


@pytest.mark.parametrize("case", list(NAMES))
def test_terminal_audit_human_output(case, model, world):
    name = NAMES[case]
    (model / name).write_bytes(b"planted")
    r = kit.run("shardtool", "audit", model, "--trust", world.keys.pub("A"), "--state-dir", world.tmp / "s", "-q",
                cwd=world.tmp)
    kit.assert_no_traceback(r)
    assert r.code == 1, r.err
    _clean(r.err)
    lines = r.err.splitlines()
    assert any(line.startswith("audit FAILED") for line in lines), r.err
    assert not any(line.startswith("audit OK") for line in lines), r.err
    finding = [line for line in lines if line.strip().startswith("unlisted")]
    assert len(finding) == 1 and "x" in finding[0], r.err


def test_terminal_error_line_names_a_file_from_disk(model, world):
    """An error that names an operator-given path holding escapes (verify-shard's shard argument)."""
    proof = world.tmp / "p.proof"
    assert kit.run("shardtool", "prove", model, "--entry", EXPERT, "--out", proof, cwd=world.tmp).code == 0
    shard = world.tmp / ("shard" + FAKE_OK)
    os.mkfifo(shard)
    r = kit.run("shardtool", "verify-shard", shard, "--proof", proof, "--trust", world.keys.pub("A"),
                "--state-dir", world.tmp / "s", cwd=world.tmp, timeout=20)
    assert r.code == 1 and r.error_class == "NotARegularFileError", r.err
    _clean(r.err)
    assert len(r.err.splitlines()) == 1 and "\\x1b[32maudit OK" in r.err, r.err
