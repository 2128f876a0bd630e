"""Publisher keys: a private key others can read is refused, a wrong or missing passphrase is a clear error,
and a refused `sign` leaves the manifest untouched."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

import _attackkit as kit


def _sign(world, model, key: str, *extra, env=None):
    return kit.run("shardtool", "sign", model, "--key", world.keys.dir / key, *extra, cwd=world.tmp, env=env)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_keys_private_key_readable_by_others_refused(mode, model, world):
    key = world.tmp / "loose.key"
    shutil.copy(world.keys.key("A"), key)
    os.chmod(key, mode)
    before = (model / kit.MANIFEST).read_bytes()
    r = kit.run("shardtool", "sign", model, "--key", key, cwd=world.tmp)
    kit.assert_no_traceback(r)
    assert r.code == 2 and r.error_class == "KeyFileError", r.err
    assert f"private key file has mode {mode:04o}; others can read it" in r.err and "chmod 600" in r.err
    assert (model / kit.MANIFEST).read_bytes() == before


def test_keys_private_key_0600_accepted(model, world):
    """The control: the same key at 0600 signs (and keygen writes it that way)."""
    assert stat.S_IMODE(world.keys.key("A").stat().st_mode) == 0o600
    assert _sign(world, model, "A.key").code == 0


@pytest.mark.parametrize("case", ["wrong-passphrase-file", "wrong-passphrase-env"])
def test_keys_wrong_passphrase(case, model, world):
    before = (model / kit.MANIFEST).read_bytes()
    if case == "wrong-passphrase-file":
        r = _sign(world, model, "E.key", "--passphrase-file", world.keys.dir / "wrong.pass")
    else:
        r = _sign(world, model, "E.key", env={"SHARDTOOL_PASSPHRASE": "battery staple"})
    kit.assert_no_traceback(r)
    assert r.code == 2 and r.error_class == "KeyFileError", r.err
    assert "wrong passphrase" in r.err
    assert (model / kit.MANIFEST).read_bytes() == before


def test_keys_encrypted_key_without_passphrase(model, world):
    r = _sign(world, model, "E.key")
    kit.assert_no_traceback(r)
    assert r.code == 2 and r.error_class == "UsageError", r.err
    assert "a passphrase is needed and there is no terminal" in r.err


def test_keys_right_passphrase_signs(model, world):
    r = _sign(world, model, "E.key", "--passphrase-file", world.keys.dir / "E.pass")
    assert r.code == 0, r.err
    assert len(kit.Doc.read(model).signatures) == 2


def test_keys_public_key_of_wrong_type_refused(model, world):
    """A trust anchor that is not an Ed25519 public key (here: the private key file) is refused, exit 2."""
    r = kit.run(*kit.audit_cmd(model, [world.keys.key("A")], 1, world.tmp / "state"), cwd=world.tmp)
    kit.assert_no_traceback(r)
    assert r.code == 2 and r.error_class == "KeyFileError", r.err
