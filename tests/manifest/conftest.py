"""Manifest fixtures: entries, and a forger that writes manifest bytes field by field.

The forger bypasses `build_manifest` on purpose: it is how the tests produce documents our own builder
refuses to make (unsorted entries, bad paths, foreign payload types) yet with a correct root and real
signatures, so each test reaches exactly the check it is aimed at.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest

from shardtool.manifest import _canonical
from shardtool.manifest._document import DAY, FORMAT, entries_root, entry_bytes
from shardtool.manifest._envelope import PAYLOAD_TYPE, pae
from shardtool.manifest._merkle import blake3_256
from shardtool.manifest._records import HEAD_TYPE, Entry

NOW = 1_750_000_000  # a fixed clock for every test: 2025-06-15


@pytest.fixture(scope="session")
def now() -> int:
    return NOW


def _entry(path: str, kind: str = "other", size: int = 0, digest: bytes | None = None,
           layer: int | None = None, expert: int | None = None) -> Entry:
    return Entry(path=path, kind=kind, size=size, digest=digest if digest is not None else blake3_256(path.encode()),
                 layer=layer, expert=expert)


@pytest.fixture(scope="session")
def make_entry() -> Callable[..., Entry]:
    """make_entry(path, kind="other", size=0, digest=BLAKE3(path), layer=None, expert=None)."""
    return _entry


def _raw_entry(**fields: Any) -> bytes:
    """Canonical bytes of an entry map; fields override a valid `other` entry (value ... deletes a field)."""
    d: dict[str, Any] = {"path": "x.bin", "kind": "other", "layer": None, "expert": None, "size": 0,
                         "digest": b"\x11" * 32}
    d.update(fields)
    return _canonical.encode({k: v for k, v in d.items() if v is not ...})


@pytest.fixture(scope="session")
def raw_entry() -> Callable[..., bytes]:
    return _raw_entry


def _head_dict(raw_entries: Sequence[bytes], **overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": HEAD_TYPE, "format_version": 1, "model_id": "acme/moe-tiny", "version": 1,
                         "created": NOW, "expires": NOW + 30 * DAY, "entry_count": len(raw_entries),
                         "merkle_root": entries_root(raw_entries), "hash_alg": "blake3", "contract": None}
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not ...}


def _forge(entries: Sequence[Entry | bytes] = (), *, signers: Sequence = (), payload_type: str = PAYLOAD_TYPE,
           payload: bytes | None = None, head: dict[str, Any] | None = None, signatures: Sequence[dict] | None = None,
           **head_overrides: Any) -> bytes:
    """Manifest bytes over `entries` (Entry or raw bytes, kept in the given order), signed by `signers`.

    `head_overrides` change head fields (value ... removes one); `head` replaces the head map outright,
    `payload` the payload bytes; `signatures` appends raw {keyid, sig} maps after the real ones.
    """
    raw = [e if isinstance(e, bytes) else entry_bytes(e) for e in entries]
    if payload is None:
        payload = _canonical.encode(head if head is not None else _head_dict(raw, **head_overrides))
    sigs = [{"keyid": k.public.keyid, "sig": k.sign(pae(payload_type, payload))} for k in signers]
    sigs += list(signatures or ())
    return _canonical.encode({"format": FORMAT, "envelope": {"payloadType": payload_type, "payload": payload,
                                                             "signatures": sigs}, "entries": raw})


@pytest.fixture(scope="session")
def forge() -> Callable[..., bytes]:
    return _forge


@pytest.fixture(scope="session")
def head_dict() -> Callable[..., dict]:
    return _head_dict
