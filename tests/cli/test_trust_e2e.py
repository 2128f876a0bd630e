"""keygen -> manifest -> sign -> audit through the installed CLI, and every tampering refused with exit 1."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from shardtool.keys import load_private_key
from shardtool.manifest import build_manifest, load_manifest, save_manifest



@pytest.fixture
def signed(cli, tmp_path, make_model):
    """A model directory with a manifest signed by key `a`; keys `a`, `b` and `c` exist."""
    model = make_model(tmp_path / "model")
    for name in ("a", "b", "c"):
        cli.ok("keygen", "--out", name, "--no-passphrase")
    cli.ok("manifest", model, "--model-id", "acme/tiny-moe", "--version", "3")
    cli.ok("sign", model, "--key", "a.key")
    return model


def audit(cli, model, *keys, threshold=1, extra=()):
    trust = [arg for k in keys for arg in ("--trust", f"{k}.pub")]
    return cli("audit", model, *trust, "--threshold", str(threshold), *extra)


def test_clean_audit_passes_and_json_report(cli, signed):
    r = audit(cli, signed, "a", extra=("--json",))
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert report["ok"] is True
    assert report["files_checked"] == 9
    assert report["head"]["model_id"] == "acme/tiny-moe" and report["head"]["version"] == 3
    assert "audit OK" in r.err


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-1])


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


EXPERT = "experts/layer-000/expert-0001.safetensors"
TAMPERING = {
    "flip-one-byte": (lambda m: _flip(m / EXPERT), "digest-mismatch", EXPERT),
    "truncate": (lambda m: _truncate(m / EXPERT), "size-mismatch", EXPERT),
    "add-unlisted-file": (lambda m: (m / "experts/layer-000/expert-0009.safetensors").write_bytes(b"x"), "unlisted",
                          "experts/layer-000/expert-0009.safetensors"),
    "delete-file": (lambda m: (m / EXPERT).unlink(), "missing", EXPERT),
    "swap-two-experts": (lambda m: _swap(m / EXPERT, m / "experts/layer-001/expert-0000.safetensors"),
                         "digest-mismatch", "experts/layer-001/expert-0000.safetensors"),
    "symlink-outside": (lambda m: ((m / EXPERT).unlink(), (m / EXPERT).symlink_to("/etc/passwd")), "symlink", EXPERT),
    "fifo-instead-of-file": (lambda m: ((m / EXPERT).unlink(), os.mkfifo(m / EXPERT)), "not-a-regular-file", EXPERT),
    "directory-instead-of-file": (lambda m: ((m / EXPERT).unlink(), (m / EXPERT).mkdir()), "not-a-regular-file", EXPERT),
}


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_tampered_directory_is_refused(cli, signed, case):
    tamper, finding, path = TAMPERING[case]
    tamper(signed)
    r = audit(cli, signed, "a")
    assert r.code == 1, r.err
    assert "audit FAILED" in r.err and path in r.err and finding in r.err
    report = json.loads(audit(cli, signed, "a", extra=("--json",)).out)
    assert report["ok"] is False
    assert {(f["path"], f["finding"]) for f in report["findings"]} >= {(path, finding)}


SIGNATURE_CASES = {
    # name: (signing keys, trusted keys, threshold, expected error class in the message)
    "unsigned": ((), ("a",), 1, "SignatureError"),
    "wrong-key": (("a",), ("b",), 1, "SignatureError"),
    "under-threshold": (("a",), ("a", "b"), 2, "ThresholdError"),
    "same-key-twice": (("a", "a"), ("a", "b"), 2, "ThresholdError"),
}


@pytest.mark.parametrize("case", sorted(SIGNATURE_CASES))
def test_signature_problems_are_refused(cli, tmp_path, make_model, case):
    signers, trusted, threshold, error = SIGNATURE_CASES[case]
    model = make_model(tmp_path / "model")
    for name in ("a", "b"):
        cli.ok("keygen", "--out", name, "--no-passphrase")
    cli.ok("manifest", model)
    for k in signers:
        cli.ok("sign", model, "--key", f"{k}.key")
    r = audit(cli, model, *trusted, threshold=threshold)
    assert r.code == 1, r.err
    assert error in r.err and "manifest.msgpack" in r.err


def test_same_public_key_trusted_twice_counts_once(cli, signed, tmp_path):
    shutil.copy(tmp_path / "a.pub", tmp_path / "a-copy.pub")
    r = cli("audit", signed, "--trust", "a.pub", "--trust", "a-copy.pub", "--threshold", "2")
    assert r.code == 2 and "threshold" in r.err  # only one distinct key: a threshold of 2 is unsatisfiable


def test_two_publishers_meet_threshold_two(cli, signed):
    cli.ok("sign", signed, "--key", "b.key")
    assert audit(cli, signed, "a", "b", threshold=2).code == 0


def test_expired_manifest_is_refused(cli, signed, tmp_path):
    current = load_manifest(signed / "manifest.msgpack")
    old = build_manifest(current.entries, model_id="acme/tiny-moe", version=3, expires_in_days=1, now=1_000_000_000)
    key = load_private_key(tmp_path / "a.key", None)
    save_manifest(signed / "manifest.msgpack", old.with_envelope(old.envelope.signed_by(key)))
    r = audit(cli, signed, "a")
    assert r.code == 1 and "ExpiredError" in r.err and "expired" in r.err


def test_lower_version_is_a_rollback(cli, signed):
    assert audit(cli, signed, "a").code == 0  # floor is now version 3
    cli.ok("manifest", signed, "--model-id", "acme/tiny-moe", "--version", "2")
    cli.ok("sign", signed, "--key", "a.key")
    r = audit(cli, signed, "a")
    assert r.code == 1 and "RollbackError" in r.err and "version 2" in r.err


def test_corrupt_manifest_is_untrusted(cli, signed):
    (signed / "manifest.msgpack").write_bytes((signed / "manifest.msgpack").read_bytes()[:-7])
    r = audit(cli, signed, "a")
    assert r.code == 1 and "ManifestFormatError" in r.err


def test_usage_errors_exit_2(cli, signed):
    assert cli("audit", "no-such-dir", "--trust", "a.pub").code == 2
    assert cli("audit", signed).code == 2  # no --trust
    assert cli("audit", signed, "--trust", "missing.pub").code == 2
    assert cli("audit", signed, "--bogus-flag").code == 2
    r = cli("verify-and-run")
    assert r.code != 0


def test_keygen_encrypted_key_and_passphrase_sources(cli, signed, tmp_path):
    (tmp_path / "pw").write_text("correct horse\n")
    (tmp_path / "pw").chmod(0o600)
    r = cli.ok("keygen", "--out", "enc", "--passphrase-file", "pw")
    keyid = r.out.strip()
    assert len(keyid) == 32 and stat.S_IMODE((tmp_path / "enc.key").stat().st_mode) == 0o600
    assert b"ENCRYPTED PRIVATE KEY" in (tmp_path / "enc.key").read_bytes()
    assert cli("keygen", "--out", "enc", "--no-passphrase").code == 2  # never overwrites without --force
    (tmp_path / "bad").write_text("wrong\n")
    (tmp_path / "bad").chmod(0o600)
    r = cli("sign", signed, "--key", "enc.key", "--passphrase-file", "bad")
    assert r.code == 2 and "passphrase" in r.err
    r = cli("sign", signed, "--key", "enc.key", env={"SHARDTOOL_PASSPHRASE": "correct horse"})
    assert r.code == 0, r.err
    assert audit(cli, signed, "enc").code == 0
    (tmp_path / "enc.key").chmod(0o644)
    r = cli("sign", signed, "--key", "enc.key", "--passphrase-file", "pw")
    assert r.code == 2 and "chmod 600" in r.err


def test_manifest_refuses_symlinks_and_errors_are_one_line(cli, tmp_path, make_model):
    model = make_model(tmp_path / "model")
    (model / "link").symlink_to("/etc/passwd")
    r = cli("manifest", model)
    assert r.code == 2 and "symlink" in r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert not (model / "manifest.msgpack").exists()


def test_manifest_elsewhere_with_manifest_flag(cli, tmp_path, make_model):
    model = make_model(tmp_path / "model")
    cli.ok("keygen", "--out", "a", "--no-passphrase")
    cli.ok("manifest", model, "--manifest", "m.msgpack")
    cli.ok("sign", model, "--key", "a.key", "--manifest", "m.msgpack")
    assert cli("audit", model, "--trust", "a.pub", "--manifest", "m.msgpack").code == 0
    assert cli("audit", model, "--trust", "a.pub").code == 1  # no DIR/manifest.msgpack


USAGE_CASES = {
    "unknown-flag": ("audit", ".", "--trust", "a.pub", "--bogus"),
    "missing-argument": ("audit",),
    "missing-required-option": ("keygen",),
    "bad-integer": ("audit", ".", "--trust", "a.pub", "--threshold", "many"),
    "out-of-range": ("manifest", ".", "--expires-in", "0"),
}


@pytest.mark.parametrize("case", sorted(USAGE_CASES))
def test_usage_errors_are_one_line_exit_2(cli, case):
    r = cli(*USAGE_CASES[case])
    assert r.code == 2
    assert r.out == "" and len(r.err.strip().splitlines()) == 1, r.err
    assert "usage error" in r.err and "--help" in r.err
