"""How key material is protected: the one safe reader (non-blocking, regular files only, capped, owner-only for
secrets), scrypt-encrypted new keys, legacy PBKDF2 keys that still load with advice, and the passphrase asked
for only when the key is encrypted."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import threading

import pytest
from cryptography.hazmat.primitives import serialization

from shardtool.errors import KeyFileError
from shardtool.keys import generate, load_private_key, load_public_key, private_pem, read_key_file, write_keypair
from shardtool.keys._pkcs8 import kdf_name

PASS = b"correct horse battery staple"


def _legacy_pem(key, passphrase: bytes) -> bytes:
    """What shardtool wrote before scrypt: cryptography's PKCS#8 BestAvailableEncryption (PBKDF2, 2,048)."""
    return key.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.BestAvailableEncryption(passphrase))


def _write(path, data: bytes, mode: int = 0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


# --- the reader --------------------------------------------------------------------------------------------


def _fifo(path):
    os.mkfifo(path, 0o600)


def _directory(path):
    path.mkdir(mode=0o700)


def _socket(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    os.chmod(path, 0o600)


SPECIAL = {"fifo": (_fifo, "a FIFO"), "directory": (_directory, "a directory"), "socket": (_socket, "a socket")}


@pytest.mark.parametrize("secret", [True, False], ids=["secret", "public"])
@pytest.mark.parametrize("kind", list(SPECIAL))
def test_reader_refuses_what_is_not_a_regular_file(tmp_path, kind, secret):
    make, name = SPECIAL[kind]
    path = tmp_path / "k"
    make(path)
    result: list = []

    def read():
        try:
            read_key_file(path, "key file", secret=secret)
        except KeyFileError as e:
            result.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), f"reading a {kind} hung"
    assert result and f"is {name}, expected a regular file" in str(result[0])


def test_reader_refuses_a_character_device(raises_exactly):
    with raises_exactly(KeyFileError, match="is a character device"):
        read_key_file("/dev/null", "key file", secret=False)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o700 | 0o070],
                         ids=lambda m: f"{m:04o}")
def test_reader_refuses_a_secret_group_or_others_can_access(tmp_path, mode, raises_exactly):
    path = _write(tmp_path / "s", b"x", mode)
    with raises_exactly(KeyFileError, match=f"has mode {mode:04o}; group or others have access"):
        read_key_file(path, "passphrase file", secret=True)
    assert read_key_file(path, "public key file", secret=False) == b"x"  # public material: any mode


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700], ids=lambda m: f"{m:04o}")
def test_reader_accepts_an_owner_only_secret(tmp_path, mode):
    assert read_key_file(_write(tmp_path / "s", b"secret", mode), "passphrase file", secret=True) == b"secret"


def test_reader_caps_the_size(tmp_path, raises_exactly):
    path = _write(tmp_path / "s", b"x" * 4097)
    with raises_exactly(KeyFileError, match="larger than 4096 bytes"):
        read_key_file(path, "passphrase file", secret=True, cap=4096)
    assert len(read_key_file(_write(tmp_path / "t", b"x" * 4096), "passphrase file", secret=True, cap=4096)) == 4096


def test_public_and_private_key_loaders_use_the_reader(tmp_path, raises_exactly):
    _fifo(tmp_path / "k.pub")
    _fifo(tmp_path / "k.key")
    with raises_exactly(KeyFileError, match="is a FIFO"):
        load_public_key(tmp_path / "k.pub")
    with raises_exactly(KeyFileError, match="is a FIFO"):
        load_private_key(tmp_path / "k.key", None)


# --- encryption --------------------------------------------------------------------------------------------


def test_new_encrypted_key_is_scrypt_and_legacy_key_is_pbkdf2():
    key = generate()
    assert kdf_name(private_pem(key, PASS)) == "scrypt"
    assert kdf_name(_legacy_pem(key, PASS)) == "pbkdf2"
    for junk in (b"", b"-----BEGIN ENCRYPTED PRIVATE KEY-----\n!!\n-----END ENCRYPTED PRIVATE KEY-----\n",
                 b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMAA=\n-----END ENCRYPTED PRIVATE KEY-----\n"):
        assert kdf_name(junk) == "unknown"


def test_each_encryption_has_its_own_salt_and_iv():
    key = generate()
    assert private_pem(key, PASS) != private_pem(key, PASS)


def test_legacy_key_loads_with_a_note_and_a_new_key_without(tmp_path):
    key = generate()
    legacy = _write(tmp_path / "old.key", _legacy_pem(key, b"short"))  # below today's minimum: still opens
    loaded = load_private_key(legacy, b"short")
    assert loaded.public == key.public
    assert "PBKDF2" in loaded.protection_note and "-scrypt_p 4" in loaded.protection_note
    new, _ = write_keypair(tmp_path / "new", key, PASS, force=False)
    assert load_private_key(new, PASS).protection_note is None
    plain, _ = write_keypair(tmp_path / "plain", key, None, force=False)
    assert load_private_key(plain, None).protection_note is None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_the_reencryption_advice_works(tmp_path):
    """The command the note suggests (passphrases added, as a user would type them at its prompts) turns a
    legacy key into a scrypt key of the same key pair, mode 0600, that loads without a note."""
    key = generate()
    legacy = _write(tmp_path / "old key.key", _legacy_pem(key, PASS))  # a space: the advice quotes paths
    advice = load_private_key(legacy, PASS).protection_note
    command = advice.split("re-encrypt it with scrypt: ", 1)[1]
    pw = shlex.quote(f"pass:{PASS.decode()}")
    command = command.replace("-topk8", f"-topk8 -passin {pw} -passout {pw}", 1)
    subprocess.run(["bash", "-c", command], check=True, capture_output=True, cwd=tmp_path)
    assert not (tmp_path / "old key.key.new").exists()
    assert stat.S_IMODE(legacy.stat().st_mode) == 0o600
    assert kdf_name(legacy.read_bytes()) == "scrypt"
    again = load_private_key(legacy, PASS)
    assert again.public == key.public and again.protection_note is None
    assert re.search(r"-scrypt_N 16384 -scrypt_r 8 -scrypt_p 4", advice)


# --- asking for the passphrase -----------------------------------------------------------------------------


def test_passphrase_is_asked_for_only_when_the_key_is_encrypted(tmp_path):
    asked: list = []

    def ask() -> bytes:
        asked.append(1)
        return PASS

    key = generate()
    plain, _ = write_keypair(tmp_path / "plain", key, None, force=False)
    assert load_private_key(plain, ask).public == key.public and asked == []
    encrypted, _ = write_keypair(tmp_path / "enc", key, PASS, force=False)
    assert load_private_key(encrypted, ask).public == key.public and asked == [1]


def test_passphrase_is_not_asked_for_when_the_key_file_is_refused(tmp_path, raises_exactly):
    key_path, _ = write_keypair(tmp_path / "k", generate(), PASS, force=False)
    os.chmod(key_path, 0o644)
    with raises_exactly(KeyFileError, match="chmod 600"):
        load_private_key(key_path, lambda: pytest.fail("asked for a passphrase for a key it refuses"))


def test_a_process_that_loaded_a_private_key_keeps_its_memory_private(tmp_path):
    """Once a private key is decrypted into a process, no other process of the same user may ptrace it or read its
    /proc/PID/mem (PR_SET_DUMPABLE 0): checked in a fresh interpreter, before and after the load."""
    import subprocess
    import sys

    from shardtool.keys import generate, write_keypair

    write_keypair(tmp_path / "k", generate(), None, force=False)
    code = ("import sys; from shardtool.keys import load_private_key; from shardtool.private_memory import "
            "memory_private; before = memory_private(); load_private_key(sys.argv[1], None); "
            "print(before, memory_private())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "k.key")], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]
