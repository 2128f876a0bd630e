"""Key files: generate/write/load round trips, passphrases, modes, refusing to overwrite, foreign keys."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import blake3
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shardtool.errors import KeyFileError, SignatureError, UsageError
from shardtool.keys import (
    PrivateKey,
    PublicKey,
    generate,
    key_id,
    load_private_key,
    load_public_key,
    private_pem,
    public_key_from_pem,
    write_keypair,
)

PASS = b"correct horse battery staple"

# Keys cryptography cannot load at all (it raises UnsupportedAlgorithm, not ValueError): SM2 and secp112r1,
# generated once with `openssl genpkey -algorithm SM2` / `openssl ecparam -name secp112r1 -genkey`.
SM2_PRIVATE = b"""-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqBHM9VAYItBG0wawIBAQQg/QrVh0w4KcNDh9JX
mGx96aSOJGAjVxSL4DIEqNUrLsOhRANCAATjI4FprJaoxtAPUEoUM6yYtnZFatKT
iTrwDiD7qunF2Jq2lbjyTMkdPXr3y2pac0YYhIMTzhfvjOXFVJdx96K4
-----END PRIVATE KEY-----
"""
SM2_PUBLIC = b"""-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoEcz1UBgi0DQgAE4yOBaayWqMbQD1BKFDOsmLZ2RWrS
k4k68A4g+6rpxdiatpW48kzJHT1698tqWnNGGISDE84X74zlxVSXcfeiuA==
-----END PUBLIC KEY-----
"""
SECP112R1_PRIVATE = b"""-----BEGIN PRIVATE KEY-----
ME4CAQAwEAYHKoZIzj0CAQYFK4EEAAYENzA1AgEBBA7JQawd1byN1SrAVfAHgaEg
Ax4ABBqjGpo4dGbaYslsl+2N05ghrUTSbAg3LyhRSng=
-----END PRIVATE KEY-----
"""
SECP112R1_PUBLIC = b"""-----BEGIN PUBLIC KEY-----
MDIwEAYHKoZIzj0CAQYFK4EEAAYDHgAEGqMamjh0ZtpiyWyX7Y3TmCGtRNJsCDcv
KFFKeA==
-----END PUBLIC KEY-----
"""


def _pkcs8(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _spki(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _write(path, data: bytes, mode: int = 0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


# --- round trips -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("passphrase", [PASS, None], ids=["encrypted", "unencrypted"])
def test_generate_write_load_round_trip(tmp_path, passphrase):
    key = generate()
    key_path, pub_path = write_keypair(tmp_path / "pub1", key, passphrase, force=False)
    assert (key_path.name, pub_path.name) == ("pub1.key", "pub1.pub")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    pem = key_path.read_bytes()
    assert (b"ENCRYPTED PRIVATE KEY" in pem) == (passphrase is not None)
    assert b"BEGIN PUBLIC KEY" in pub_path.read_bytes()

    loaded = load_private_key(key_path, passphrase)
    assert loaded.public == key.public
    assert load_public_key(pub_path) == key.public
    message = b"the exact payload"
    loaded.public.verify(loaded.sign(message), message)
    key.public.verify(loaded.sign(message), message)  # same private key, not merely the same public half


def test_unencrypted_key_loads_even_if_a_passphrase_is_given(tmp_path):
    key = generate()
    key_path, _ = write_keypair(tmp_path / "k", key, None, force=False)
    assert load_private_key(key_path, b"unused").public == key.public


@pytest.mark.parametrize("passphrase", [b"", b"x", b"eleven char", "\u00e9".encode() * 11],
                         ids=["empty", "1-char", "11-chars", "11-chars-22-bytes"])
def test_new_key_passphrase_shorter_than_the_minimum_is_refused(passphrase, raises_exactly):
    # Only None means "no encryption": an empty passphrase once silently wrote an unencrypted key.
    with raises_exactly(UsageError, match="a new key needs at least 12"):
        private_pem(generate(), passphrase)


@pytest.mark.parametrize("passphrase", [b"twelve chars", "\u00e9".encode() * 12, b"\xff" * 12],
                         ids=["12-chars", "12-chars-24-bytes", "12-bytes-not-utf8"])
def test_new_key_passphrase_of_the_minimum_length_is_accepted(tmp_path, passphrase):
    key = generate()
    key_path, _ = write_keypair(tmp_path / "k", key, passphrase, force=False)
    assert load_private_key(key_path, passphrase).public == key.public


def test_public_pem_round_trip_and_key_id_are_stable(ed25519_keys):
    public = ed25519_keys[0].public
    assert public.raw.hex() == "8a88e3dd7409f195fd52db2d3cba5d72ca6709bf1d94121bf3748801b40f6f5c"
    # Known answer: first 16 bytes of BLAKE3(raw public key), hex. Changing it orphans every published keyid.
    assert public.keyid == key_id(public.raw) == "83561adb398fd87f8e7ed8331bff2fcb"
    assert public.keyid == blake3.blake3(public.raw).digest()[:16].hex()
    again = public_key_from_pem(public.to_pem())
    assert again == public and again.keyid == public.keyid
    assert len({k.public.keyid for k in ed25519_keys}) == len(ed25519_keys)


# --- refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [b"wrong", None, b""], ids=["wrong-passphrase", "no-passphrase", "empty-passphrase"])
def test_encrypted_key_needs_the_right_passphrase(tmp_path, given, raises_exactly):
    key_path, _ = write_keypair(tmp_path / "k", generate(), PASS, force=False)
    with raises_exactly(KeyFileError):
        load_private_key(key_path, given)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o770, 0o601, 0o610], ids=lambda m: f"{m:04o}")
def test_private_key_readable_by_others_is_refused(tmp_path, mode, raises_exactly):
    key_path, _ = write_keypair(tmp_path / "k", generate(), None, force=False)
    os.chmod(key_path, mode)
    with raises_exactly(KeyFileError, match="chmod 600"):
        load_private_key(key_path, None)


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=lambda m: f"{m:04o}")
def test_private_key_modes_for_owner_only_are_accepted(tmp_path, mode):
    key = generate()
    key_path, _ = write_keypair(tmp_path / "k", key, None, force=False)
    os.chmod(key_path, mode)
    assert load_private_key(key_path, None).public == key.public


@pytest.mark.parametrize("existing", ["k.key", "k.pub"])
def test_refuses_to_overwrite_without_force(tmp_path, existing, raises_exactly):
    (tmp_path / existing).write_bytes(b"precious")
    with raises_exactly(KeyFileError):
        write_keypair(tmp_path / "k", generate(), None, force=False)
    assert (tmp_path / existing).read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == [existing], "nothing else was written"


def test_refuses_to_overwrite_a_dangling_symlink(tmp_path, raises_exactly):
    (tmp_path / "k.pub").symlink_to(tmp_path / "elsewhere")
    with raises_exactly(KeyFileError):
        write_keypair(tmp_path / "k", generate(), None, force=False)
    assert not (tmp_path / "elsewhere").exists()


def test_force_replaces_both_files(tmp_path):
    first, second = generate(), generate()
    write_keypair(tmp_path / "k", first, None, force=False)
    key_path, pub_path = write_keypair(tmp_path / "k", second, None, force=True)
    assert load_private_key(key_path, None).public == second.public
    assert load_public_key(pub_path) == second.public
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


def test_missing_directory_is_refused(tmp_path, raises_exactly):
    with raises_exactly(KeyFileError):
        write_keypair(tmp_path / "nope" / "k", generate(), None, force=False)


_P256 = ec.generate_private_key(ec.SECP256R1())
_ED448 = ed448.Ed448PrivateKey.generate()
_X25519 = x25519.X25519PrivateKey.generate()

FOREIGN_PRIVATE = {
    "ec-p256-pkcs8": _pkcs8(_P256),
    "ec-p256-traditional": _P256.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                               serialization.NoEncryption()),
    "ed448": _pkcs8(_ED448),
    "x25519": _pkcs8(_X25519),
    "sm2-unsupported": SM2_PRIVATE,
    "secp112r1-unsupported": SECP112R1_PRIVATE,
}
GARBAGE = {
    "empty": b"",
    "text": b"garbage\n",
    "binary": bytes(range(256)),
    "public-key-pem": _spki(Ed25519PrivateKey.generate()),
    "truncated-pem": _pkcs8(Ed25519PrivateKey.generate())[:60],
    "wrong-label": _pkcs8(Ed25519PrivateKey.generate()).replace(b"PRIVATE KEY", b"CERTIFICATE"),
    "der-not-pem": Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.DER,
                                                              serialization.PrivateFormat.PKCS8,
                                                              serialization.NoEncryption()),
    "too-large": b"-----BEGIN PRIVATE KEY-----\n" + b"A" * (64 * 1024) + b"\n-----END PRIVATE KEY-----\n",
    "ssh-format": Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.OpenSSH,
                                                             serialization.NoEncryption()),
}


@pytest.mark.parametrize("data", list(FOREIGN_PRIVATE.values()) + list(GARBAGE.values()),
                         ids=list(FOREIGN_PRIVATE) + list(GARBAGE))
def test_private_key_that_is_not_ed25519_pkcs8_is_refused(tmp_path, data, raises_exactly):
    path = _write(tmp_path / "x.key", data)
    with raises_exactly(KeyFileError):
        load_private_key(path, None)


def test_encrypted_foreign_key_is_refused(tmp_path, raises_exactly):
    pem = _P256.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.BestAvailableEncryption(PASS))
    with raises_exactly(KeyFileError, match="expected Ed25519"):
        load_private_key(_write(tmp_path / "x.key", pem), PASS)


FOREIGN_PUBLIC = {
    "ec-p256": _spki(_P256),
    "ed448": _spki(_ED448),
    "x25519": _spki(_X25519),
    "sm2-unsupported": SM2_PUBLIC,
    "secp112r1-unsupported": SECP112R1_PUBLIC,
    "empty": b"",
    "text": b"garbage\n",
    "private-key-pem": _pkcs8(Ed25519PrivateKey.generate()),
    "truncated-pem": _spki(Ed25519PrivateKey.generate())[:40],
    "too-large": b"-----BEGIN PUBLIC KEY-----\n" + b"A" * (64 * 1024) + b"\n-----END PUBLIC KEY-----\n",
}


@pytest.mark.parametrize("data", list(FOREIGN_PUBLIC.values()), ids=list(FOREIGN_PUBLIC))
def test_public_key_that_is_not_ed25519_spki_is_refused(tmp_path, data, raises_exactly):
    path = _write(tmp_path / "x.pub", data, 0o644)
    with raises_exactly(KeyFileError):
        load_public_key(path)


@pytest.mark.parametrize("form", ["as-written", "no-final-newline", "crlf", "wrapped-at-32", "blank-line-after"])
def test_public_key_forms_read_alike_by_the_short_path_and_the_pem_loader(tmp_path, form):
    """keygen's own file is read without cryptography's PEM loader; every other layout goes through the loader.
    Both give the same key."""
    key = generate().public
    pem = key.to_pem()
    body = pem.split(b"\n")[1]
    data = {"as-written": pem, "no-final-newline": pem.rstrip(b"\n"), "crlf": pem.replace(b"\n", b"\r\n"),
            "wrapped-at-32": pem.replace(body, body[:32] + b"\n" + body[32:]),
            "blank-line-after": pem + b"\n"}[form]
    assert public_key_from_pem(data) == key
    assert load_public_key(_write(tmp_path / "x.pub", data, 0o644)) == key


@pytest.mark.parametrize("loader", [lambda p: load_public_key(p), lambda p: load_private_key(p, None)],
                         ids=["public", "private"])
def test_missing_key_file_is_a_key_file_error(tmp_path, loader, raises_exactly):
    with raises_exactly(KeyFileError):
        loader(tmp_path / "absent")


# --- verify ------------------------------------------------------------------------------------------------


def test_verify_accepts_only_the_signed_message(ed25519_keys, raises_exactly):
    key = ed25519_keys[0]
    sig = key.sign(b"message")
    assert key.public.verify(sig, b"message") is None
    bad = {
        "other-message": (sig, b"messagE"),
        "other-key": (ed25519_keys[1].sign(b"message"), b"message"),
        "flipped-bit": (bytes([sig[0] ^ 1]) + sig[1:], b"message"),
        "short": (sig[:63], b"message"),
        "long": (sig + b"\x00", b"message"),
        "empty": (b"", b"message"),
        "not-bytes": (sig.hex(), b"message"),
        "bytearray": (bytearray(sig), b"message"),
    }
    for name, (signature, message) in bad.items():
        with raises_exactly(SignatureError):
            key.public.verify(signature, message)


# --- interop -----------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_openssl_reads_our_key_files(tmp_path):
    key = generate()
    key_path, pub_path = write_keypair(tmp_path / "k", key, PASS, force=False)
    subprocess.run(["openssl", "pkey", "-pubin", "-in", str(pub_path), "-noout"], check=True, capture_output=True)
    # OpenSSL derives the same public key from our encrypted private key file.
    out = subprocess.run(["openssl", "pkey", "-in", str(key_path), "-passin", f"pass:{PASS.decode()}", "-pubout"],
                         check=True, capture_output=True).stdout
    assert public_key_from_pem(out) == key.public
    # And we read a key OpenSSL generated.
    subprocess.run(["openssl", "genpkey", "-algorithm", "ED25519", "-out", str(tmp_path / "o.key")],
                   check=True, capture_output=True)
    os.chmod(tmp_path / "o.key", 0o600)
    theirs = load_private_key(tmp_path / "o.key", None)
    assert isinstance(theirs, PrivateKey) and isinstance(theirs.public, PublicKey)
