"""Publisher keys: a private key or passphrase file others can read is refused, a FIFO named as a key or
passphrase cannot hang a command, a new key needs a long passphrase and a costly KDF (scrypt), keys written by
earlier versions still sign, a wrong or missing passphrase is a clear error, and a refused `sign` or `keygen`
leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import _attackkit as kit

# A FIFO with no writer: open() without O_NONBLOCK, or a read, would wait forever. The command must answer
# well before this.
FIFO_TIMEOUT = 20


def _one_line_error(r: kit.Result, code: int, error_class: str) -> str:
    kit.assert_no_traceback(r)
    assert r.code == code and r.error_class == error_class, (r.code, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    return lines[0]


def _secret(path, text: str, mode: int = 0o600):
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _sign(world, model, key: str, *extra, env=None):
    return kit.run("shardtool", "sign", model, "--key", world.keys.dir / key, *extra, cwd=world.tmp, env=env)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_keys_private_key_readable_by_others_refused(mode, model, world):
    key = world.tmp / "loose.key"
    shutil.copy(world.keys.key("A"), key)
    os.chmod(key, mode)
    before = (model / kit.MANIFEST).read_bytes()
    r = kit.run("shardtool", "sign", model, "--key", key, cwd=world.tmp)
    line = _one_line_error(r, 2, "KeyFileError")
    assert f"{key}: private key file has mode {mode:04o}; group or others have access" in line and "chmod 600" in line
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
    assert "wrong passphrase" in _one_line_error(r, 2, "KeyFileError")
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


# --- passphrase files are secrets too ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=lambda m: f"{m:04o}")
@pytest.mark.parametrize("command", ["keygen", "sign"])
def test_keys_passphrase_file_readable_by_others_refused(command, mode, model, world):
    """A passphrase file others can read is refused exactly like such a key file: exit 2, one line naming the
    file and the mode found; keygen writes no key, sign leaves the manifest as it was."""
    pw = _secret(world.tmp / "loose.pass", "correct horse\n", mode)
    before = (model / kit.MANIFEST).read_bytes()
    if command == "keygen":
        r = kit.run("shardtool", "keygen", "--out", world.tmp / "new", "--passphrase-file", pw, cwd=world.tmp)
    else:
        r = _sign(world, model, "E.key", "--passphrase-file", pw)
    line = _one_line_error(r, 2, "KeyFileError")
    assert f"{pw}: passphrase file has mode {mode:04o}; group or others have access" in line and "chmod 600" in line
    assert (model / kit.MANIFEST).read_bytes() == before
    assert sorted(p.name for p in world.tmp.iterdir() if p.name != "xdg") == ["loose.pass"]


def test_keys_passphrase_file_through_symlink_checked_at_its_target(model, world):
    """The mode that counts is the file's own, read on the opened descriptor: a symlink to a 0644 file is
    refused."""
    target = _secret(world.tmp / "loose.pass", "correct horse\n", 0o644)
    link = world.tmp / "pw-link"
    link.symlink_to(target)
    before = (model / kit.MANIFEST).read_bytes()
    line = _one_line_error(_sign(world, model, "E.key", "--passphrase-file", link), 2, "KeyFileError")
    assert "mode 0644" in line
    assert (model / kit.MANIFEST).read_bytes() == before


@pytest.mark.parametrize("case", ["directory", "oversized", "missing"])
def test_keys_passphrase_file_not_a_small_regular_file(case, model, world):
    pw = world.tmp / "pw"
    if case == "directory":
        pw.mkdir(mode=0o700)
    elif case == "oversized":
        _secret(pw, "correct horse\n" + "x" * 5000)
    before = (model / kit.MANIFEST).read_bytes()
    line = _one_line_error(_sign(world, model, "E.key", "--passphrase-file", pw), 2, "KeyFileError")
    assert str(pw) in line and {"directory": "is a directory", "oversized": "larger than 4096 bytes",
                                "missing": "not found"}[case] in line
    assert (model / kit.MANIFEST).read_bytes() == before


# --- FIFOs where a key or passphrase file belongs ----------------------------------------------------------


FIFO_CASES = {
    "keygen-passphrase-file": lambda w, m, f: ["shardtool", "keygen", "--out", w.tmp / "new", "--passphrase-file", f],
    "sign-passphrase-file": lambda w, m, f: ["shardtool", "sign", m, "--key", w.keys.key("E"), "--passphrase-file", f],
    "sign-private-key": lambda w, m, f: ["shardtool", "sign", m, "--key", f],
    "audit-trust": lambda w, m, f: kit.audit_cmd(m, [f], 1, w.tmp / "state"),
    "verify-and-run-trust": lambda w, m, f: kit.run_cmd(m, [f], 1, w.tmp / "state"),
}


@pytest.mark.parametrize("case", list(FIFO_CASES))
def test_keys_fifo_does_not_hang(case, model, world):
    """A FIFO with no writer named as a passphrase file, a private key or a trusted public key: opened
    non-blocking and refused as not a regular file (exit 2, one line), well within the timeout."""
    fifo = world.tmp / "fifo"
    os.mkfifo(fifo, 0o600)
    before = (model / kit.MANIFEST).read_bytes()
    r = kit.run(*FIFO_CASES[case](world, model, fifo), cwd=world.tmp, timeout=FIFO_TIMEOUT)
    line = _one_line_error(r, 2, "KeyFileError")
    assert f"{fifo}: " in line and "is a FIFO, expected a regular file" in line
    assert r.out == ""
    assert (model / kit.MANIFEST).read_bytes() == before
    assert not (world.tmp / "new.key").exists() and not (world.tmp / "new.pub").exists()


# --- new keys: passphrase length and KDF cost --------------------------------------------------------------


@pytest.mark.parametrize("source", ["file", "env"])
@pytest.mark.parametrize("passphrase", ["x", "eleven char"], ids=["1-char", "11-chars"])
def test_keys_short_passphrase_refused_for_new_key(source, passphrase, world):
    if source == "file":
        pw = _secret(world.tmp / "pw", passphrase + "\n")
        r = kit.run("shardtool", "keygen", "--out", world.tmp / "new", "--passphrase-file", pw, cwd=world.tmp)
        where = str(pw)
    else:
        r = kit.run("shardtool", "keygen", "--out", world.tmp / "new", cwd=world.tmp,
                    env={"SHARDTOOL_PASSPHRASE": passphrase})
        where = "SHARDTOOL_PASSPHRASE"
    line = _one_line_error(r, 2, "UsageError")
    assert f"{where}: passphrase is {len(passphrase)} character(s); a new key needs at least 12" in line
    assert not (world.tmp / "new.key").exists() and not (world.tmp / "new.pub").exists()


def test_keys_new_key_is_scrypt_protected(model, world):
    """keygen's key file: PKCS#8 PBES2 with scrypt N=2^14, r=8, p>=4 (16 MiB a lane; ~125 ms a guess on the
    2-core test machine, against ~0.35 ms for the PBKDF2 with 2,048 iterations it replaces), AES-256-CBC,
    a 16-byte salt. A passphrase of exactly the 12-character minimum is accepted, and the key signs."""
    pw = _secret(world.tmp / "pw", "twelve chars\n")
    r = kit.run("shardtool", "keygen", "--out", world.tmp / "new", "--passphrase-file", pw, cwd=world.tmp)
    assert r.code == 0, r.err
    key = world.tmp / "new.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    enc = kit.pkcs8_encryption(key.read_bytes())
    assert (enc["scheme"], enc["kdf"], enc["cipher"]) == (kit.PBES2, kit.SCRYPT, kit.AES256_CBC), enc
    assert enc["N"] >= 1 << 14 and enc["r"] >= 8 and enc["p"] >= 4 and len(enc["salt"]) >= 16, enc
    r = kit.run("shardtool", "sign", model, "--key", key, "--passphrase-file", pw, cwd=world.tmp)
    assert r.code == 0 and "note:" not in r.err, r.err
    r = kit.run(*kit.audit_cmd(model, [world.tmp / "new.pub"], 1, world.tmp / "state"), cwd=world.tmp)
    assert r.code == 0 and r.report["ok"], r.err


def test_keys_legacy_pbkdf2_key_still_signs(model, world):
    """A key written by the previous version (cryptography's PKCS#8 BestAvailableEncryption: PBKDF2, 2,048
    iterations), with a passphrase shorter than today's minimum, still signs; sign adds a one-line note on
    how to re-encrypt it. A wrong passphrase for it is one error line, exit 2, manifest untouched."""
    private = Ed25519PrivateKey.generate()
    key = world.tmp / "legacy.key"
    key.write_bytes(kit.legacy_encrypted_pem(private, b"old pw"))
    os.chmod(key, 0o600)
    enc = kit.pkcs8_encryption(key.read_bytes())
    assert (enc["kdf"], enc["iterations"]) == (kit.PBKDF2, 2048), enc
    (world.tmp / "legacy.pub").write_bytes(private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    before = (model / kit.MANIFEST).read_bytes()
    wrong = _secret(world.tmp / "wrong.pw", "not the old pw\n")
    r = kit.run("shardtool", "sign", model, "--key", key, "--passphrase-file", wrong, cwd=world.tmp)
    assert "wrong passphrase" in _one_line_error(r, 2, "KeyFileError")
    assert (model / kit.MANIFEST).read_bytes() == before

    pw = _secret(world.tmp / "pw", "old pw\n")
    r = kit.run("shardtool", "sign", model, "--key", key, "--passphrase-file", pw, cwd=world.tmp)
    assert r.code == 0, r.err
    notes = [line for line in r.err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "PBKDF2" in notes[0] and "openssl pkcs8 -topk8 -scrypt" in notes[0], r.err
    r = kit.run(*kit.audit_cmd(model, [world.tmp / "legacy.pub"], 1, world.tmp / "state"), cwd=world.tmp)
    assert r.code == 0 and r.report["ok"], r.err
