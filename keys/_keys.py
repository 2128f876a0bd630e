"""Manifest signing keys: Ed25519 (the default), or ML-DSA (FIPS 204, post-quantum) where the installed cryptography
offers it. Key files: PKCS#8 PEM private keys (passphrase-encrypted by default), SPKI PEM public keys.

New encrypted keys use scrypt (`_pkcs8`); keys encrypted by earlier versions (PBKDF2, 2,048 iterations) still
load, with advice to re-encrypt them. Key IDs are labels for humans and for picking a key quickly; no security
decision rests on them.
"""

from __future__ import annotations

import base64
import binascii
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

import blake3
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shardtool.atomic import atomic_write_bytes
from shardtool.errors import KeyFileError, SignatureError, StorageError, UsageError
from shardtool.keys._files import read_key_file
from shardtool.private_memory import keep_memory_private

# cryptography's `serialization` (and `_pkcs8`'s ciphers and KDF) are imported where a key is written, a private
# key read, or an unusual public key file parsed: they cost about 30 ms at the start of every command that only
# checks signatures (audit, verify-and-run), next to a 0.5 s warm audit of 2 GiB.

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
# Every algorithm a manifest signature may use: name -> (raw public key bytes, signature bytes). The sizes are all
# distinct, so a raw key names its algorithm and a signature's length says which keys can have made it.
ALGORITHMS = {"ed25519": (PUBLIC_KEY_SIZE, SIGNATURE_SIZE), "ml-dsa-44": (1312, 2420), "ml-dsa-65": (1952, 3309),
              "ml-dsa-87": (2592, 4627)}
_BY_KEY_SIZE = {key: name for name, (key, _) in ALGORITHMS.items()}
SIGNATURE_SIZES = frozenset(sig for _, sig in ALGORITHMS.values())


def _mldsa_class(algorithm: str, part: str):
    """cryptography's ML-DSA class for `algorithm` ("PublicKey" or "PrivateKey"), or None when it has none."""
    try:
        from cryptography.hazmat.primitives.asymmetric import mldsa
    except ImportError:
        return None
    return getattr(mldsa, "MLDSA" + algorithm.rsplit("-", 1)[1] + part, None)


def mldsa_available() -> bool:
    """Whether the installed cryptography (and its OpenSSL) can make and check ML-DSA signatures."""
    cls = _mldsa_class("ml-dsa-65", "PrivateKey")
    if cls is None:
        return False
    try:
        cls.generate()
    except UnsupportedAlgorithm:
        return False
    return True
# For new keys only: a key already written opens with whatever passphrase it was written with.
MIN_PASSPHRASE_CHARS = 12

# A passphrase, none, or a function asked for one only when the key file turns out to be encrypted.
Passphrase = Union[bytes, None, Callable[[], bytes]]


def key_id(public_raw: bytes) -> str:
    """First 16 bytes of BLAKE3(raw public key), hex: a label, never a trust decision."""
    return blake3.blake3(public_raw).digest()[:16].hex()


@dataclass(frozen=True)
class PublicKey:
    """A trusted public key, Ed25519 (32 raw bytes) or ML-DSA (1312, 1952 or 2592); equality is on the raw bytes."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) not in _BY_KEY_SIZE:
            raise KeyFileError(f"an Ed25519 public key is {PUBLIC_KEY_SIZE} bytes (an ML-DSA key 1312, 1952 or 2592)")

    @property
    def keyid(self) -> str:
        return key_id(self.raw)

    @property
    def algorithm(self) -> str:
        return _BY_KEY_SIZE[len(self.raw)]

    def _key(self):
        if self.algorithm == "ed25519":
            return Ed25519PublicKey.from_public_bytes(self.raw)
        cls = _mldsa_class(self.algorithm, "PublicKey")
        if cls is None:
            raise SignatureError(f"key {self.keyid} is {self.algorithm}, which this cryptography cannot check")
        return cls.from_public_bytes(self.raw)

    def verify(self, signature: bytes, message: bytes) -> None:
        """Raise SignatureError unless `signature` is a valid signature of `message` by this key: Ed25519 (RFC 8032),
        or ML-DSA (FIPS 204, empty context)."""
        size = ALGORITHMS[self.algorithm][1]
        if not isinstance(signature, bytes) or len(signature) != size:
            raise SignatureError(f"a {self.algorithm} signature must be {size} bytes")
        try:
            self._key().verify(signature, message)
        except (InvalidSignature, ValueError, UnsupportedAlgorithm) as e:
            raise SignatureError(f"signature does not verify with key {self.keyid}") from e

    def to_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization
        return self._key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class PrivateKey:
    key: Ed25519PrivateKey  # or an ML-DSA private key (`generate`)
    # One line of advice when the file it came from is protected by a weak KDF (None: nothing to say).
    protection_note: str | None = field(default=None, compare=False)

    @property
    def public(self) -> PublicKey:
        from cryptography.hazmat.primitives import serialization
        return PublicKey(self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


def generate(algorithm: str = "ed25519") -> PrivateKey:
    """A new signing key: Ed25519, or ML-DSA-44/65/87 where cryptography offers it (else a UsageError)."""
    if algorithm == "ed25519":
        return PrivateKey(Ed25519PrivateKey.generate())
    cls = _mldsa_class(algorithm, "PrivateKey") if algorithm in ALGORITHMS else None
    if cls is None or not mldsa_available():
        raise UsageError(f"{algorithm} keys need a cryptography with ML-DSA (this one has none)")
    return PrivateKey(cls.generate())


def _signing_key_types() -> tuple[type, ...]:
    """The private key classes a manifest can be signed with here."""
    found = tuple(c for c in (_mldsa_class(a, "PrivateKey") for a in ALGORITHMS if a != "ed25519") if c is not None)
    return (Ed25519PrivateKey, *found)


def check_new_passphrase(passphrase: bytes, *, source: str | None = None) -> None:
    """The rule for a passphrase that will protect a new key: at least MIN_PASSPHRASE_CHARS characters
    (UTF-8; a byte that is not UTF-8 counts as one character)."""
    length = len(passphrase.decode("utf-8", errors="replace"))
    if length < MIN_PASSPHRASE_CHARS:
        raise UsageError(f"passphrase is {length} character(s); a new key needs at least {MIN_PASSPHRASE_CHARS}",
                         path=source, hint="use --no-passphrase to write an unencrypted key deliberately")


def private_pem(key: PrivateKey, passphrase: bytes | None) -> bytes:
    """PKCS#8 PEM: unencrypted for None, else scrypt-encrypted (a passphrase that breaks the rule is refused)."""
    from cryptography.hazmat.primitives import serialization

    from shardtool.keys._pkcs8 import encrypt_pkcs8
    if passphrase is None:
        return key.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
    check_new_passphrase(passphrase)
    der = key.key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    # Never write a key that cannot be read back: the loader that will open it later checks it now.
    try:
        pem = encrypt_pkcs8(der, passphrase)
        back = serialization.load_pem_private_key(pem, password=passphrase)
    except (UnsupportedAlgorithm, ValueError, TypeError) as e:
        raise StorageError(f"this cryptography/OpenSSL build cannot write or read a scrypt-encrypted key ({e})",
                           hint="upgrade cryptography, or --no-passphrase") from e
    if back.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption()) != der:
        raise StorageError("the encrypted private key does not decrypt to the key it was made from")
    return pem


# An Ed25519 SubjectPublicKeyInfo (RFC 8410) is this 12-byte DER header and the 32-byte key; a PEM file holds it
# as one base64 line of 60 characters.
_SPKI_ED25519 = bytes.fromhex("302a300506032b6570032100")
_PEM_BEGIN, _PEM_END = b"-----BEGIN PUBLIC KEY-----\n", b"\n-----END PUBLIC KEY-----"


def _canonical_ed25519(data: bytes) -> bytes | None:
    """The raw key of a public key file exactly as `to_pem` writes it (an optional final newline), else None."""
    body = data[len(_PEM_BEGIN):]
    if not data.startswith(_PEM_BEGIN) or body[60:] not in (_PEM_END, _PEM_END + b"\n"):
        return None
    try:
        der = base64.b64decode(body[:60], validate=True)
    except binascii.Error:
        return None
    return der[len(_SPKI_ED25519):] if len(der) == 44 and der.startswith(_SPKI_ED25519) else None


def public_key_from_pem(data: bytes, *, path: str | None = None) -> PublicKey:
    """An Ed25519 public key from an SPKI PEM file. The file keygen writes is read without cryptography's PEM
    loader (it accepts exactly that form); any other text goes through the loader, with its errors."""
    raw = _canonical_ed25519(data)
    if raw is not None:
        return PublicKey(raw)
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(data)
    except UnsupportedAlgorithm as e:  # a curve or key type cryptography cannot load (SM2, secp112r1 ...)
        raise KeyFileError(f"public key type is not supported ({e}), expected Ed25519", path=path) from e
    except (ValueError, TypeError) as e:
        raise KeyFileError("not a PEM public key (expected '-----BEGIN PUBLIC KEY-----')", path=path) from e
    if not isinstance(key, Ed25519PublicKey) and type(key).__name__ not in _MLDSA_PUBLIC:
        raise KeyFileError(f"public key is {type(key).__name__}, expected Ed25519 (or ML-DSA)", path=path)
    return PublicKey(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


_MLDSA_PUBLIC = {"MLDSA44PublicKey", "MLDSA65PublicKey", "MLDSA87PublicKey"}


def load_public_key(path: Path | str) -> PublicKey:
    path = Path(path)
    return public_key_from_pem(read_key_file(path, "public key file", secret=False), path=str(path))


def trusted_keys(keys, what: str = "trust") -> list[PublicKey]:
    """Trusted public keys as a library caller gives them: loaded `PublicKey`s, or key files read now; at least one."""
    if not keys:
        raise UsageError(f"no trusted public key given ({what})", hint="pass the publisher's KEY.pub")
    return [k if isinstance(k, PublicKey) else load_public_key(k) for k in keys]


def _reencrypt_note(path: Path, kdf: str) -> str | None:
    """Advice for a key written before scrypt: how to re-encrypt it with the same parameters keygen uses."""
    from shardtool.keys._pkcs8 import SCRYPT_N, SCRYPT_P, SCRYPT_R

    if kdf == "scrypt":
        return None
    name, new = shlex.quote(str(path)), shlex.quote(f"{path}.new")
    weak = "PBKDF2, cheap to guess" if kdf == "pbkdf2" else "a KDF other than scrypt"
    return (f"{path} is encrypted with {weak}; "
            f"re-encrypt it with scrypt: (umask 077 && openssl pkcs8 -topk8 -scrypt -scrypt_N {SCRYPT_N} "
            f"-scrypt_r {SCRYPT_R} -scrypt_p {SCRYPT_P} -in {name} -out {new}) && mv {new} {name}")


def read_private_key(path: Path | str, passphrase: Passphrase, expected: type | tuple[type, ...], expected_name: str):
    """The private key in a key file read once (owner-only, regular, capped), which must be an `expected`;
    the passphrase is asked for only if it is encrypted. Returns (the key, advice on its protection or None)."""
    path = Path(path)
    from cryptography.hazmat.primitives import serialization

    from shardtool.keys._pkcs8 import PEM_LABEL, kdf_name

    data = read_key_file(path, "private key file", secret=True)
    encrypted = PEM_LABEL in data
    if encrypted and callable(passphrase):
        passphrase = passphrase()
    elif callable(passphrase):
        passphrase = None
    if encrypted and not passphrase:
        raise KeyFileError("private key is encrypted and no passphrase was given", path=str(path),
                           hint="use --passphrase-file, SHARDTOOL_PASSPHRASE or a terminal prompt")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase if encrypted else None)
    except UnsupportedAlgorithm as e:  # a curve, key type or cipher cryptography cannot load
        raise KeyFileError(f"private key type or encryption is not supported ({e}), expected {expected_name}",
                           path=str(path)) from e
    except (ValueError, TypeError) as e:
        if encrypted:
            raise KeyFileError("wrong passphrase (or a corrupt encrypted key)", path=str(path)) from e
        raise KeyFileError("not a PEM PKCS#8 private key", path=str(path)) from e
    if not isinstance(key, expected):
        raise KeyFileError(f"private key is {type(key).__name__}, expected {expected_name}", path=str(path))
    keep_memory_private()  # the key now lives in this process's memory: no other process of this user may read it
    return key, (_reencrypt_note(path, kdf_name(data)) if encrypted else None)


def load_private_key(path: Path | str, passphrase: Passphrase) -> PrivateKey:
    """A manifest signing key file, Ed25519 or ML-DSA (`read_private_key`)."""
    key, note = read_private_key(path, passphrase, _signing_key_types(), "Ed25519")
    return PrivateKey(key, note)


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
