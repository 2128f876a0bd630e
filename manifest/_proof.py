"""Self-contained proofs for one shard: the signed envelope, the entry, and its Merkle inclusion path.

A node that holds (or just received) one expert checks it against the publisher's keys without the full
entry list: signatures → head → inclusion of the entry bytes under the signed root (RFC 9162 §2.1.3)
→ freshness → then the file's size and BLAKE3.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from shardtool.errors import ManifestFormatError
from shardtool.keys import PublicKey
from shardtool.manifest import _canonical
from shardtool.manifest._document import (
    MAX_ENTRY_BYTES,
    Manifest,
    _parse_head,
    check_freshness,
    decode_entry,
    entry_bytes,
)
from shardtool.manifest._envelope import Envelope, verify_envelope
from shardtool.manifest._merkle import blake3_256, inclusion_proof, leaf_hash, verify_inclusion
from shardtool.manifest._records import MAX_ENTRIES, Entry, Head

PROOF_FORMAT = "shardtool-proof-v1"
MAX_PROOF_BYTES = 1024 * 1024
MAX_PATH_LEN = 64  # a tree of 2^64 leaves needs no longer path


def build_proof(manifest: Manifest, path: str) -> bytes:
    """The proof document for the entry at `path` of `manifest` (signed or not)."""
    paths = [e.path for e in manifest.entries]
    try:
        index = paths.index(path)
    except ValueError:
        raise ManifestFormatError(f"the manifest lists no entry {path!r}") from None
    leaves = [leaf_hash(blake3_256, entry_bytes(e)) for e in manifest.entries]
    return _canonical.encode({
        "format": PROOF_FORMAT,
        "envelope": manifest.envelope.to_dict(),
        "index": index,
        "entry": entry_bytes(manifest.entries[index]),
        "path": inclusion_proof(blake3_256, leaves, index),
    })


@dataclass(frozen=True)
class ProvenEntry:
    head: Head
    entry: Entry
    index: int
    signers: tuple[PublicKey, ...]


def verify_proof(data: bytes, trusted: Sequence[PublicKey], threshold: int, *, now: int | None = None) -> ProvenEntry:
    """Verify a proof document; the returned entry is authenticated by `threshold` trusted signatures."""
    doc = _canonical.decode(data, max_size=MAX_PROOF_BYTES, what="proof")
    d = _canonical.take_fields(doc, ("format", "envelope", "index", "entry", "path"), "proof")
    if d["format"] != PROOF_FORMAT:
        raise ManifestFormatError(f"proof format is {d['format']!r}, expected {PROOF_FORMAT!r}")
    envelope = Envelope.from_dict(d["envelope"])
    index, raw_entry, path = d["index"], d["entry"], d["path"]
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_ENTRIES:
        raise ManifestFormatError(f"proof index must be an integer in [0, {MAX_ENTRIES}), got {index!r}")
    if not isinstance(raw_entry, bytes) or len(raw_entry) > MAX_ENTRY_BYTES:
        raise ManifestFormatError(f"proof entry must be binary of at most {MAX_ENTRY_BYTES} bytes")
    if not isinstance(path, list) or len(path) > MAX_PATH_LEN or not all(isinstance(p, bytes) for p in path):
        raise ManifestFormatError(f"proof path must be a list of at most {MAX_PATH_LEN} binary hashes")
    payload, signers = verify_envelope(envelope, trusted, threshold)
    head = _parse_head(payload)
    # The tree size comes from the signed head, never from the proof: a path alone does not fix it.
    verify_inclusion(blake3_256, index, head.entry_count, leaf_hash(blake3_256, raw_entry), path, head.merkle_root)
    entry = decode_entry(raw_entry, index)
    check_freshness(head, int(time.time()) if now is None else now)
    return ProvenEntry(head, entry, index, signers)
