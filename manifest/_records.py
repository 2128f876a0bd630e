"""Manifest records: frozen, validated dataclasses with one canonical dict form each.

`from_dict` pops the keys it knows and rejects whatever is left: a field we do not understand is
never silently ignored in signed data.
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from shardtool.errors import ManifestFormatError
from shardtool.manifest._canonical import take_fields
from shardtool.manifest._paths import check_relpath

FORMAT_VERSION = 1
HEAD_TYPE = "shardtool/manifest-head"
HASH_ALG = "blake3"
DIGEST_SIZE = 32
KINDS = ("expert", "trunk", "config", "tokenizer", "other")

MAX_LAYER = 65_535
MAX_EXPERT = 1_048_575
MAX_FILE_SIZE = 2**50  # 1 PiB: far beyond any shard, well inside int64
MAX_ENTRIES = 2_000_000
MAX_VERSION = 2**63 - 1
MAX_TIME = 2**40  # seconds since the epoch; year ~36800
MAX_CONTRACT_KEYS = 64
MAX_CONTRACT_VALUE = 2**63 - 1
# How a refused value is quoted in a message: a signed entry may hold a list nested 1,000 deep, which repr()
# cannot print (RecursionError); this shows 3 levels and 120 characters.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 120, 120
_shown = _SHOWN.repr
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+:@-]{0,255}")
_CONTRACT_KEY = re.compile(r"[a-z0-9_]{1,64}")


def _int(d: dict, key: str, lo: int, hi: int, what: str) -> int:
    value = d.pop(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestFormatError(f"{what}.{key} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ManifestFormatError(f"{what}.{key} must be in [{lo}, {hi}], got {value}")
    return value


ENTRY_KEY_ORDER = ("digest", "expert", "kind", "layer", "path", "size")  # canonical: bytewise order
_ENTRY_KEYS = set(ENTRY_KEY_ORDER)


@dataclass(frozen=True, order=True)
class Entry:
    """One file of the model directory. Ordered by path, which is also the Merkle leaf order."""

    path: str
    kind: str
    size: int
    digest: bytes = field(repr=False)
    layer: int | None = None
    expert: int | None = None

    def __post_init__(self) -> None:
        check_relpath(self.path)
        if self.kind not in KINDS:
            raise ManifestFormatError(f"entry {self.path!r}: kind must be one of {', '.join(KINDS)}, got {_shown(self.kind)}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 0 <= self.size <= MAX_FILE_SIZE:
            raise ManifestFormatError(f"entry {self.path!r}: size must be an integer in [0, 2^50], got {_shown(self.size)}")
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_SIZE:
            raise ManifestFormatError(f"entry {self.path!r}: digest must be {DIGEST_SIZE} bytes")
        for name, value, hi in (("layer", self.layer, MAX_LAYER), ("expert", self.expert, MAX_EXPERT)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi):
                raise ManifestFormatError(f"entry {self.path!r}: {name} must be an integer in [0, {hi}], got {_shown(value)}")
        if self.kind == "expert" and (self.layer is None or self.expert is None):
            raise ManifestFormatError(f"entry {self.path!r}: an expert entry needs both layer and expert")
        if self.kind != "expert" and self.expert is not None:
            raise ManifestFormatError(f"entry {self.path!r}: only expert entries carry an expert index")
        if self.kind not in ("expert", "trunk") and self.layer is not None:
            raise ManifestFormatError(f"entry {self.path!r}: only expert and trunk entries carry a layer")

    @property
    def digest_hex(self) -> str:
        return self.digest.hex()

    def describe(self) -> str:
        """`path (expert L3/E17)` style label for messages."""
        if self.kind == "expert":
            return f"{self.path} (expert, layer {self.layer}, expert {self.expert})"
        if self.layer is not None:
            return f"{self.path} ({self.kind}, layer {self.layer})"
        return f"{self.path} ({self.kind})"

    def to_dict(self) -> dict[str, Any]:
        # Keys in canonical (bytewise) order, so `entry_bytes` can pack this without sorting.
        return {"digest": self.digest, "expert": self.expert, "kind": self.kind, "layer": self.layer,
                "path": self.path, "size": self.size}

    @classmethod
    def from_dict(cls, raw: Any) -> "Entry":
        # Hot path (one call per entry, 100k+ per manifest): the exact key set is checked here and every
        # value's type and range by __post_init__, which also guards entries built in code.
        if type(raw) is not dict or raw.keys() != _ENTRY_KEYS:
            take_fields(raw, tuple(_ENTRY_KEYS), "entry")  # raises, naming the missing or unknown fields
        if not isinstance(raw["kind"], str):
            raise ManifestFormatError(f"entry {_shown(raw['path'])}: kind must be a string")
        return cls(**raw)


def check_model_id_form(model_id: Any) -> None:
    if not isinstance(model_id, str) or not _MODEL_ID.fullmatch(model_id):
        raise ManifestFormatError(
            f"model_id must be 1-256 characters of [A-Za-z0-9._/+:@-] starting alphanumeric, got {_shown(model_id)}")


def check_contract(contract: Any) -> Mapping[str, int] | None:
    """The resource contract: a flat map of `[a-z0-9_]{1,64}` -> non-negative int, at most 64 keys."""
    if contract is None:
        return None
    if not isinstance(contract, Mapping):
        raise ManifestFormatError(f"contract must be a map, got {type(contract).__name__}")
    if len(contract) > MAX_CONTRACT_KEYS:
        raise ManifestFormatError(f"contract has {len(contract)} keys, at most {MAX_CONTRACT_KEYS} allowed")
    for key, value in contract.items():
        if not isinstance(key, str) or not _CONTRACT_KEY.fullmatch(key):
            raise ManifestFormatError(f"contract key {_shown(key)} must match [a-z0-9_]{{1,64}}")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CONTRACT_VALUE:
            raise ManifestFormatError(f"contract value {key}={_shown(value)} must be a non-negative 63-bit integer")
    return MappingProxyType(dict(sorted(contract.items())))


@dataclass(frozen=True)
class Head:
    """The signed part, like RFC 9162's signed tree head: it commits to the entries through `merkle_root`."""

    model_id: str
    version: int
    created: int
    expires: int
    entry_count: int
    merkle_root: bytes = field(repr=False)
    contract: Mapping[str, int] | None = field(default=None, hash=False)  # a read-only mapping: unhashable
    format_version: int = FORMAT_VERSION
    hash_alg: str = HASH_ALG

    def __post_init__(self) -> None:
        check_model_id_form(self.model_id)
        if type(self.format_version) is not int or self.format_version != FORMAT_VERSION:  # True == 1
            raise ManifestFormatError(f"format_version {_shown(self.format_version)} is not supported (this tool reads {FORMAT_VERSION})")
        if self.hash_alg != HASH_ALG:
            raise ManifestFormatError(f"hash_alg {_shown(self.hash_alg)} is not supported (expected {HASH_ALG!r})")
        for name, value, lo, hi in (("version", self.version, 1, MAX_VERSION), ("created", self.created, 0, MAX_TIME),
                                    ("expires", self.expires, 0, MAX_TIME), ("entry_count", self.entry_count, 0, MAX_ENTRIES)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ManifestFormatError(f"head.{name} must be an integer in [{lo}, {hi}], got {_shown(value)}")
        if self.expires <= self.created:
            raise ManifestFormatError(f"head.expires ({self.expires}) must be later than head.created ({self.created})")
        if not isinstance(self.merkle_root, bytes) or len(self.merkle_root) != DIGEST_SIZE:
            raise ManifestFormatError(f"head.merkle_root must be {DIGEST_SIZE} bytes")
        object.__setattr__(self, "contract", check_contract(self.contract))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": HEAD_TYPE,
            "format_version": self.format_version,
            "model_id": self.model_id,
            "version": self.version,
            "created": self.created,
            "expires": self.expires,
            "entry_count": self.entry_count,
            "merkle_root": self.merkle_root,
            "hash_alg": self.hash_alg,
            "contract": dict(self.contract) if self.contract is not None else None,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> "Head":
        d = take_fields(raw, ("type", "format_version", "model_id", "version", "created", "expires", "entry_count",
                        "merkle_root", "hash_alg", "contract"), "head")
        if d.pop("type") != HEAD_TYPE:
            raise ManifestFormatError(f"head.type must be {HEAD_TYPE!r}")
        format_version = _int(d, "format_version", 0, 2**31, "head")
        if format_version != FORMAT_VERSION:
            raise ManifestFormatError(f"head.format_version {format_version} is not supported (this tool reads {FORMAT_VERSION})")
        root = d.pop("merkle_root")
        if not isinstance(root, bytes):
            raise ManifestFormatError("head.merkle_root must be binary")
        return cls(
            model_id=d.pop("model_id"),
            version=_int(d, "version", 1, MAX_VERSION, "head"),
            created=_int(d, "created", 0, MAX_TIME, "head"),
            expires=_int(d, "expires", 0, MAX_TIME, "head"),
            entry_count=_int(d, "entry_count", 0, MAX_ENTRIES, "head"),
            merkle_root=root,
            contract=d.pop("contract"),
            format_version=format_version,
            hash_alg=d.pop("hash_alg"),
        )
