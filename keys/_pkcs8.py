"""Passphrase encryption of private keys: PKCS#8 EncryptedPrivateKeyInfo, PBES2 with scrypt and AES-256-CBC.

The format is standard (RFC 5958 EncryptedPrivateKeyInfo, RFC 8018 PBES2, RFC 7914 §7 scrypt parameters) and is
what `openssl pkcs8 -topk8 -scrypt` writes; OpenSSL and pyca/cryptography both read it. cryptography only writes
PBKDF2-HMAC-SHA256 with 2,048 iterations for PKCS#8 (well under a millisecond a guess) and offers no knob for
that, so the few DER structures are written here and decrypted by cryptography's own loader (`_keys`), which
also checks every key we write before it reaches the disk.

Parameters: N = 2^14, r = 8 is the largest scrypt memory (16 MiB) that OpenSSL's and cryptography's loaders
accept (their 32 MiB cap covers 128·r·(N+2) bytes plus the lanes), so the cost is raised with p, the
number of lanes: each lane is one more full 16 MiB scrypt computation a guess must pay for.
"""

from __future__ import annotations

import base64
import os

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

SCRYPT_N = 1 << 14
SCRYPT_R = 8
SCRYPT_P = 4
SALT_BYTES = 16
PEM_LABEL = b"ENCRYPTED PRIVATE KEY"

# DER encodings of the object identifiers (tag 06, length, value).
OID_PBES2 = bytes.fromhex("06092a864886f70d01050d")  # 1.2.840.113549.1.5.13
OID_PBKDF2 = bytes.fromhex("06092a864886f70d01050c")  # 1.2.840.113549.1.5.12
OID_SCRYPT = bytes.fromhex("06092b06010401da47040b")  # 1.3.6.1.4.1.11591.4.11
OID_AES256_CBC = bytes.fromhex("060960864801650304012a")  # 2.16.840.1.101.3.4.1.42


def _tlv(tag: int, body: bytes) -> bytes:
    n = len(body)
    if n < 0x80:
        return bytes([tag, n]) + body
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(size)]) + size + body


def _seq(*items: bytes) -> bytes:
    return _tlv(0x30, b"".join(items))


def _uint(value: int) -> bytes:
    # Minimal two's complement of a positive value: a leading zero byte only when the top bit is set.
    return _tlv(0x02, value.to_bytes(value.bit_length() // 8 + 1, "big"))


def _octets(data: bytes) -> bytes:
    return _tlv(0x04, data)


def encrypt_pkcs8(private_key_info_der: bytes, passphrase: bytes) -> bytes:
    """PEM of the EncryptedPrivateKeyInfo that wraps a DER PrivateKeyInfo under `passphrase`."""
    salt, iv = os.urandom(SALT_BYTES), os.urandom(16)
    key = Scrypt(salt=salt, length=32, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P).derive(passphrase)
    padder = padding.PKCS7(128).padder()
    padded = padder.update(private_key_info_der) + padder.finalize()
    encryptor = Cipher(algorithms.AES256(key), modes.CBC(iv)).encryptor()
    ciphertext = encryptor.update(padded) + encryptor.finalize()
    der = _seq(
        _seq(OID_PBES2,
             _seq(_seq(OID_SCRYPT, _seq(_octets(salt), _uint(SCRYPT_N), _uint(SCRYPT_R), _uint(SCRYPT_P))),
                  _seq(OID_AES256_CBC, _octets(iv)))),
        _octets(ciphertext))
    body = base64.b64encode(der)
    lines = [body[i:i + 64] for i in range(0, len(body), 64)]
    return b"".join([b"-----BEGIN %s-----\n" % PEM_LABEL, *(line + b"\n" for line in lines),
                     b"-----END %s-----\n" % PEM_LABEL])


def _children(der: bytes) -> list[bytes]:
    """The encodings (tag, length, value) inside one DER SEQUENCE; ValueError on anything else."""
    def item(at: int, end: int) -> tuple[int, int]:  # (start of value, end of this item)
        if at + 2 > end:
            raise ValueError("truncated")
        n = der[at + 1]
        at += 2
        if n & 0x80:
            width = n & 0x7F
            if not 1 <= width <= 4 or at + width > end:
                raise ValueError("bad length")
            n, at = int.from_bytes(der[at:at + width], "big"), at + width
        if at + n > end:
            raise ValueError("truncated")
        return at, at + n

    if not der or der[0] != 0x30:
        raise ValueError("not a SEQUENCE")
    start, end = item(0, len(der))
    out = []
    while start < end:
        value, stop = item(start, end)
        out.append(der[start:stop])
        start = stop
    return out


def kdf_name(pem: bytes) -> str:
    """Which KDF protects an encrypted PKCS#8 PEM: "scrypt", "pbkdf2" or "unknown". Used for advice only;
    cryptography's loader decides whether the file decrypts."""
    try:
        body = pem.split(b"-----BEGIN %s-----" % PEM_LABEL, 1)[1].split(b"-----END", 1)[0]
        algorithm = _children(_children(base64.b64decode(body))[0])
        if algorithm[0] != OID_PBES2:
            return "unknown"
        kdf_oid = _children(_children(algorithm[1])[0])[0]
    except (IndexError, ValueError):  # binascii.Error is a ValueError
        return "unknown"
    return {OID_SCRYPT: "scrypt", OID_PBKDF2: "pbkdf2"}.get(kdf_oid, "unknown")
