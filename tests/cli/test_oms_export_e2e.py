"""`shardtool export-oms`: an OpenSSF Model Signing signature over a signed model's files, checked by the real
`model_signing verify key` (accepted as written; refused after any file is changed, added or removed), and the
publisher's own mistakes refused with exit 2 before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

EXPERT = "experts/layer-000/expert-0001.safetensors"


@pytest.fixture
def published(cli, tmp_path: Path, make_model):
    """A model with a signed shardtool manifest and an OMS signature exported beside it."""
    model = make_model(tmp_path / "model")
    cli.ok("keygen", "--out", tmp_path / "ed", "--no-passphrase")
    cli.ok("keygen", "--out", tmp_path / "ec", "--algorithm", "ecdsa-p256", "--no-passphrase")
    cli.ok("manifest", model, "--model-id", "acme/moe")
    cli.ok("sign", model, "--key", tmp_path / "ed.key")
    cli.ok("export-oms", model, "--key", tmp_path / "ec.key")
    return model


def _oms_verify(cli, model: Path, pub: Path):
    return cli("verify", "key", model, "--signature", model / "model.sig", "--public_key", pub,
               program="model_signing")


def test_the_export_verifies_with_model_signing_and_with_both_shardtool_audits(cli, published, tmp_path):
    r = _oms_verify(cli, published, tmp_path / "ec.pub")
    assert r.code == 0 and "Verification succeeded" in r.out, r.err
    oms = cli("audit", published, "--oms-signature", published / "model.sig", "--trust", tmp_path / "ec.pub",
              "--json")
    assert oms.code == 0, oms.err
    assert oms.report["files_checked"] == 9 and oms.report["model_name"] == "acme/moe"
    # The signature file beside the manifest is signature material: the manifest audit does not call it unlisted.
    cli.ok("audit", published, "--trust", tmp_path / "ed.pub", "-q")


def _change(model):
    with open(model / EXPERT, "r+b") as fh:
        fh.seek(10)
        fh.write(b"\x00\x01")


def _add(model):
    (model / "trunk/extra.bin").write_bytes(b"x")


def _remove(model):
    (model / EXPERT).unlink()


@pytest.mark.parametrize("attack", [_change, _add, _remove], ids=["changed", "added", "removed"])
def test_model_signing_refuses_the_export_after_a_file_changes(attack, cli, published, tmp_path):
    attack(published)
    r = _oms_verify(cli, published, tmp_path / "ec.pub")
    assert r.code == 1 and "Verification failed" in r.err, r.out + r.err


def test_the_export_is_refused_by_model_signing_with_another_key(cli, published, tmp_path):
    cli.ok("keygen", "--out", tmp_path / "other", "--algorithm", "ecdsa-p256", "--no-passphrase")
    assert _oms_verify(cli, published, tmp_path / "other.pub").code == 1


def _extra_file(model):
    (model / "notes.txt").write_bytes(b"not in the manifest")


def _tampered(model):
    _change(model)


def _link(model):
    (model / "link").symlink_to("config.json")


@pytest.mark.parametrize("case,expected", [
    (_extra_file, "the manifest does not list"),
    (_tampered, "does not match the manifest"),
    (_link, "the manifest does not list"),
], ids=["file-not-in-manifest", "file-not-matching-manifest", "symlink"])
def test_the_export_refuses_a_directory_that_is_not_the_manifests(case, expected, cli, tmp_path, make_model):
    model = make_model(tmp_path / "model")
    cli.ok("keygen", "--out", tmp_path / "ec", "--algorithm", "ecdsa-p256", "--no-passphrase")
    cli.ok("manifest", model)
    case(model)
    r = cli("export-oms", model, "--key", tmp_path / "ec.key")
    assert r.code == 2, r.err
    assert expected in r.one_line()
    assert not (model / "model.sig").exists()


def test_export_takes_an_ec_key_only_and_keygen_names_its_algorithms(cli, tmp_path, make_model):
    model = make_model(tmp_path / "model")
    cli.ok("keygen", "--out", tmp_path / "ed", "--no-passphrase")
    cli.ok("manifest", model)
    r = cli("export-oms", model, "--key", tmp_path / "ed.key")
    assert r.code == 2 and r.error_class == "KeyFileError" and "expected an EC key" in r.err
    r = cli("keygen", "--out", tmp_path / "x", "--algorithm", "rsa-2048", "--no-passphrase")
    assert r.code == 2 and "ecdsa-p256" in r.one_line()


def test_an_encrypted_ec_key_signs_and_json_names_the_statement(cli, tmp_path, make_model):
    model = make_model(tmp_path / "model")
    secret = tmp_path / "pass"
    secret.write_text("a passphrase long enough\n")
    os.chmod(secret, 0o600)
    cli.ok("keygen", "--out", tmp_path / "ec", "--algorithm", "ecdsa-p384", "--passphrase-file", secret)
    cli.ok("manifest", model)
    r = cli.ok("export-oms", model, "--key", tmp_path / "ec.key", "--passphrase-file", secret, "--json")
    doc = json.loads(r.out)
    audit = cli.ok("audit", model, "--oms-signature", model / "model.sig", "--trust", tmp_path / "ec.pub", "--json")
    assert json.loads(audit.out)["statement_sha256"] == doc["statement_sha256"]
    assert _oms_verify(cli, model, tmp_path / "ec.pub").code == 0
