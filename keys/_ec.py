"""ECDSA keys (NIST P-256/384/521) for the OpenSSF Model Signing path only: shardtool's own manifest is signed with
Ed25519. Private keys are PKCS#8 PEM (scrypt-encrypted by default, as keygen writes Ed25519 keys), public keys SPKI
PEM; a signature is DER, over SHA-256/384/512 by curve, as the OMS key signer and verifier use them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shardtool.errors import KeyFileError, SignatureError
from shardtool.keys._files import read_key_file

# keygen's --algorithm name -> curve; the three curves OMS key bundles allow.
CURVES = {"ecdsa-p256": ec.SECP256R1, "ecdsa-p384": ec.SECP384R1, "ecdsa-p521": ec.SECP521R1}
_HASHES = {"secp256r1": hashes.SHA256, "secp384r1": hashes.SHA384, "secp521r1": hashes.SHA512}
# A DER ECDSA signature over P-521 is at most 139 bytes; anything longer is not one.
MAX_EC_SIGNATURE = 160


def _check_curve(key: ec.EllipticCurvePublicKey, path: str | None) -> None:
    if key.curve.name not in _HASHES:
        raise KeyFileError(f"EC key on curve {key.curve.name}, expected P-256, P-384 or P-521", path=path)


@dataclass(frozen=True)
class EcPublicKey:
    """A trusted ECDSA public key; `pem` is its SPKI PEM exactly as cryptography writes it, the bytes whose SHA-256
    an OMS bundle names as its key hint."""

    pem: bytes
    key: ec.EllipticCurvePublicKey = field(compare=False, repr=False)

    @classmethod
    def from_key(cls, key: ec.EllipticCurvePublicKey, path: str | None = None) -> "EcPublicKey":
        _check_curve(key, path)
        pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        return cls(pem, key)

    @property
    def hint(self) -> str:
        return hashlib.sha256(self.pem).hexdigest()

    @property
    def keyid(self) -> str:
        """A label for messages: the hint's first 32 hex characters."""
        return self.hint[:32]

    def verify(self, signature: bytes, message: bytes) -> None:
        """Raise SignatureError unless `signature` is a valid DER ECDSA signature of `message` by this key."""
        if not isinstance(signature, bytes) or not 0 < len(signature) <= MAX_EC_SIGNATURE:
            raise SignatureError(f"an ECDSA signature is 1-{MAX_EC_SIGNATURE} bytes of DER")
        try:
            self.key.verify(signature, message, ec.ECDSA(_HASHES[self.key.curve.name]()))
        except (InvalidSignature, ValueError) as e:
            raise SignatureError(f"signature does not verify with EC key {self.keyid}") from e

    def to_pem(self) -> bytes:
        return self.pem


@dataclass(frozen=True)
class EcPrivateKey:
    key: ec.EllipticCurvePrivateKey
    protection_note: str | None = field(default=None, compare=False)

    @property
    def public(self) -> EcPublicKey:
        return EcPublicKey.from_key(self.key.public_key())

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message, ec.ECDSA(_HASHES[self.key.curve.name]()))


def generate_ec(algorithm: str) -> EcPrivateKey:
    return EcPrivateKey(ec.generate_private_key(CURVES[algorithm]()))


def ec_public_key_from_pem(data: bytes, *, path: str | None = None) -> EcPublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except UnsupportedAlgorithm as e:
        raise KeyFileError(f"public key type is not supported ({e}), expected an EC key", path=path) from e
    except (ValueError, TypeError) as e:
        raise KeyFileError("not a PEM public key (expected '-----BEGIN PUBLIC KEY-----')", path=path) from e
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise KeyFileError(f"public key is {type(key).__name__}, expected an EC key (P-256, P-384 or P-521)",
                           path=path)
    return EcPublicKey.from_key(key, path)


def load_ec_public_key(path: Path | str) -> EcPublicKey:
    return ec_public_key_from_pem(read_key_file(path, "public key file", secret=False), path=str(path))


def trusted_ec_keys(paths) -> list[EcPublicKey]:
    """The EC keys an OMS signature may verify with, as a caller gives them (loaded keys or key files); at least one."""
    from shardtool.errors import UsageError

    if not paths:
        raise UsageError("no trusted EC public key given", hint="pass the OMS signer's EC.pub with --trust")
    return [k if isinstance(k, EcPublicKey) else load_ec_public_key(k) for k in paths]


def load_ec_private_key(path: Path | str, passphrase) -> EcPrivateKey:
    """An EC private key file on one of the OMS curves (the passphrase asked for only if it is encrypted)."""
    from shardtool.keys._keys import read_private_key

    key, note = read_private_key(path, passphrase, ec.EllipticCurvePrivateKey, "an EC key (P-256, P-384 or P-521)")
    _check_curve(key.public_key(), str(path))
    return EcPrivateKey(key, note)
