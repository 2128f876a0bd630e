"""Issue 4 through the CLI: subset audits, proofs for single shards, links, and the JSON report schema."""

from __future__ import annotations

import json
import os
import shutil

import msgpack
import pytest

EXPERT = "experts/layer-001/expert-0001.safetensors"


@pytest.fixture
def signed(cli, tmp_path, make_model):
    model = make_model(tmp_path / "model")
    for name in ("a", "b"):
        cli.ok("keygen", "--out", name, "--no-passphrase")
    cli.ok("manifest", model, "--model-id", "acme/tiny-moe")
    cli.ok("sign", model, "--key", "a.key")
    return model


def test_report_schema_fields(cli, signed):
    (signed / EXPERT).write_bytes(b"tampered")
    r = cli("audit", signed, "--trust", "a.pub", "--json")
    assert r.code == 1
    report = json.loads(r.out)
    assert set(report) >= {"ok", "manifest", "directory", "head", "signers", "counts", "files_checked",
                           "bytes_hashed", "absent", "seconds", "findings"}
    assert set(report["counts"]) == {"missing", "size-mismatch", "digest-mismatch", "unlisted", "symlink",
                                     "not-a-regular-file", "unreadable"}
    (finding,) = report["findings"]
    assert finding == {"path": EXPERT, "finding": "size-mismatch", "detail": finding["detail"], "kind": "expert",
                       "layer": 1, "expert": 1, "expected_size": 5000, "expected_digest": finding["expected_digest"],
                       "found_size": 8, "found_digest": finding["found_digest"]}
    assert len(finding["expected_digest"]) == 64 and finding["found_digest"] != finding["expected_digest"]


def test_present_only_subset(cli, signed):
    shutil.rmtree(signed / "experts/layer-000")
    r = cli("audit", signed, "--trust", "a.pub", "--present-only", "--json")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert sorted(report["absent"]) == ["experts/layer-000/expert-0000.safetensors",
                                        "experts/layer-000/expert-0001.safetensors"]
    assert report["files_checked"] == 7
    # Without --present-only the same directory fails with two `missing` findings.
    r = cli("audit", signed, "--trust", "a.pub", "--json")
    assert r.code == 1 and json.loads(r.out)["counts"]["missing"] == 2


def test_present_only_still_checks_what_is_present(cli, signed):
    shutil.rmtree(signed / "experts/layer-000")
    (signed / EXPERT).write_bytes(b"x" * 5000)
    (signed / "stray.bin").write_bytes(b"?")
    r = cli("audit", signed, "--trust", "a.pub", "--present-only", "--json")
    assert r.code == 1
    found = {(f["path"], f["finding"]) for f in json.loads(r.out)["findings"]}
    assert found == {(EXPERT, "digest-mismatch"), ("stray.bin", "unlisted")}


def test_follow_symlinks_only_inside(cli, signed, tmp_path):
    target = signed / "store" / "e.bin"
    target.parent.mkdir()
    shutil.move(signed / EXPERT, target)
    (signed / EXPERT).symlink_to(target)
    assert cli("audit", signed, "--trust", "a.pub").code == 1  # links are findings by default
    r = cli("audit", signed, "--trust", "a.pub", "--follow-symlinks", "--json")
    # The link is fine now; its target is still an unlisted file of the directory.
    assert {(f["path"], f["finding"]) for f in json.loads(r.out)["findings"]} == {("store", "unlisted"), ("store/e.bin", "unlisted")}
    outside = tmp_path / "outside.bin"
    shutil.move(target, outside)
    (signed / EXPERT).unlink()
    (signed / EXPERT).symlink_to(outside)
    r = cli("audit", signed, "--trust", "a.pub", "--follow-symlinks", "--json")
    assert r.code == 1
    assert (EXPERT, "symlink") in {(f["path"], f["finding"]) for f in json.loads(r.out)["findings"]}


def test_prove_and_verify_shard(cli, signed, tmp_path):
    cli.ok("prove", signed, "--entry", EXPERT, "--out", "p.proof")
    received = tmp_path / "received.safetensors"
    shutil.copy(signed / EXPERT, received)
    r = cli("verify-shard", received, "--proof", "p.proof", "--trust", "a.pub", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["entry"] == EXPERT
    other = signed / "experts/layer-000/expert-0000.safetensors"
    r = cli("verify-shard", other, "--proof", "p.proof", "--trust", "a.pub")
    assert r.code == 1 and "DigestMismatchError" in r.err
    assert cli("verify-shard", received, "--proof", "p.proof", "--trust", "b.pub").code == 1
    assert cli("prove", signed, "--entry", "no/such.safetensors", "--out", "x").code == 2


def _edit_proof(path, edit):
    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    edit(doc)
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))


def _flip(b: bytes) -> bytes:
    return bytes([b[0] ^ 1]) + b[1:]


def _edit_entry(doc):
    entry = msgpack.unpackb(doc["entry"], raw=False)
    entry["size"] += 1
    doc["entry"] = msgpack.packb(dict(sorted(entry.items())), use_bin_type=True)


def _edit_root(doc):
    head = msgpack.unpackb(doc["envelope"]["payload"], raw=False)
    head["merkle_root"] = _flip(head["merkle_root"])
    doc["envelope"]["payload"] = msgpack.packb(dict(sorted(head.items())), use_bin_type=True)


PROOF_TAMPERING = {
    "entry": (_edit_entry, "MerkleProofError"),
    "path-element": (lambda d: d["path"].__setitem__(0, _flip(d["path"][0])), "MerkleProofError"),
    "path-dropped": (lambda d: d["path"].pop(), "MerkleProofError"),
    "index": (lambda d: d.__setitem__("index", d["index"] ^ 1), "MerkleProofError"),
    "root": (_edit_root, "SignatureError"),
    "signature": (lambda d: d["envelope"]["signatures"][0].__setitem__(
        "sig", _flip(d["envelope"]["signatures"][0]["sig"])), "SignatureError"),
    "unsigned": (lambda d: d["envelope"].__setitem__("signatures", []), "SignatureError"),
    "unknown-field": (lambda d: d.__setitem__("extra", 1), "ManifestFormatError"),
}


@pytest.mark.parametrize("case", sorted(PROOF_TAMPERING))
def test_tampered_proof_is_refused(cli, signed, case):
    edit, error = PROOF_TAMPERING[case]
    cli.ok("prove", signed, "--entry", EXPERT, "--out", "p.proof")
    _edit_proof(cli.cwd / "p.proof", edit)
    r = cli("verify-shard", signed / EXPERT, "--proof", "p.proof", "--trust", "a.pub")
    assert r.code == 1, r.err
    assert error in r.err and "Traceback" not in r.err


def test_verify_shard_refuses_special_and_missing_files(cli, signed, tmp_path):
    cli.ok("prove", signed, "--entry", EXPERT, "--out", "p.proof")
    os.mkfifo(tmp_path / "fifo")
    r = cli("verify-shard", tmp_path / "fifo", "--proof", "p.proof", "--trust", "a.pub", timeout=20)
    assert r.code == 1 and "FIFO" in r.err  # refused, and never blocks on the open
    r = cli("verify-shard", tmp_path / "nothing", "--proof", "p.proof", "--trust", "a.pub")
    assert r.code == 2 and "not found" in r.err


def test_many_workers_under_a_low_descriptor_limit(cli, tmp_path):
    """`--workers 64` with `ulimit -n 40`: the audit runs with as many workers as the limit allows."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    model = tmp_path / "model"
    for i in range(70):
        (model / f"d{i:02d}").mkdir(parents=True)
        (model / f"d{i:02d}/w.bin").write_bytes(os.urandom(2000))
    cli.ok("keygen", "--out", "a", "--no-passphrase")
    cli.ok("manifest", model, "--model-id", "acme/many")
    cli.ok("sign", model, "--key", "a.key")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.run([str(Path(sys.executable).parent / "shardtool"), "audit", str(model), "--trust", "a.pub", "--workers", "64", "-q"],
                          cwd=cli.cwd, env=cli.env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard)))
    assert proc.returncode == 0, proc.stderr


def test_reading_ahead_under_a_low_descriptor_limit(cli, tmp_path):
    """100 small files in one directory with `ulimit -n 30`: reading ahead runs out of descriptors, stops, and
    the audit passes (it failed with "Too many open files" when the file refused ahead was retried only after
    the next one had been opened ahead again)."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    model = tmp_path / "model"
    (model / "d").mkdir(parents=True)
    for i in range(100):
        (model / f"d/f{i:03d}.bin").write_bytes(os.urandom(100))
    cli.ok("keygen", "--out", "a", "--no-passphrase")
    cli.ok("manifest", model, "--model-id", "acme/ahead")
    cli.ok("sign", model, "--key", "a.key")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.run([str(Path(sys.executable).parent / "shardtool"), "audit", str(model), "--trust", "a.pub", "-q"],
                          cwd=cli.cwd, env=cli.env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (30, hard)))
    assert proc.returncode == 0, proc.stderr
    assert "audit OK" in proc.stderr
