"""Entry, Head and contract validation: one table of named bad inputs per record, exact error class."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from shardtool.errors import ManifestFormatError
from shardtool.manifest import _canonical
from shardtool.manifest._records import (
    FORMAT_VERSION,
    HEAD_TYPE,
    MAX_CONTRACT_KEYS,
    MAX_CONTRACT_VALUE,
    MAX_ENTRIES,
    MAX_EXPERT,
    MAX_FILE_SIZE,
    MAX_LAYER,
    MAX_TIME,
    MAX_VERSION,
    Entry,
    Head,
    check_contract,
)

D = b"\xab" * 32
GOOD_ENTRY = dict(path="experts/l0/e0.safetensors", kind="expert", size=10, digest=D, layer=0, expert=0)

GOOD_ENTRIES = {
    "expert": {},
    "expert-max-indices": dict(layer=MAX_LAYER, expert=MAX_EXPERT),
    "trunk-with-layer": dict(kind="trunk", expert=None, layer=3),
    "trunk-without-layer": dict(kind="trunk", expert=None, layer=None),
    "config": dict(kind="config", layer=None, expert=None),
    "tokenizer": dict(kind="tokenizer", layer=None, expert=None),
    "other": dict(kind="other", layer=None, expert=None),
    "size-zero": dict(size=0),
    "size-max": dict(size=MAX_FILE_SIZE),
}


@pytest.mark.parametrize("changes", GOOD_ENTRIES.values(), ids=GOOD_ENTRIES.keys())
def test_valid_entries_round_trip(changes):
    entry = Entry(**{**GOOD_ENTRY, **changes})
    assert Entry.from_dict(entry.to_dict()) == entry
    assert Entry.from_dict(_canonical.decode(_canonical.encode(entry.to_dict()), max_size=4096)) == entry


BAD_ENTRIES = {
    "kind-unknown": dict(kind="weights"),
    "kind-empty": dict(kind=""),
    "kind-uppercase": dict(kind="Expert"),
    "kind-none": dict(kind=None),
    "kind-int": dict(kind=1),
    "expert-without-layer": dict(layer=None),
    "expert-without-index": dict(expert=None),
    "expert-without-both": dict(layer=None, expert=None),
    "trunk-with-expert": dict(kind="trunk", layer=0, expert=0),
    "config-with-layer": dict(kind="config", layer=0, expert=None),
    "config-with-expert": dict(kind="config", layer=None, expert=0),
    "tokenizer-with-layer": dict(kind="tokenizer", layer=1, expert=None),
    "other-with-layer": dict(kind="other", layer=1, expert=None),
    "other-with-expert": dict(kind="other", layer=None, expert=1),
    "size-negative": dict(size=-1),
    "size-too-big": dict(size=MAX_FILE_SIZE + 1),
    "size-bool": dict(size=True),
    "size-float": dict(size=10.0),
    "size-str": dict(size="10"),
    "size-none": dict(size=None),
    "digest-short": dict(digest=D[:31]),
    "digest-long": dict(digest=D + b"\x00"),
    "digest-empty": dict(digest=b""),
    "digest-hex-str": dict(digest=D.hex()),
    "digest-bytearray": dict(digest=bytearray(D)),
    "digest-none": dict(digest=None),
    "layer-negative": dict(layer=-1),
    "layer-too-big": dict(layer=MAX_LAYER + 1),
    "layer-bool": dict(layer=True),
    "layer-false": dict(layer=False),
    "layer-str": dict(layer="0"),
    "layer-float": dict(layer=0.0),
    "expert-negative": dict(expert=-1),
    "expert-too-big": dict(expert=MAX_EXPERT + 1),
    "expert-bool": dict(expert=False),
    "expert-float": dict(expert=1.0),
    "path-absolute": dict(path="/x"),
    "path-bytes": dict(path=b"x"),
}


@pytest.mark.parametrize("changes", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_entry_constructor_refuses(changes, raises_exactly):
    with raises_exactly(ManifestFormatError):
        Entry(**{**GOOD_ENTRY, **changes})


def _good_dict():
    return Entry(**GOOD_ENTRY).to_dict()


BAD_ENTRY_DICTS = {
    "not-a-map": lambda d: list(d.items()),
    "missing-digest": lambda d: {k: v for k, v in d.items() if k != "digest"},
    "missing-layer": lambda d: {k: v for k, v in d.items() if k != "layer"},
    "missing-expert-even-if-null": lambda d: {**{k: v for k, v in d.items() if k != "expert"}, "kind": "other",
                                              "layer": None},
    "unknown-field": lambda d: {**d, "mode": 0o644},
    "kind-bytes": lambda d: {**d, "kind": b"expert"},
    "digest-str": lambda d: {**d, "digest": D.hex()},
    "digest-list": lambda d: {**d, "digest": list(D)},
    "size-bool": lambda d: {**d, "size": True},
    "size-str": lambda d: {**d, "size": "10"},
    "layer-bool": lambda d: {**d, "layer": False},
    "expert-bool": lambda d: {**d, "expert": True},
    "layer-list": lambda d: {**d, "layer": [0]},
    "path-bytes": lambda d: {**d, "path": b"experts/l0/e0.safetensors"},
    "path-dotdot": lambda d: {**d, "path": "../e0.safetensors"},
}


@pytest.mark.parametrize("mutate", BAD_ENTRY_DICTS.values(), ids=BAD_ENTRY_DICTS.keys())
def test_entry_from_dict_refuses(mutate, raises_exactly):
    with raises_exactly(ManifestFormatError):
        Entry.from_dict(mutate(_good_dict()))


def test_entry_is_frozen_and_describes_itself():
    entry = Entry(**GOOD_ENTRY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.size = 11  # type: ignore[misc]
    assert entry.describe() == "experts/l0/e0.safetensors (expert, layer 0, expert 0)"
    assert entry.digest_hex == D.hex()


# --- contract ----------------------------------------------------------------------------------------------

GOOD_CONTRACTS = {
    "none": (None, None),
    "empty": ({}, {}),
    "sorted-on-the-way-in": ({"z": 1, "a_1": 0}, {"a_1": 0, "z": 1}),
    "max-value": ({"bytes": MAX_CONTRACT_VALUE}, {"bytes": MAX_CONTRACT_VALUE}),
    "max-keys": ({f"k{i}": i for i in range(MAX_CONTRACT_KEYS)}, {f"k{i}": i for i in range(MAX_CONTRACT_KEYS)}),
    "longest-key": ({"a" * 64: 1}, {"a" * 64: 1}),
}


@pytest.mark.parametrize("contract,expected", GOOD_CONTRACTS.values(), ids=GOOD_CONTRACTS.keys())
def test_contract_accepted(contract, expected):
    out = check_contract(contract)
    if expected is None:
        assert out is None
    else:
        assert dict(out) == expected and list(out) == sorted(expected)
        with pytest.raises(TypeError):
            out["new"] = 1  # type: ignore[index]


BAD_CONTRACTS = {
    "list": [("a", 1)],
    "str": "a=1",
    "too-many-keys": {f"k{i}": 0 for i in range(MAX_CONTRACT_KEYS + 1)},
    "key-uppercase": {"A": 1},
    "key-empty": {"": 1},
    "key-dash": {"a-b": 1},
    "key-too-long": {"a" * 65: 1},
    "key-int": {1: 1},
    "key-non-ascii": {"\u00e9": 1},
    "value-negative": {"a": -1},
    "value-too-big": {"a": MAX_CONTRACT_VALUE + 1},
    "value-bool": {"a": True},
    "value-float": {"a": 1.0},
    "value-str": {"a": "1"},
    "value-none": {"a": None},
    "value-nested": {"a": {"b": 1}},
}


@pytest.mark.parametrize("contract", BAD_CONTRACTS.values(), ids=BAD_CONTRACTS.keys())
def test_contract_refused(contract, raises_exactly):
    with raises_exactly(ManifestFormatError):
        check_contract(contract)


# --- head --------------------------------------------------------------------------------------------------

R = b"\xcd" * 32
GOOD_HEAD = dict(model_id="acme/moe-8x1b", version=3, created=1_000, expires=2_000, entry_count=5, merkle_root=R)

GOOD_HEADS = {
    "plain": {},
    "with-contract": dict(contract={"ram_bytes": 10, "experts": 8}),
    "model-id-punctuation": dict(model_id="a0._/+:@-Z"),
    "model-id-256": dict(model_id="a" * 256),
    "version-max": dict(version=MAX_VERSION),
    "created-zero": dict(created=0, expires=1),
    "expires-max": dict(expires=MAX_TIME),
    "zero-entries": dict(entry_count=0),
    "max-entries": dict(entry_count=MAX_ENTRIES),
}


@pytest.mark.parametrize("changes", GOOD_HEADS.values(), ids=GOOD_HEADS.keys())
def test_valid_heads_round_trip(changes):
    head = Head(**{**GOOD_HEAD, **changes})
    wire = _canonical.encode(head.to_dict())
    again = Head.from_dict(_canonical.decode(wire, max_size=65536))
    assert again == head
    assert _canonical.encode(again.to_dict()) == wire
    assert head.to_dict()["type"] == HEAD_TYPE and head.format_version == FORMAT_VERSION


BAD_HEADS = {
    "model-id-empty": dict(model_id=""),
    "model-id-leading-dash": dict(model_id="-x"),
    "model-id-leading-dot": dict(model_id=".x"),
    "model-id-space": dict(model_id="a b"),
    "model-id-newline": dict(model_id="a\n"),
    "model-id-non-ascii": dict(model_id="mod\u00e8le"),
    "model-id-257": dict(model_id="a" * 257),
    "model-id-bytes": dict(model_id=b"acme"),
    "model-id-none": dict(model_id=None),
    "version-zero": dict(version=0),
    "version-negative": dict(version=-1),
    "version-too-big": dict(version=MAX_VERSION + 1),
    "version-bool": dict(version=True),
    "version-float": dict(version=3.0),
    "created-negative": dict(created=-1),
    "created-bool": dict(created=False, expires=2),
    "expires-too-big": dict(expires=MAX_TIME + 1),
    "expires-equals-created": dict(expires=1_000),
    "expires-before-created": dict(expires=999),
    "entry-count-negative": dict(entry_count=-1),
    "entry-count-too-big": dict(entry_count=MAX_ENTRIES + 1),
    "entry-count-bool": dict(entry_count=True),
    "root-short": dict(merkle_root=R[:31]),
    "root-hex-str": dict(merkle_root=R.hex()),
    "root-bytearray": dict(merkle_root=bytearray(R)),
    "format-version-2": dict(format_version=2),
    "format-version-0": dict(format_version=0),
    "format-version-bool": dict(format_version=True),
    "hash-alg-sha256": dict(hash_alg="sha256"),
    "hash-alg-uppercase": dict(hash_alg="BLAKE3"),
    "contract-bad": dict(contract={"A": 1}),
}


@pytest.mark.parametrize("changes", BAD_HEADS.values(), ids=BAD_HEADS.keys())
def test_head_constructor_refuses(changes, raises_exactly):
    with raises_exactly(ManifestFormatError):
        Head(**{**GOOD_HEAD, **changes})


def _head_dict():
    return Head(**GOOD_HEAD).to_dict()


BAD_HEAD_DICTS = {
    "not-a-map": lambda d: [d],
    "missing-type": lambda d: {k: v for k, v in d.items() if k != "type"},
    "missing-contract-even-if-null": lambda d: {k: v for k, v in d.items() if k != "contract"},
    "missing-root": lambda d: {k: v for k, v in d.items() if k != "merkle_root"},
    "unknown-field": lambda d: {**d, "note": "hi"},
    "type-wrong": lambda d: {**d, "type": "in-toto/statement"},
    "type-bytes": lambda d: {**d, "type": HEAD_TYPE.encode()},
    "format-version-2": lambda d: {**d, "format_version": 2},
    "format-version-bool": lambda d: {**d, "format_version": True},
    "format-version-str": lambda d: {**d, "format_version": "1"},
    "version-bool": lambda d: {**d, "version": True},
    "version-str": lambda d: {**d, "version": "3"},
    "created-none": lambda d: {**d, "created": None},
    "entry-count-bool": lambda d: {**d, "entry_count": False},
    "root-str": lambda d: {**d, "merkle_root": R.hex()},
    "root-list": lambda d: {**d, "merkle_root": list(R)},
    "hash-alg-sha256": lambda d: {**d, "hash_alg": "sha256"},
    "hash-alg-bytes": lambda d: {**d, "hash_alg": b"blake3"},
    "model-id-int": lambda d: {**d, "model_id": 7},
    "contract-list": lambda d: {**d, "contract": [1]},
    "contract-bool-value": lambda d: {**d, "contract": {"a": True}},
}


@pytest.mark.parametrize("mutate", BAD_HEAD_DICTS.values(), ids=BAD_HEAD_DICTS.keys())
def test_head_from_dict_refuses(mutate, raises_exactly):
    with raises_exactly(ManifestFormatError):
        Head.from_dict(mutate(_head_dict()))


def test_head_contract_is_read_only_and_sorted():
    head = Head(**{**GOOD_HEAD, "contract": {"z": 1, "a": 2}})
    assert isinstance(head.contract, MappingProxyType)
    assert list(head.contract) == ["a", "z"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        head.version = 4  # type: ignore[misc]
