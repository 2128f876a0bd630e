"""`shardtool keygen`: an Ed25519 key pair for signing manifests, or an ECDSA pair for OpenSSF Model Signing."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from shardtool.cli._common import emit_json, producer, say
from shardtool.cli._passphrase import FILE_HELP
from shardtool.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("keygen")(producer(keygen))


def keygen(
    out: Path = typer.Option(..., "--out", help="Writes OUT.key (private, 0600) and OUT.pub."),
    no_passphrase: bool = typer.Option(False, "--no-passphrase", help="Store the private key unencrypted."),
    passphrase_file: Optional[Path] = typer.Option(None, "--passphrase-file", help=FILE_HELP),
    force: bool = typer.Option(False, "--force", help="Replace existing key files."),
    algorithm: str = typer.Option("ed25519", "--algorithm",
                                  help="ed25519 (shardtool's manifest), ml-dsa-44 | ml-dsa-65 | ml-dsa-87 (the "
                                       "manifest, post-quantum, where cryptography has ML-DSA), or ecdsa-p256 | "
                                       "ecdsa-p384 | ecdsa-p521 (`shardtool export-oms`: OpenSSF Model Signing)."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON document on stdout."),
) -> None:
    """Generate a publisher key pair (Ed25519 by default) and print its key ID.

    The private key is encrypted (scrypt, PKCS#8) under a passphrase of at least 12 characters.

    The passphrase: --passphrase-file, else SHARDTOOL_PASSPHRASE, else asked twice on the terminal."""
    from shardtool import keys
    from shardtool.cli._passphrase import get_passphrase

    if not out.name or out.name in (".", ".."):
        raise UsageError("--out must name a file (NAME gives NAME.key and NAME.pub)", path=str(out))
    if algorithm not in keys.ALGORITHMS and algorithm not in keys.CURVES:
        raise UsageError(f"--algorithm must be one of {', '.join([*keys.ALGORITHMS, *keys.CURVES])}, got {algorithm!r}")
    if algorithm in keys.ALGORITHMS and algorithm != "ed25519" and not keys.mldsa_available():
        raise UsageError(f"--algorithm {algorithm}: this cryptography/OpenSSL has no ML-DSA", hint="use ed25519")
    passphrase = None if no_passphrase else get_passphrase(passphrase_file, new_key=True)
    key = keys.generate(algorithm) if algorithm in keys.ALGORITHMS else keys.generate_ec(algorithm)
    key_path, pub_path = keys.write_keypair(out, key, passphrase, force=force)
    if json_out:
        emit_json({"keyid": key.public.keyid, "private_key": str(key_path), "public_key": str(pub_path),
                   "encrypted": passphrase is not None, "algorithm": algorithm})
    else:
        say(f"wrote {key_path} (private{'' if passphrase else ', UNENCRYPTED'}) and {pub_path}")
        print(key.public.keyid)
