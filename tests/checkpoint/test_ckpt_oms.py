"""`split --oms-signature SIG --trust EC.pub`: a checkpoint signed by the real `model_signing sign key` is split only
when every file matches the OMS statement, and the split records which statement it matched in a signed file of its
own (`source.oms.json`, listed in the new manifest); the checkpoint's `model.sig` is never copied."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from _kit.cli import Cli


@pytest.fixture
def signed_ckpt(make_tiny, tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_tiny("qwen2_moe", layers=3, dense_layers=1, shard_size_mb=0.05), ckpt)
    cli = Cli(tmp_path)
    cli.ok("keygen", "--out", tmp_path / "ec", "--algorithm", "ecdsa-p256", "--no-passphrase")
    cli.ok("sign", "key", ckpt, "--private_key", tmp_path / "ec.key", "--signature", ckpt / "model.sig",
           program="model_signing")
    return ckpt, cli


def test_split_records_the_statement_the_checkpoint_matched(signed_ckpt, tmp_path):
    ckpt, cli = signed_ckpt
    out = tmp_path / "out"
    cli.ok("split", ckpt, out, "--oms-signature", ckpt / "model.sig", "--trust", tmp_path / "ec.pub", "-q")
    payload = base64.b64decode(json.loads((ckpt / "model.sig").read_bytes())["dsseEnvelope"]["payload"])
    record = json.loads((out / "source.oms.json").read_bytes())
    assert record["statement_sha256"] == hashlib.sha256(payload).hexdigest()
    assert record["format"] == "shardtool-oms-source-v1" and record["files"] == len(list(ckpt.iterdir())) - 1
    assert not (out / "model.sig").exists()
    # The record is a listed file of the manifest: the publisher's signature covers it, audit checks it.
    cli.ok("keygen", "--out", tmp_path / "ed", "--no-passphrase")
    cli.ok("sign", out, "--key", tmp_path / "ed.key")
    (out / "source.oms.json").write_bytes(json.dumps({**record, "files": 1}).encode())
    r = cli("audit", out, "--trust", tmp_path / "ed.pub", "--json")
    assert r.code == 1 and [f["path"] for f in r.report["findings"]] == ["source.oms.json"]


def test_split_refuses_a_checkpoint_its_oms_signature_does_not_describe(signed_ckpt, tmp_path):
    ckpt, cli = signed_ckpt
    config = ckpt / "config.json"
    config.write_bytes(config.read_bytes().replace(b"{", b"{ ", 1))
    out = tmp_path / "out"
    r = cli("split", ckpt, out, "--oms-signature", ckpt / "model.sig", "--trust", tmp_path / "ec.pub", "-q")
    assert r.code == 2, r.err
    assert "does not match its OMS signature" in r.one_line() and "config.json" in r.one_line()
    assert not out.exists()


def test_split_takes_trust_only_with_an_oms_signature(signed_ckpt, tmp_path):
    ckpt, cli = signed_ckpt
    r = cli("split", ckpt, tmp_path / "out", "--trust", tmp_path / "ec.pub")
    assert r.code == 2 and "--oms-signature" in r.one_line()


def test_split_refuses_a_file_it_reads_that_the_oms_statement_ignores(signed_ckpt, tmp_path):
    """A statement signed with --ignore-paths vouches for nothing under them: a weight file or config.json there is
    unchecked bytes, and a split of them must not record that the checkpoint matched the signature."""
    ckpt, cli = signed_ckpt
    cli.ok("sign", "key", ckpt, "--private_key", tmp_path / "ec.key", "--signature", ckpt / "model.sig",
           "--ignore-paths", ckpt / "config.json", program="model_signing")
    config = ckpt / "config.json"
    config.write_bytes(config.read_bytes().replace(b"{", b"{ ", 1))  # changed after signing: nothing notices
    out = tmp_path / "out"
    assert cli("audit", ckpt, "--oms-signature", ckpt / "model.sig", "--trust", tmp_path / "ec.pub").code == 0
    r = cli("split", ckpt, out, "--oms-signature", ckpt / "model.sig", "--trust", tmp_path / "ec.pub", "-q")
    assert r.code == 2, r.err
    assert "config.json" in r.one_line() and "not listed in the OMS statement" in r.one_line()
    assert not out.exists()


# -- the race: a file changed between the OMS check and split's read of it ------------------------------------------
# Split checks each file's signed digest on the bytes it parses (config.json, the index, each weight file through the
# fd its header is read from) and pins the fd; it then reads only while the pin holds, and checks every pin again
# before the manifest is written. These hooks change a file at the worst moments; each split must be refused, with
# no manifest in OUT (a split without a manifest is not a split anyone can load or sign).

def _weight(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.safetensors"))[0]


def _rewrite_in_place(path: Path) -> None:
    """Same file, same size, one byte of tensor data changed (after a pause: file timestamps are coarse)."""
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def _config_rewritten_while_parsed(monkeypatch, ckpt):
    """An unsigned config.json (same inode, same size) for the read split parses; the signed bytes back after it."""
    from shardtool.checkpoint._ckptdir import CheckpointDir

    real = CheckpointDir.read
    config = ckpt / "config.json"
    signed = config.read_bytes()
    evil = json.loads(signed)
    evil["_name_or_path"] = "evil/model"
    evil_bytes = json.dumps(evil, separators=(",", ":")).encode()
    assert len(evil_bytes) <= len(signed)

    def read(self, name, cap, **kw):
        if name != "config.json":
            return real(self, name, cap, **kw)
        with open(config, "r+b") as f:
            f.write(evil_bytes.ljust(len(signed)))
        try:
            return real(self, name, cap, **kw)
        finally:
            with open(config, "r+b") as f:
                f.write(signed)
    monkeypatch.setattr(CheckpointDir, "read", read)


def _on_open(monkeypatch, ckpt, target, *, before: bool):
    """Rewrite `target` in place when split opens it to copy its bytes: before or after the open."""
    from shardtool.checkpoint._stream import Sources

    real = Sources.fd
    done = []

    def fd(self, file):
        if file == target(ckpt).name and not done:
            done.append(file)
            if before:
                _rewrite_in_place(ckpt / file)
            n = real(self, file)
            if not before:
                _rewrite_in_place(ckpt / file)
            return n
        return real(self, file)
    monkeypatch.setattr(Sources, "fd", fd)


RACES = {
    "config.json rewritten for the parse, then restored": _config_rewritten_while_parsed,
    "weight file rewritten in place before split copies it":
        lambda mp, ckpt: _on_open(mp, ckpt, _weight, before=True),
    "weight file rewritten in place while split copies it":
        lambda mp, ckpt: _on_open(mp, ckpt, _weight, before=False),
    "config.json rewritten in place before split copies it":
        lambda mp, ckpt: _on_open(mp, ckpt, lambda c: c / "config.json", before=True),
    "config.json rewritten in place while split copies it":
        lambda mp, ckpt: _on_open(mp, ckpt, lambda c: c / "config.json", before=False),
}


@pytest.mark.parametrize("race", list(RACES), ids=list(RACES))
def test_split_refuses_a_file_changed_between_the_oms_check_and_its_read(race, signed_ckpt, tmp_path, monkeypatch):
    from test_ckpt_cli import run

    ckpt, _ = signed_ckpt
    RACES[race](monkeypatch, ckpt)
    out = tmp_path / "out"
    r = run("split", ckpt, out, "--oms-signature", ckpt / "model.sig", "--trust", tmp_path / "ec.pub", "-q")
    assert r.code == 2, (r.code, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "[VerificationError]" in lines[0] and "OMS" in lines[0], r.err
    assert not (out / "manifest.msgpack").exists()


def test_split_refuses_a_checkpoint_missing_a_file_its_oms_statement_lists(signed_ckpt, tmp_path):
    """Split no longer hashes files it does not read, but a signed file that is gone still refuses the split: its
    output would not be the signed model."""
    ckpt, cli = signed_ckpt
    (ckpt / "generation_config.json").write_text("{}")
    cli.ok("sign", "key", ckpt, "--private_key", tmp_path / "ec.key", "--signature", ckpt / "model.sig",
           program="model_signing")
    (ckpt / "generation_config.json").unlink()
    out = tmp_path / "out"
    r = cli("split", ckpt, out, "--oms-signature", ckpt / "model.sig", "--trust", tmp_path / "ec.pub", "-q")
    assert r.code == 2, r.err
    assert "generation_config.json" in r.one_line() and "not in the checkpoint" in r.one_line()
    assert not out.exists()
