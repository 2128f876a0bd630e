"""Substitution: genuine, correctly signed bytes put where other bytes belong.

Every substituted file is a real shard some trusted manifest vouches for (another expert, another layer,
another model, an older release of this model), so only the binding of each path to its own digest in the
signed manifest can stop it.
"""

from __future__ import annotations

import json
import shutil

import pytest

import _attackkit as kit
from _attackkit import EXPERT, EXPERT_L1, TRUNK, Attack, found, refused

DIGEST = "DigestMismatchError"
SIBLING = "experts/layer-000/expert-0000.safetensors"


def _swap(a, b):
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _changed_files(world) -> set[str]:
    """Files whose bytes differ between release 1 and release 2 (the weights; config and tokenizer agree)."""
    v1 = {e.relative_to(world.v1).as_posix() for e in world.v1.rglob("*") if e.is_file()} - {kit.MANIFEST}
    return {p for p in v1 if (world.v1 / p).read_bytes() != (world.v2 / p).read_bytes()}


def _relabel_kind(model, world):
    """The entry for EXPERT says kind "trunk" instead of "expert", in the manifest, without re-signing."""
    doc = kit.Doc.read(model)
    for e in doc.entries:
        if e["path"] == EXPERT:
            e.update(kind="trunk", expert=None)
    doc.write(model)


def _relabel_layer(model, world):
    doc = kit.Doc.read(model)
    for e in doc.entries:
        if e["path"] == EXPERT:
            e.update(layer=1)
    doc.write(model)


CASES = {
    "swap-two-experts": Attack(lambda m, w: _swap(m / EXPERT, m / SIBLING),
                               found((EXPERT, "digest-mismatch"), (SIBLING, "digest-mismatch")),
                               refused(DIGEST, "experts/layer-000/expert-000")),
    "swap-expert-across-layers": Attack(lambda m, w: _swap(m / EXPERT, m / EXPERT_L1),
                                        found((EXPERT, "digest-mismatch"), (EXPERT_L1, "digest-mismatch")),
                                        refused(DIGEST, "BLAKE3 is")),
    "expert-from-another-layer": Attack(lambda m, w: shutil.copy(m / EXPERT_L1, m / EXPERT),
                                        found((EXPERT, "digest-mismatch")), refused(DIGEST, f"{EXPERT}: BLAKE3 is")),
    "expert-from-another-model": Attack(lambda m, w: shutil.copy(w.other / EXPERT, m / EXPERT),
                                        found((EXPERT, "digest-mismatch")), refused(DIGEST, f"{EXPERT}: BLAKE3 is")),
    "expert-from-older-release": Attack(lambda m, w: shutil.copy(w.v1 / EXPERT, m / EXPERT),
                                        found((EXPERT, "digest-mismatch")), refused(DIGEST, f"{EXPERT}: BLAKE3 is")),
    "trunk-from-older-release": Attack(lambda m, w: shutil.copy(w.v1 / TRUNK, m / TRUNK),
                                       found((TRUNK, "digest-mismatch")), refused(DIGEST, f"{TRUNK}: BLAKE3 is")),
    "trunk-shard-in-place-of-expert": Attack(lambda m, w: shutil.copy(m / TRUNK, m / EXPERT),
                                             found((EXPERT, "size-mismatch")), refused(DIGEST, f"{EXPERT}: size is")),
    "kind-relabelled-in-manifest": Attack(_relabel_kind, refused("MerkleProofError", "entry list hashes to root"),
                                          refused("MerkleProofError", "entry list hashes to root")),
    "layer-relabelled-in-manifest": Attack(_relabel_layer, refused("MerkleProofError", "entry list hashes to root"),
                                           refused("MerkleProofError", "entry list hashes to root")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_substitution(case, model, world):
    kit.check_attack(CASES[case], model, world)


def test_substitution_mix_and_match_old_manifest_new_shards(model, world):
    """Release 1's genuine signed manifest beside release 2's genuine shards: every changed file is caught."""
    shutil.copy(world.v1 / kit.MANIFEST, model / kit.MANIFEST)
    changed = _changed_files(world)
    assert changed and {"config.json", "tokenizer.json"}.isdisjoint(changed)
    attack = Attack(lambda m, w: None, found(*((p, "digest-mismatch") for p in changed)),
                    refused(DIGEST, "BLAKE3 is"))
    kit.check_attack(attack, model, world)


def test_substitution_mix_and_match_new_manifest_old_shards(model, world):
    """Release 2's manifest over release 1's shards (an operator who upgraded only the manifest)."""
    changed = _changed_files(world)
    for p in changed:
        shutil.copy(world.v1 / p, model / p)
    attack = Attack(lambda m, w: None, found(*((p, "digest-mismatch") for p in changed)),
                    refused(DIGEST, "BLAKE3 is"))
    kit.check_attack(attack, model, world)


def test_substitution_verify_shard_wrong_entry(model, world):
    """A peer asked for EXPERT sends another layer's genuine expert with that expert's genuine proof.

    The proof verifies for what it is; `verify-shard --entry` pins what the node asked for and refuses it.
    """
    keys = ["--trust", world.keys.pub("A"), "--state-dir", world.tmp / "state"]
    r = kit.run("shardtool", "prove", model, "--entry", EXPERT_L1, "--out", world.tmp / "l1.proof", cwd=world.tmp)
    assert r.code == 0, r.err
    received = world.tmp / "received.safetensors"
    shutil.copy(model / EXPERT_L1, received)
    ok = kit.run("shardtool", "verify-shard", received, "--proof", world.tmp / "l1.proof", *keys, "--json",
                 cwd=world.tmp)
    assert ok.code == 0 and json.loads(ok.out)["entry"] == EXPERT_L1, ok.err  # says what it really is
    r = kit.run("shardtool", "verify-shard", received, "--proof", world.tmp / "l1.proof", "--entry", EXPERT, *keys,
                cwd=world.tmp)
    kit.assert_no_traceback(r)
    assert r.code == 1 and r.error_class == "VerificationError", r.err
    assert f"proves entry {EXPERT_L1!r}, expected {EXPERT!r}" in r.err
    # And the honest case passes with --entry.
    r = kit.run("shardtool", "verify-shard", received, "--proof", world.tmp / "l1.proof", "--entry", EXPERT_L1, *keys,
                cwd=world.tmp)
    assert r.code == 0, r.err
