"""Freshness: rollback to an older signed release, two different manifests under one version, an expired
manifest (freeze), a manifest from the future, and a whole other model from the same publisher."""

from __future__ import annotations

import shutil
import time

import pytest

import _attackkit as kit
from _attackkit import Attack, refused

DAY = 86_400


def _older_release(model, world):
    """Swap in release 1, complete and genuinely signed: only the rollback floor can refuse it."""
    shutil.copytree(world.v1, model, dirs_exist_ok=True)


def _equivocate(model, world):
    doc = kit.Doc.read(model)
    doc.head["expires"] -= 1
    doc.sign(world.keys.signer("A")).write(model)


def _times(created_offset: int, expires_offset: int):
    def tamper(model, world):
        now = int(time.time())
        doc = kit.Doc.read(model)
        doc.head.update(created=now + created_offset, expires=now + expires_offset)
        doc.sign(world.keys.signer("A")).write(model)
    return tamper


def _whole_other_model(model, world):
    shutil.rmtree(model)
    shutil.copytree(world.other, model)


ROLLBACK = "RollbackError"
EXPIRED = "ExpiredError"

CASES = {
    "rollback-to-older-release": Attack(_older_release, refused(ROLLBACK, "version 1 of 'acme/tiny-moe' is older than "
                                                                          "version 2 already accepted"),
                                        refused(ROLLBACK, "is older than version 2"), accept_first="v2"),
    "equivocation-same-version-other-head": Attack(_equivocate, refused(ROLLBACK, "two different manifests under one "
                                                                                  "version"),
                                                   refused(ROLLBACK, "two different manifests"), accept_first="v2"),
    "expired-manifest": Attack(_times(-10 * DAY, -DAY), refused(EXPIRED, "expired at"), refused(EXPIRED, "expired at")),
    "created-in-the-future": Attack(_times(DAY, 30 * DAY), refused(EXPIRED, "in the future"),
                                    refused(EXPIRED, "in the future")),
    "model-id-pinned-other-model": Attack(_whole_other_model,
                                          refused("VerificationError", "manifest is for model 'other/tiny-moe', "
                                                                       "expected 'acme/tiny-moe'"),
                                          refused("VerificationError", "expected 'acme/tiny-moe'"),
                                          audit_extra=("--model-id", "acme/tiny-moe"),
                                          run_extra=("--model-id", "acme/tiny-moe")),
}
@pytest.mark.parametrize("case", list(CASES))
def test_freshness(case, model, world):
    kit.check_attack(CASES[case], model, world)


def test_freshness_model_id_pin_audit(model, world):
    """audit --model-id refuses a genuine, fresh, correctly signed manifest of another model (same publisher)."""
    _whole_other_model(model, world)
    r = kit.run(*kit.audit_cmd(model, [world.keys.pub("A")], 1, world.tmp / "state", ["--model-id", "acme/tiny-moe"]),
                cwd=world.tmp)
    kit.assert_audit_refused(r, "VerificationError", "manifest is for model 'other/tiny-moe', expected 'acme/tiny-moe'")
    r = kit.run(*kit.audit_cmd(model, [world.keys.pub("A")], 1, world.tmp / "state", ["--model-id", "other/tiny-moe"]),
                cwd=world.tmp)
    assert r.code == 0, r.err


def test_freshness_rollback_floor_is_per_trusted_key_set(model, world):
    """Accepting v2 under key set {A} raises the floor for {A}; the CLI records it and refuses v1 afterwards."""
    state = world.tmp / "state"
    keys = [world.keys.pub("A")]
    assert kit.run(*kit.audit_cmd(world.v2, keys, 1, state), cwd=world.tmp).code == 0
    _older_release(model, world)
    kit.assert_audit_refused(kit.run(*kit.audit_cmd(model, keys, 1, state), cwd=world.tmp), "RollbackError",
                             "older than version 2")
    r = kit.run(*kit.run_cmd(model, keys, 1, state), cwd=world.tmp)
    kit.assert_run_refused(r, "RollbackError", "older than version 2")
