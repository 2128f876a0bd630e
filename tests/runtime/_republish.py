"""Publish a changed file properly: replace it, put its new size and BLAKE3 in the manifest, sign again. The
publisher really shipped these bytes, so what the runtime then refuses it refuses as malformed, not as tampered."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import blake3

from shardtool.keys import load_private_key
from shardtool.manifest import build_manifest, load_manifest, save_manifest


def republish(model: Path, rel: str, data: bytes, key: Path) -> None:
    """Replace `model/rel` with `data` and sign the manifest again with the private key file `key`."""
    (model / rel).write_bytes(data)
    current = load_manifest(model / "manifest.msgpack")
    entries = [replace(e, size=len(data), digest=blake3.blake3(data).digest()) if e.path == rel else e
               for e in current.entries]
    new = build_manifest(entries, model_id=current.head.model_id, version=current.head.version,
                         contract=current.head.contract)
    save_manifest(model / "manifest.msgpack", new.with_envelope(new.envelope.signed_by(load_private_key(key, None))))
