"""Ed25519 key files: PKCS#8 PEM private keys (passphrase-encrypted by default), SPKI PEM public keys.

Key IDs are labels for humans and for picking a key quickly; no security decision rests on them.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shardtool._atomic import atomic_write_bytes
from shardtool.errors import KeyFileError, SignatureError, StorageError

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
MAX_KEY_FILE = 64 * 1024


def key_id(public_raw: bytes) -> str:
    """First 16 bytes of BLAKE3(raw public key), hex: a label, never a trust decision."""
    return blake3.blake3(public_raw).digest()[:16].hex()


@dataclass(frozen=True)
class PublicKey:
    """A trusted Ed25519 public key; equality is on the raw 32 bytes."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != PUBLIC_KEY_SIZE:
            raise KeyFileError(f"an Ed25519 public key is {PUBLIC_KEY_SIZE} bytes")

    @property
    def keyid(self) -> str:
        return key_id(self.raw)

    def verify(self, signature: bytes, message: bytes) -> None:
        """Raise SignatureError unless `signature` is a valid Ed25519 signature of `message` (RFC 8032)."""
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_SIZE:
            raise SignatureError(f"signature must be {SIGNATURE_SIZE} bytes")
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except (InvalidSignature, ValueError) as e:
            raise SignatureError(f"signature does not verify with key {self.keyid}") from e

    def to_pem(self) -> bytes:
        return Ed25519PublicKey.from_public_bytes(self.raw).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class PrivateKey:
    key: Ed25519PrivateKey

    @property
    def public(self) -> PublicKey:
        return PublicKey(self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


def generate() -> PrivateKey:
    return PrivateKey(Ed25519PrivateKey.generate())


def private_pem(key: PrivateKey, passphrase: bytes | None) -> bytes:
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase
                  else serialization.NoEncryption())
    return key.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _read_small(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_KEY_FILE + 1)
    except FileNotFoundError:
        raise KeyFileError(f"{what} not found", path=str(path)) from None
    except OSError as e:
        raise StorageError(f"cannot read {what}: {e.strerror}", path=str(path)) from e
    if len(data) > MAX_KEY_FILE:
        raise KeyFileError(f"{what} is larger than {MAX_KEY_FILE} bytes; not a key file", path=str(path))
    return data


def public_key_from_pem(data: bytes, *, path: str | None = None) -> PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except UnsupportedAlgorithm as e:  # a curve or key type cryptography cannot load (SM2, secp112r1 ...)
        raise KeyFileError(f"public key type is not supported ({e}), expected Ed25519", path=path) from e
    except (ValueError, TypeError) as e:
        raise KeyFileError("not a PEM public key (expected '-----BEGIN PUBLIC KEY-----')", path=path) from e
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"public key is {type(key).__name__}, expected Ed25519", path=path)
    return PublicKey(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def load_public_key(path: Path | str) -> PublicKey:
    path = Path(path)
    return public_key_from_pem(_read_small(path, "public key file"), path=str(path))


def check_private_key_mode(path: Path) -> None:
    """Refuse a private key others can read, as ssh does: the key is only as secret as its file."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"private key file has mode {stat.S_IMODE(mode):04o}; others can read it",
                           path=str(path), hint=f"run: chmod 600 {path}")


def load_private_key(path: Path | str, passphrase: bytes | None) -> PrivateKey:
    path = Path(path)
    data = _read_small(path, "private key file")
    check_private_key_mode(path)
    encrypted = b"ENCRYPTED PRIVATE KEY" in data
    if encrypted and not passphrase:
        raise KeyFileError("private key is encrypted and no passphrase was given", path=str(path),
                           hint="use --passphrase-file, SHARDTOOL_PASSPHRASE or a terminal prompt")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase if encrypted else None)
    except UnsupportedAlgorithm as e:  # a curve, key type or cipher cryptography cannot load
        raise KeyFileError(f"private key type or encryption is not supported ({e}), expected Ed25519",
                           path=str(path)) from e
    except (ValueError, TypeError) as e:
        if encrypted:
            raise KeyFileError("wrong passphrase (or a corrupt encrypted key)", path=str(path)) from e
        raise KeyFileError("not a PEM PKCS#8 private key", path=str(path)) from e
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"private key is {type(key).__name__}, expected Ed25519", path=str(path))
    return PrivateKey(key)


def write_keypair(out: Path | str, key: PrivateKey, passphrase: bytes | None, *, force: bool) -> tuple[Path, Path]:
    """Write OUT.key (0600) and OUT.pub atomically; never replace existing files unless `force`."""
    out = Path(out)
    key_path, pub_path = out.with_name(out.name + ".key"), out.with_name(out.name + ".pub")
    if not force:
        for p in (key_path, pub_path):
            if p.exists() or p.is_symlink():
                raise KeyFileError("file exists; refusing to overwrite it", path=str(p), hint="pass --force to replace it")
    if not key_path.parent.is_dir():
        raise KeyFileError("directory does not exist", path=str(key_path.parent))
    if force:
        # The old public key goes first: a crash between the two writes then leaves a private key without
        # its .pub (rerun keygen), never a new private key beside the old public key, a pair that looks
        # complete and is not.
        try:
            pub_path.unlink(missing_ok=True)
        except OSError as e:
            raise StorageError(f"cannot replace: {e.strerror}", path=str(pub_path)) from e
    atomic_write_bytes(key_path, private_pem(key, passphrase), mode=0o600, overwrite=force)
    atomic_write_bytes(pub_path, key.public.to_pem(), mode=0o644, overwrite=force)
    return key_path, pub_path
