"""`split --oms-signature SIG --trust EC.pub`: a checkpoint signed by the real `model_signing sign key` is split only
when every file matches the OMS statement, and the split records which statement it matched in a signed file of its
own (`source.oms.json`, listed in the new manifest); the checkpoint's `model.sig` is never copied."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
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
