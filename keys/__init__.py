"""Ed25519 keys for shardtool: generate, store, load, key IDs. Implementation in `_keys`."""

from shardtool.keys._keys import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    PrivateKey,
    PublicKey,
    check_private_key_mode,
    generate,
    key_id,
    load_private_key,
    load_public_key,
    private_pem,
    public_key_from_pem,
    write_keypair,
)

__all__ = [
    "PUBLIC_KEY_SIZE", "SIGNATURE_SIZE", "PrivateKey", "PublicKey", "check_private_key_mode", "generate", "key_id",
    "load_private_key", "load_public_key", "private_pem", "public_key_from_pem", "write_keypair",
]
