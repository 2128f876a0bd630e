"""OpenSSF Model Signing signatures as untrusted input: a model signed by the real `model_signing sign key`, then
attacked through its files or its bundle, and checked with the installed `shardtool audit --oms-signature`. Where
the attack is on the files, the real `model_signing verify key` must refuse it too (the two verifiers agree).

Hostile statements are forged here by hand (json, base64 and `cryptography`, not shardtool's encoder) and signed
with the trusted key, so only shardtool's statement validation can stop them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from _kit.cli import Cli

FILES = {
    "config.json": b'{"model_type": "mixtral"}',
    "trunk/embed.safetensors": os.urandom(3000),
    "experts/layer-000/expert-0000.safetensors": os.urandom(5000),
    "experts/layer-000/expert-0001.safetensors": os.urandom(5000),
}
EXPERT = "experts/layer-000/expert-0001.safetensors"
SIG = "model.sig"
PAYLOAD_TYPE = "application/vnd.in-toto+json"


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """(a model signed by the real model_signing with key A, the directory of keys A and B)."""
    root = tmp_path_factory.mktemp("oms")
    cli = Cli(root)
    for name in ("a", "b"):
        cli.ok("keygen", "--out", root / name, "--algorithm", "ecdsa-p256", "--no-passphrase")
    model = root / "model"
    for rel, data in FILES.items():
        (model / rel).parent.mkdir(parents=True, exist_ok=True)
        (model / rel).write_bytes(data)
    cli.ok("sign", "key", model, "--private_key", root / "a.key", "--signature", model / SIG, program="model_signing")
    return model, root


@pytest.fixture
def model(signed, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(signed[0], copy)
    return copy


def _audit(cli: Cli, model: Path, keys: Path, key: str = "a", signature: Path | None = None):
    return cli("audit", model, "--oms-signature", signature or model / SIG, "--trust", keys / f"{key}.pub", "--json")


def _oms_verify(cli: Cli, model: Path, keys: Path, signature: Path | None = None):
    return cli("verify", "key", model, "--signature", signature or model / SIG, "--public_key", keys / "a.pub",
               program="model_signing")


def _payload(bundle_path: Path) -> dict:
    bundle = json.loads(bundle_path.read_bytes())
    return json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))


def forge(bundle_path: Path, statement: dict, key_path: Path, *, fix_root: bool = True) -> None:
    """Rewrite the bundle around `statement`, signed by the key in `key_path` over DSSE PAE, as an attacker holding
    that key (or a careless publisher) could."""
    resources = statement["predicate"]["resources"]
    if fix_root:
        root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
        statement["subject"][0]["digest"]["sha256"] = root
    payload = json.dumps(statement).encode()
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    pae = b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload), payload)
    sig = key.sign(pae, ec.ECDSA(hashes.SHA256()))
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    bundle = {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
              "verificationMaterial": {"publicKey": {"hint": hashlib.sha256(pem).hexdigest()}, "tlogEntries": []},
              "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                               "signatures": [{"sig": base64.b64encode(sig).decode(), "keyid": ""}]}}
    bundle_path.write_text(json.dumps(bundle))


def test_a_model_signed_by_model_signing_passes_both_verifiers(signed, tmp_path):
    model, keys = signed
    cli = Cli(tmp_path)
    r = _audit(cli, model, keys)
    assert r.code == 0, r.err
    report = r.report
    assert report["ok"] and report["files_checked"] == len(FILES) and report["hash_type"] == "sha256"
    statement = base64.b64decode(json.loads((model / SIG).read_bytes())["dsseEnvelope"]["payload"])
    assert report["statement_sha256"] == hashlib.sha256(statement).hexdigest()
    assert _oms_verify(cli, model, keys).code == 0


# -- the files: each case must be refused by both verifiers, with audit naming the file -----------------------

def _swap(model):
    (model / EXPERT).write_bytes((model / "experts/layer-000/expert-0000.safetensors").read_bytes())


def _flip(model):
    data = bytearray((model / EXPERT).read_bytes())
    data[100] ^= 1
    (model / EXPERT).write_bytes(bytes(data))


def _remove(model):
    (model / EXPERT).unlink()


def _extra(model):
    (model / "experts/layer-000/expert-0002.safetensors").write_bytes(os.urandom(100))


def _symlink(model):
    outside = model.parent / "outside.safetensors"
    shutil.copy(model / EXPERT, outside)
    (model / EXPERT).unlink()
    (model / EXPERT).symlink_to(outside)


def _fifo(model):
    (model / EXPERT).unlink()
    os.mkfifo(model / EXPERT)


FILE_ATTACKS = {
    "swapped-expert": (_swap, "digest-mismatch"),
    "flipped-bit": (_flip, "digest-mismatch"),
    "removed-file": (_remove, "missing"),
    "extra-file": (_extra, "unlisted"),
    "symlink-to-identical-bytes-outside": (_symlink, "symlink"),
    "fifo-where-a-file-belongs": (_fifo, "not-a-regular-file"),
}


@pytest.mark.parametrize("name", FILE_ATTACKS)
def test_a_changed_model_is_refused_and_the_file_named(name, model, signed, tmp_path):
    attack, finding = FILE_ATTACKS[name]
    attack(model)
    cli = Cli(tmp_path)
    r = _audit(cli, model, signed[1])
    assert r.code == 1, r.err
    findings = r.report["findings"]
    assert [f["finding"] for f in findings] == [finding], findings
    if name != "fifo-where-a-file-belongs":  # model_signing's own walk would block opening a FIFO
        assert _oms_verify(cli, model, signed[1]).code != 0


def test_a_statement_for_another_directory_is_refused(signed, tmp_path):
    """A genuine signature, for a different model: every file differs or is missing, and each is named."""
    other = tmp_path / "other"
    for rel in FILES:
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_bytes(os.urandom(64))
    cli = Cli(tmp_path)
    r = _audit(cli, other, signed[1], signature=signed[0] / SIG)
    assert r.code == 1
    assert {f["finding"] for f in r.report["findings"]} == {"digest-mismatch"}
    assert len(r.report["findings"]) == len(FILES)


# -- the bundle: refused before any file is read -----------------------------------------------------------------

def _drop_resource(model, keys):
    st = _payload(model / SIG)
    st["predicate"]["resources"] = [r for r in st["predicate"]["resources"] if r["name"] != EXPERT]
    forge(model / SIG, st, keys / "a.key")


def _hostile_name(name):
    def attack(model, keys):
        st = _payload(model / SIG)
        st["predicate"]["resources"][0]["name"] = name
        forge(model / SIG, st, keys / "a.key")
    return attack


def _by_other_key(model, keys):
    forge(model / SIG, _payload(model / SIG), keys / "b.key")


def _truncated(model, keys):
    data = (model / SIG).read_bytes()
    (model / SIG).write_bytes(data[: len(data) // 2])


def _oversized(model, keys):
    with open(model / SIG, "ab") as fh:
        fh.truncate(400 * 1024 * 1024)  # sparse: the cap refuses it by its size before a byte is read


def _stale_root(model, keys):
    st = _payload(model / SIG)
    st["predicate"]["resources"][0]["digest"] = "00" * 32
    forge(model / SIG, st, keys / "a.key", fix_root=False)


def _payload_swapped_after_signing(model, keys):
    bundle = json.loads((model / SIG).read_bytes())
    st = _payload(model / SIG)
    st["predicate"]["resources"].pop()
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    (model / SIG).write_text(json.dumps(bundle))


def _duplicate_key(model, keys):
    text = (model / SIG).read_text()
    (model / SIG).write_text(text.replace('"mediaType"', '"mediaType": "x", "mediaType"', 1))


def _shard_serialization(model, keys):
    st = _payload(model / SIG)
    st["predicate"]["serialization"]["method"] = "shards"
    forge(model / SIG, st, keys / "a.key")


def _ignore_escapes(model, keys):
    st = _payload(model / SIG)
    st["predicate"]["serialization"]["ignore_paths"] = ["../elsewhere"]
    forge(model / SIG, st, keys / "a.key")


BUNDLE_ATTACKS = {
    # An attacker who holds the signing key still cannot make a file vanish from the check: it is unlisted.
    "file-missing-from-statement": (_drop_resource, 1, None, "unlisted"),
    "path-with-dotdot": (_hostile_name("../outside.bin"), 1, "ManifestFormatError", None),
    "absolute-path": (_hostile_name("/etc/passwd"), 1, "ManifestFormatError", None),
    "backslash-path": (_hostile_name("experts\\..\\x"), 1, "ManifestFormatError", None),
    "ignore-path-escapes": (_ignore_escapes, 1, "ManifestFormatError", None),
    "signed-by-another-key": (_by_other_key, 1, "SignatureError", None),
    "payload-changed-after-signing": (_payload_swapped_after_signing, 1, "SignatureError", None),
    "subject-digest-not-over-resources": (_stale_root, 1, "ManifestFormatError", None),
    "truncated-bundle": (_truncated, 1, "ManifestFormatError", None),
    "oversized-bundle": (_oversized, 1, "ManifestFormatError", None),
    "duplicate-json-key": (_duplicate_key, 1, "ManifestFormatError", None),
    "shard-serialization": (_shard_serialization, 1, "ManifestFormatError", None),
}


@pytest.mark.parametrize("name", BUNDLE_ATTACKS)
def test_a_hostile_bundle_is_refused(name, model, signed, tmp_path):
    attack, code, error, finding = BUNDLE_ATTACKS[name]
    attack(model, signed[1])
    r = _audit(Cli(tmp_path), model, signed[1])
    assert r.code == code, r.err
    if error is not None:
        assert r.error_class == error, r.err
        assert r.report["error"]["class"] == error
        assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
    else:
        assert [f["finding"] for f in r.report["findings"]] == [finding]


def test_a_missing_signature_and_a_wrong_key_type_say_so(model, signed, tmp_path):
    cli = Cli(tmp_path)
    r = _audit(cli, model, signed[1], signature=model / "absent.sig")
    assert r.code == 1 and "no OMS signature here" in r.err
    cli.ok("keygen", "--out", tmp_path / "ed", "--no-passphrase")
    r = cli("audit", model, "--oms-signature", model / SIG, "--trust", tmp_path / "ed.pub")
    assert r.code == 2 and r.error_class == "KeyFileError", r.err


@pytest.mark.parametrize("option", [("--threshold", "2"), ("--model-id", "acme/moe"), ("--present-only",),
                                    ("--state-dir", "st")], ids=lambda o: o[0])
def test_a_manifest_check_asked_for_with_an_oms_signature_is_refused_not_skipped(option, model, signed, tmp_path):
    """OMS has no threshold, model pin, rollback state or subset: an operator who asks for one must not get a pass."""
    r = Cli(tmp_path)("audit", model, "--oms-signature", model / SIG, "--trust", signed[1] / "a.pub", *option)
    assert r.code == 2 and option[0] in r.one_line(), r.err


# -- split --oms-signature: the checkpoint rewritten after it was checked ------------------------------------------

def _rewrite_weight(ckpt: Path) -> None:
    """Same inode, same size, one tensor byte flipped: what a writer of the checkpoint directory can do between
    split's OMS check and its copy (after a pause: file timestamps are coarse)."""
    import time

    time.sleep(0.05)
    weight = sorted(ckpt.glob("*.safetensors"))[0]
    with open(weight, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def test_a_checkpoint_rewritten_between_the_oms_check_and_the_split_is_refused(tmp_path):
    """The library path (`prepare_split(oms=trusted_oms(...))` then `run_split`), with the weight file rewritten in
    the gap: the split must refuse, and OUT must hold no manifest (nothing that looks like a finished split)."""
    from examples import make_tiny_moe  # the repository root is on pytest's pythonpath
    from shardtool.api import trusted_oms
    from shardtool.checkpoint import prepare_split, run_split
    from shardtool.errors import VerificationError

    ckpt = make_tiny_moe.make_checkpoint(tmp_path / "ckpt", "mixtral", seed=5)
    cli = Cli(tmp_path)
    cli.ok("keygen", "--out", tmp_path / "ec", "--algorithm", "ecdsa-p256", "--no-passphrase")
    cli.ok("sign", "key", ckpt, "--private_key", tmp_path / "ec.key", "--signature", ckpt / SIG,
           program="model_signing")
    statement = trusted_oms(ckpt / SIG, [tmp_path / "ec.pub"])
    job = prepare_split(ckpt, oms=statement)
    _rewrite_weight(ckpt)
    out = tmp_path / "out"
    with pytest.raises(VerificationError, match="OMS statement"):
        run_split(job, out, model_id="org/model")
    assert not (out / "manifest.msgpack").exists()
