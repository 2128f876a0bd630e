"""Ed25519 keys for shardtool: generate, store, load, key IDs. Implementation in `_keys` (files: `_files`, encryption: `_pkcs8`)."""

from shardtool.keys._files import MAX_PASSPHRASE_FILE, read_key_file
from shardtool.keys._keys import (
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

__all__ = [
    "MAX_PASSPHRASE_FILE", "MIN_PASSPHRASE_CHARS", "PUBLIC_KEY_SIZE", "SIGNATURE_SIZE", "Passphrase", "PrivateKey",
    "PublicKey", "check_new_passphrase", "generate", "key_id", "load_private_key", "load_public_key", "private_pem",
    "public_key_from_pem", "read_key_file", "trusted_keys", "write_keypair",
]
