"""Ed25519 keys for shardtool: generate, store, load, key IDs. Implementation in `_keys` (files: `_files`, encryption:
`_pkcs8`); the ECDSA keys of the OpenSSF Model Signing path in `_ec`."""

from shardtool.keys._files import MAX_PASSPHRASE_FILE, read_key_file
from shardtool.keys._keys import (
    ALGORITHMS,
    SIGNATURE_SIZES,
    mldsa_available,
    MIN_PASSPHRASE_CHARS,
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    Passphrase,
    PrivateKey,
    PublicKey,
    check_new_passphrase,
    generate,
    key_id,
    load_private_key,
    load_public_key,
    private_pem,
    public_key_from_pem,
    trusted_keys,
    write_keypair,
)

_EAGER = [
    "ALGORITHMS", "SIGNATURE_SIZES", "mldsa_available",
    "MAX_PASSPHRASE_FILE", "MIN_PASSPHRASE_CHARS", "PUBLIC_KEY_SIZE", "SIGNATURE_SIZE", "Passphrase", "PrivateKey",
    "PublicKey", "check_new_passphrase", "generate", "key_id", "load_private_key", "load_public_key", "private_pem",
    "public_key_from_pem", "read_key_file", "trusted_keys", "write_keypair",
]

# The EC names load `_ec` (and cryptography's EC and PEM code) at first use: audit and verify-and-run never need them.
from shardtool.lazy import lazy_exports  # noqa: E402

_LAZY, _lazy_getattr, __dir__ = lazy_exports(globals(), {"_ec": (
    "CURVES", "EcPrivateKey", "EcPublicKey", "ec_public_key_from_pem", "generate_ec", "load_ec_private_key",
    "load_ec_public_key", "trusted_ec_keys")})
__all__ = sorted(_EAGER + _LAZY)
__getattr__ = _lazy_getattr
