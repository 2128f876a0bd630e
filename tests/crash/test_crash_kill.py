"""`keygen`, `sign` and `split` killed with SIGKILL at many moments: afterwards there is the old state or the new
one, never a file that looks complete and is not; a rerun completes; and the audit afterwards is clean."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import _crashkit as ck
from shardtool.keys import load_private_key, load_public_key
from shardtool.manifest import load_manifest, verify_manifest

# --- keygen ---------------------------------------------------------------------------------------------------

KEYGEN_MOMENTS = {
    "t+0.1s": lambda d: ck.after(0.1),
    "old-public-key-removed": lambda d: lambda: not (d / "k.pub").exists(),
    "private-temp-appears": lambda d: ck.appears(d, ".k.key."),
    "private-key-in-place": lambda d: ck.replaced(d / "k.key"),
    "public-temp-appears": lambda d: ck.appears(d, ".k.pub."),
}


def check_key_pair(d: Path) -> tuple[bool, bool]:
    """Each of k.key / k.pub is absent or complete (loads; private key 0600); present together, they match."""
    for p in d.iterdir():
        assert p.name in ("k.key", "k.pub", "xdg") or ck.is_temp(p.name), f"unexpected file {p.name}"
    key, pub = d / "k.key", d / "k.pub"
    private = load_private_key(key, None) if key.exists() else None  # also refuses a mode wider than 0600
    public = load_public_key(pub) if pub.exists() else None
    if private is not None and public is not None:
        assert private.public == public, "k.key and k.pub are from different keys"
    return key.exists(), pub.exists()


@pytest.mark.parametrize("moment", list(KEYGEN_MOMENTS))
@pytest.mark.parametrize("force", [False, True], ids=["fresh", "force-over-old-pair"])
def test_crash_keygen(moment, force, tmp_path):
    d = tmp_path / "keys"
    d.mkdir()
    args = ["shardtool", "keygen", "--out", d / "k", "--no-passphrase"]
    if force:
        assert ck.run(*args, cwd=tmp_path).returncode == 0  # the old pair
        args.append("--force")
    ck.kill_when(args, KEYGEN_MOMENTS[moment](d), cwd=tmp_path)
    has_key, has_pub = check_key_pair(d)
    # Rerun: without --force it completes when nothing is there, refuses (exit 2, says --force) otherwise.
    plain = ck.run("shardtool", "keygen", "--out", d / "k", "--no-passphrase", cwd=tmp_path)
    if has_key or has_pub:
        assert plain.returncode == 2 and "--force" in plain.stderr, plain.stderr
        assert ck.run("shardtool", "keygen", "--out", d / "k", "--no-passphrase", "--force",
                      cwd=tmp_path).returncode == 0
    else:
        assert plain.returncode == 0, plain.stderr
    assert check_key_pair(d) == (True, True)


# --- sign -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_split(tmp_path_factory) -> Path:
    from shardtool.checkpoint import split_checkpoint

    base = tmp_path_factory.mktemp("crash-sign")
    ckpt = ck.make_checkpoint(base / "hf", layers=2, experts=2, hidden=32, moe_intermediate=16, intermediate=48,
                              vocab=300)
    split_checkpoint(ckpt, base / "model", model_id="crash/sign")
    for name in ("A", "B"):
        assert ck.run("shardtool", "keygen", "--out", base / name, "--no-passphrase", cwd=base).returncode == 0
    assert ck.run("shardtool", "sign", base / "model", "--key", base / "A.key", cwd=base).returncode == 0
    return base


SIGN_MOMENTS = {  # in this order: the first complete run turns "old" (A) into "new" (A and B)
    "manifest-temp-appears": lambda m: ck.appears(m, ".manifest.msgpack."),
    "t+0.1s": lambda m: ck.after(0.1),
    "t+0.15s": lambda m: ck.after(0.15),
    "t+0.2s": lambda m: ck.after(0.2),
    "t+0.3s": lambda m: ck.after(0.3),
}


def test_crash_sign(small_split, tmp_path):
    """B signs A's manifest and is killed, again and again: the manifest is always whole, with A's signature
    alone (old) or A's and B's (new); then a rerun completes and a 2-of-2 audit is clean."""
    base = small_split
    model = shutil.copytree(base / "model", tmp_path / "model")
    keys = [load_public_key(base / "A.pub"), load_public_key(base / "B.pub")]
    outcomes = []
    for name, moment in SIGN_MOMENTS.items():
        killed = ck.kill_when(["shardtool", "sign", model, "--key", base / "B.key"], moment(model), cwd=tmp_path)
        data = (model / "manifest.msgpack").read_bytes()
        signers = verify_manifest(data, keys, 1).signers
        assert set(signers) in ({keys[0]}, set(keys)), name
        assert len(load_manifest(model / "manifest.msgpack").envelope.signatures) == len(signers)
        assert all(n == "manifest.msgpack" or ck.is_temp(n) or not n.startswith(".") for n in os.listdir(model))
        outcomes.append((name, killed, len(signers)))
    r = ck.run("shardtool", "sign", model, "--key", base / "B.key", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for leftover in [n for n in os.listdir(model) if ck.is_temp(n)]:
        (model / leftover).unlink()  # a killed writer's temp file: hidden, never mistaken for the manifest
    audit = ck.run("shardtool", "audit", model, "--trust", base / "A.pub", "--trust", base / "B.pub",
                   "--threshold", "2", "--state-dir", tmp_path / "state", "-q", cwd=tmp_path)
    assert audit.returncode == 0, (outcomes, audit.stderr)


# --- split ----------------------------------------------------------------------------------------------------

SPLIT_KNOBS = dict(layers=3, experts=8, hidden=128, moe_intermediate=256, intermediate=96, vocab=300)


@pytest.fixture(scope="module")
def split_reference(tmp_path_factory):
    """A checkpoint of ~6 MB in 40 files, and the result of splitting it without interruption."""
    from shardtool.checkpoint import split_checkpoint

    base = tmp_path_factory.mktemp("crash-split")
    ckpt = ck.make_checkpoint(base / "hf", **SPLIT_KNOBS)
    split_checkpoint(ckpt, base / "ref", model_id="crash/split")
    assert ck.run("shardtool", "keygen", "--out", base / "P", "--no-passphrase", cwd=base).returncode == 0
    files = {Path(d.path).relative_to(base / "ref").as_posix(): Path(d.path).read_bytes()
             for d in ck.files_under(base / "ref")}
    del files["manifest.msgpack"]
    return base, ckpt, files


def check_split_dir(out: Path, reference: dict[str, bytes]) -> bool:
    """Every file under its final name is byte-identical to the uninterrupted split's; other files are hidden
    temp files. Returns whether the manifest exists (then it must decode: complete)."""
    for d in ck.files_under(out):
        rel = Path(d.path).relative_to(out).as_posix()
        if ck.is_temp(d.name):
            continue
        if rel == "manifest.msgpack":
            load_manifest(out / rel)
            continue
        assert rel in reference, f"unexpected file {rel}"
        assert Path(d.path).read_bytes() == reference[rel], f"{rel} looks complete and is not"
    return (out / "manifest.msgpack").exists()


def test_crash_split(split_reference, tmp_path):
    """Split is killed after every few new files, rerun into the same OUT and killed again, until a run gets
    through: each rerun reuses what the last one finished and resumes, so the kills walk through the whole
    split. Then one more run is killed while it writes the manifest. After every kill: old or new files only."""
    base, ckpt, reference = split_reference
    out = tmp_path / "out"
    args = ["shardtool", "split", ckpt, out, "--model-id", "crash/split", "-q"]
    log = []
    for _ in range(30):
        killed = ck.kill_when(args, ck.new_files(out, 5), cwd=tmp_path)
        has_manifest = check_split_dir(out, reference)
        log.append((killed, has_manifest, sum(1 for _ in ck.files_under(out))))
        assert killed or has_manifest, "split exited 0 without a manifest"
        if not killed:
            break
    assert not log[-1][0], f"split never got through: {log}"
    assert sum(killed for killed, _, _ in log) >= 3, log  # the kills landed inside the split, several times
    killed = ck.kill_when(args, ck.appears(out, ".manifest.msgpack."), cwd=tmp_path)
    check_split_dir(out, reference)
    r = ck.run(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert check_split_dir(out, reference)
    on_disk = {Path(d.path).relative_to(out).as_posix() for d in ck.files_under(out)}
    assert on_disk == set(reference) | {"manifest.msgpack"}, "temp files left behind by the killed runs"
    assert ck.run("shardtool", "sign", out, "--key", base / "P.key", cwd=tmp_path).returncode == 0
    audit = ck.run("shardtool", "audit", out, "--trust", base / "P.pub", "--state-dir", tmp_path / "state", "-q",
                   cwd=tmp_path)
    assert audit.returncode == 0, (log, audit.stderr)
