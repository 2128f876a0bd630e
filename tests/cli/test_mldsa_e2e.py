"""`keygen --algorithm ml-dsa-65`, `sign` and `audit` end to end: an encrypted ML-DSA key signs a manifest beside an
Ed25519 one, and the two count as two publishers."""

from __future__ import annotations

import os

import pytest

from shardtool.keys import load_private_key, load_public_key, mldsa_available

pytestmark = pytest.mark.skipif(not mldsa_available(), reason="this cryptography/OpenSSL has no ML-DSA")


def test_keygen_writes_an_encrypted_ml_dsa_key_that_signs_and_audits(cli, tmp_path, make_model):
    model = make_model(tmp_path / "model")
    secret = tmp_path / "pass"
    secret.write_text("a passphrase long enough\n")
    os.chmod(secret, 0o600)
    cli.ok("keygen", "--out", tmp_path / "pq", "--algorithm", "ml-dsa-65", "--passphrase-file", secret)
    key = load_private_key(tmp_path / "pq.key", b"a passphrase long enough")
    assert key.public == load_public_key(tmp_path / "pq.pub") and key.public.algorithm == "ml-dsa-65"
    cli.ok("keygen", "--out", tmp_path / "ed", "--no-passphrase")
    cli.ok("manifest", model)
    cli.ok("sign", model, "--key", tmp_path / "pq.key", "--passphrase-file", secret)
    cli.ok("sign", model, "--key", tmp_path / "ed.key")
    cli.ok("audit", model, "--trust", tmp_path / "pq.pub", "--trust", tmp_path / "ed.pub", "--threshold", "2", "-q")
    r = cli("audit", model, "--trust", tmp_path / "pq.pub", "--threshold", "2", "-q")
    assert r.code == 2 and r.error_class == "TrustSettingsError", r.err  # two signers asked of one trusted key
