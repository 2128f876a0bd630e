"""The manifest file: a DSSE envelope over the signed head, plus the entry list it commits to.

File layout (canonical msgpack): {"format": FORMAT, "envelope": {...}, "entries": [bin, ...]}, each
entry a canonical msgpack map kept as raw bytes. Verification never parses an entry before the Merkle
root recomputed over those raw bytes matches the signed head: verify, then parse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import msgpack

from shardtool.errors import ExpiredError, ManifestFormatError, MerkleProofError, TrustSettingsError, VerificationError
from shardtool.keys import PublicKey
from shardtool.manifest import _canonical
from shardtool.manifest._envelope import PAYLOAD_TYPE, Envelope, verify_envelope
from shardtool.manifest._merkle import blake3_256, leaf_hashes, root_from_leaf_hashes
from shardtool.manifest._records import ENTRY_KEY_ORDER, MAX_ENTRIES, Entry, Head, check_model_id_form

FORMAT = "shardtool-manifest-v1"
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_ENTRY_BYTES = 2048
MAX_ENVELOPE_OBJECTS = 1 << 16  # the document map, its format, the envelope (payload, signatures), the entries list
CLOCK_SKEW = 300  # seconds a manifest's `created` may lie ahead of our clock
DAY = 86_400


def entry_bytes(entry: Entry) -> bytes:
    """Canonical encoding of one entry: the Merkle leaf data.

    `Entry.to_dict` yields its keys in canonical order and only None/int/str/bytes values, so plain
    packb is canonical here (tests/manifest pin this against `_canonical.encode`); this is the hot path.
    """
    return msgpack.packb(entry.to_dict(), use_bin_type=True)


def decode_entry(raw: bytes, index: int) -> Entry:
    """Strictly parse one entry; canonical form is checked by re-encoding the parsed Entry."""
    entry = Entry.from_dict(_canonical.decode_shallow(raw, max_size=MAX_ENTRY_BYTES, what=f"entry {index}"))
    if entry_bytes(entry) != raw:
        raise ManifestFormatError(f"entry {index} ({entry.path!r}) is not in canonical msgpack form")
    return entry


# The strict parser's caps, without its duplicate-key hook: see `decode_entries`.
_ENTRY_UNPACK = dict(raw=False, use_list=True, strict_map_key=True, max_str_len=_canonical.MAX_STR,
                     max_bin_len=MAX_ENTRY_BYTES, max_array_len=MAX_ENTRY_BYTES, max_map_len=_canonical.MAX_MAP,
                     max_ext_len=0)


def decode_entries(raw_entries: Sequence[bytes]) -> tuple[Entry, ...]:
    """`decode_entry` over a whole list, in about three quarters of its time (20,000 entries: 0.27 s -> 0.21 s,
    paid by every command that opens the manifest of a real model before its first byte of work).

    An entry whose six keys came in canonical order and whose re-encoding is its own bytes is canonical
    (shortest integers, str and bin where they belong), with each key once: a key twice would leave a map of
    fewer pairs than the bytes hold. So the duplicate-key hook of the strict parser is not needed to accept
    it. Anything else goes through `decode_entry`, which names the flaw exactly as before, and is refused.
    """
    pack = msgpack.Packer(use_bin_type=True).pack  # this call's own packer: a Packer is not thread-safe
    entries = []
    for index, raw in enumerate(raw_entries):
        try:
            fields = msgpack.unpackb(raw, **_ENTRY_UNPACK) if len(raw) <= MAX_ENTRY_BYTES else None
            accepted = type(fields) is dict and tuple(fields) == ENTRY_KEY_ORDER and pack(fields) == raw
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError,
                UnicodeDecodeError):
            accepted = False
        if not accepted:
            decode_entry(raw, index)  # raises, naming the flaw
            raise ManifestFormatError(f"entry {index} is not in canonical msgpack form")
        try:
            entries.append(Entry.from_dict(fields))
        except ManifestFormatError:
            decode_entry(raw, index)  # the strict parser's own message where it refuses first (a bytes key in a value)
            raise
    return tuple(entries)


def entries_root(raw_entries: Sequence[bytes]) -> bytes:
    return root_from_leaf_hashes(blake3_256, leaf_hashes(blake3_256, raw_entries))


def _path_key(entry: Entry) -> bytes:
    return entry.path.encode("utf-8")


def _check_order(entries: Sequence[Entry]) -> None:
    keys = [_path_key(e) for e in entries]  # encoded once each, not twice per comparison
    for i in range(1, len(keys)):
        if keys[i - 1] >= keys[i]:
            prev, cur = entries[i - 1], entries[i]
            if keys[i - 1] == keys[i]:
                raise ManifestFormatError(f"duplicate path {cur.path!r}")
            raise ManifestFormatError(f"entries are not sorted by path ({prev.path!r} before {cur.path!r})")


@dataclass(frozen=True)
class Manifest:
    """A decoded manifest. Until `verify_manifest` returned it, nothing in it is trusted."""

    envelope: Envelope
    head: Head
    entries: tuple[Entry, ...]

    def to_bytes(self) -> bytes:
        return _canonical.encode({"format": FORMAT, "envelope": self.envelope.to_dict(),
                                  "entries": [entry_bytes(e) for e in self.entries]})

    def with_envelope(self, envelope: Envelope) -> "Manifest":
        return Manifest(envelope, self.head, self.entries)


def build_manifest(entries: Iterable[Entry], *, model_id: str, version: int = 1, expires_in_days: int = 365,
                   contract: Mapping[str, int] | None = None, now: int | None = None) -> Manifest:
    """An unsigned manifest over `entries` (sorted here by path; duplicates are an error)."""
    ordered = tuple(sorted(entries, key=_path_key))
    _check_order(ordered)
    if len(ordered) > MAX_ENTRIES:
        raise ManifestFormatError(f"{len(ordered)} entries, at most {MAX_ENTRIES} allowed")
    if isinstance(expires_in_days, bool) or not isinstance(expires_in_days, int) or not 1 <= expires_in_days <= 36500:
        raise ManifestFormatError(f"expires_in_days must be an integer in [1, 36500], got {expires_in_days!r}")
    created = int(time.time()) if now is None else now
    head = Head(model_id=model_id, version=version, created=created, expires=created + expires_in_days * DAY,
                entry_count=len(ordered), merkle_root=entries_root([entry_bytes(e) for e in ordered]),
                contract=contract)
    envelope = Envelope(PAYLOAD_TYPE, _canonical.encode(head.to_dict()), ())
    return Manifest(envelope, head, ordered)


def _split_document(data: bytes) -> tuple[Envelope, list[bytes]]:
    """The envelope and the raw entry byte strings; nothing inside either is interpreted yet."""
    # Every object of a genuine manifest: the entries' byte strings and a bounded envelope (MAX_ENVELOPE_OBJECTS).
    doc = _canonical.decode(data, max_size=MAX_MANIFEST_BYTES, what="manifest",
                            max_objects=MAX_ENTRIES + MAX_ENVELOPE_OBJECTS)
    d = _canonical.take_fields(doc, ("format", "envelope", "entries"), "manifest")
    if d["format"] != FORMAT:
        raise ManifestFormatError(f"manifest format is {d['format']!r}, expected {FORMAT!r}")
    raw_entries = d["entries"]
    if not isinstance(raw_entries, list) or len(raw_entries) > MAX_ENTRIES:
        raise ManifestFormatError(f"manifest entries must be a list of at most {MAX_ENTRIES} items")
    for i, raw in enumerate(raw_entries):
        if not isinstance(raw, bytes) or len(raw) > MAX_ENTRY_BYTES:
            raise ManifestFormatError(f"entry {i} must be binary of at most {MAX_ENTRY_BYTES} bytes")
    return Envelope.from_dict(d["envelope"]), raw_entries


def _parse_head(payload: bytes) -> Head:
    return Head.from_dict(_canonical.decode(payload, max_size=64 * 1024, what="head"))


def _parse_entries(head: Head, raw_entries: list[bytes]) -> tuple[Entry, ...]:
    """Authenticate the raw entries against the head (count, then Merkle root), then parse them."""
    if len(raw_entries) != head.entry_count:
        raise MerkleProofError(f"manifest lists {len(raw_entries)} entries, the signed head says {head.entry_count}")
    root = entries_root(raw_entries)
    if root != head.merkle_root:
        raise MerkleProofError(f"entry list hashes to root {root.hex()}, the signed head says {head.merkle_root.hex()}")
    entries = decode_entries(raw_entries)
    _check_order(entries)
    return entries


def decode_manifest(data: bytes) -> Manifest:
    """Strictly decode a manifest WITHOUT checking signatures: for publishers (sign) and inspection only."""
    envelope, raw_entries = _split_document(data)
    if envelope.payload_type != PAYLOAD_TYPE:
        raise ManifestFormatError(f"payloadType is {envelope.payload_type!r}, expected {PAYLOAD_TYPE!r}")
    head = _parse_head(envelope.payload)
    return Manifest(envelope, head, _parse_entries(head, raw_entries))


@dataclass(frozen=True)
class VerifiedManifest:
    """A manifest whose signatures, threshold, entry list and freshness have been checked."""

    head: Head
    entries: tuple[Entry, ...]
    signers: tuple[PublicKey, ...]

    def by_path(self) -> Mapping[str, Entry]:
        """Path -> entry (read-only), built once: audit, the session and the provider all look entries up."""
        index = self.__dict__.get("_by_path")
        if index is None:
            index = MappingProxyType({e.path: e for e in self.entries})
            object.__setattr__(self, "_by_path", index)  # a derived cache on a frozen instance
        return index


def check_freshness(head: Head, now: int) -> None:
    """Freeze defence: refuse an expired manifest, and one created in the future beyond clock skew."""
    if head.expires <= now:
        raise ExpiredError(f"manifest version {head.version} expired at {_iso(head.expires)} (now {_iso(now)})",
                           hint="the publisher must re-sign a fresh manifest")
    if head.created > now + CLOCK_SKEW:
        raise ExpiredError(f"manifest claims to be created at {_iso(head.created)}, in the future (now {_iso(now)})")


def check_model_id(head: Head, expected: str | None) -> None:
    """A genuine manifest of another model by the same publisher is a substitution, not a pass. A pin
    that no manifest could carry is the operator's mistake (usage), not a verdict on the manifest."""
    if expected is not None:
        try:
            check_model_id_form(expected)
        except ManifestFormatError as e:
            raise TrustSettingsError(f"model ID pin: {e.message}") from None
    if expected is not None and head.model_id != expected:
        raise VerificationError(f"manifest is for model {head.model_id!r}, expected {expected!r}")


def _iso(t: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def verify_manifest(data: bytes, trusted: Sequence[PublicKey], threshold: int, *, now: int | None = None) -> VerifiedManifest:
    """Verify manifest bytes: signatures and threshold, payload type, head, entries vs root, freshness.

    Rollback is checked by the caller against its state (see `_state`), since it needs stored history.
    """
    envelope, raw_entries = _split_document(data)
    payload, signers = verify_envelope(envelope, trusted, threshold)
    head = _parse_head(payload)
    entries = _parse_entries(head, raw_entries)
    check_freshness(head, int(time.time()) if now is None else now)
    return VerifiedManifest(head, entries, signers)


def head_digest(head: Head) -> bytes:
    return blake3_256(_canonical.encode(head.to_dict()))


def describe_head(head: Head) -> dict[str, Any]:
    return {"model_id": head.model_id, "version": head.version, "created": _iso(head.created),
            "expires": _iso(head.expires), "entry_count": head.entry_count, "merkle_root": head.merkle_root.hex(),
            "hash_alg": head.hash_alg, "contract": dict(head.contract) if head.contract else None}
