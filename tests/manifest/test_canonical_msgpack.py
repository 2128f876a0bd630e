"""Canonical msgpack: every value has one encoding, and the decoder accepts that encoding only."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.errors import ManifestFormatError
from shardtool.manifest._canonical import MAX_MAP, MAX_STR, decode, encode, take_fields

CAP = 1 << 20


def _str32(n: int) -> bytes:
    return b"\xdb" + struct.pack(">I", n) + b"a" * n


ROUND_TRIPS = {
    "none": (None, b"\xc0"),
    "true": (True, b"\xc3"),
    "false": (False, b"\xc2"),
    "zero": (0, b"\x00"),
    "fixint-max": (127, b"\x7f"),
    "uint8": (128, b"\xcc\x80"),
    "uint16": (256, b"\xcd\x01\x00"),
    "uint32": (65536, b"\xce\x00\x01\x00\x00"),
    "uint64-max": (2**64 - 1, b"\xcf" + b"\xff" * 8),
    "negative-fixint": (-32, b"\xe0"),
    "int8": (-33, b"\xd0\xdf"),
    "int64-min": (-(2**63), b"\xd3\x80" + b"\x00" * 7),
    "empty-str": ("", b"\xa0"),
    "fixstr": ("ab", b"\xa2ab"),
    "str8": ("a" * 32, b"\xd9\x20" + b"a" * 32),
    "utf8-str": ("\u00e9", b"\xa2\xc3\xa9"),
    "bin": (b"\x00\xff", b"\xc4\x02\x00\xff"),
    "empty-bin": (b"", b"\xc4\x00"),
    "list": ([1, "a"], b"\x92\x01\xa1a"),
    "empty-map": ({}, b"\x80"),
    "sorted-map": ({"b": 1, "a": 2}, b"\x82\xa1a\x02\xa1b\x01"),
    # Keys sort by UTF-8 bytes: "Z" (0x5a) < "a" (0x61) < "é" (0xc3 0xa9); also shorter prefix first.
    "byte-order-keys": ({"\u00e9": 0, "a": 0, "Z": 0, "ab": 0}, b"\x84\xa1Z\x00\xa1a\x00\xa2ab\x00\xa2\xc3\xa9\x00"),
    "nested": ({"m": {"y": [None], "x": b""}}, b"\x81\xa1m\x82\xa1x\xc4\x00\xa1y\x91\xc0"),
}


@pytest.mark.parametrize("value,wire", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_round_trip_exact_bytes(value, wire):
    assert encode(value) == wire
    assert decode(wire, max_size=CAP) == value
    assert encode(decode(wire, max_size=CAP)) == wire


def test_tuples_encode_as_lists():
    assert encode((1, 2)) == encode([1, 2])


NOT_CANONICAL = {
    "unsorted-keys": b"\x82\xa1b\x01\xa1a\x02",
    "unsorted-nested-keys": b"\x81\xa1m\x82\xa1y\x00\xa1x\x00",
    "duplicate-keys": b"\x82\xa1a\x01\xa1a\x01",
    "duplicate-keys-different-values": b"\x82\xa1a\x01\xa1a\x02",
    "uint8-for-fixint": b"\xcc\x05",
    "uint16-for-uint8": b"\xcd\x00\xff",
    "uint64-for-fixint": b"\xcf" + b"\x00" * 7 + b"\x05",
    "int8-for-positive": b"\xd0\x05",
    "int16-for-negative-fixint": b"\xd1\xff\xff",
    "int64-for-positive-fixint": b"\xd3" + b"\x00" * 7 + b"\x01",
    "str8-for-fixstr": b"\xd9\x01a",
    "str16-for-fixstr": b"\xda\x00\x01a",
    "bin16-for-bin8": b"\xc5\x00\x01a",
    "array16-for-fixarray": b"\xdc\x00\x01\x00",
    "map16-for-fixmap": b"\xde\x00\x01\xa1a\x00",
    "float32": b"\xca" + struct.pack(">f", 1.0),
    "float64": b"\xcb" + struct.pack(">d", 1.0),
    "float-in-map": b"\x81\xa1a\xcb" + struct.pack(">d", 0.5),
    "float-in-list": b"\x91\xca" + struct.pack(">f", 2.0),
    "fixext1": b"\xd4\x01\x00",
    "ext8-empty": b"\xc7\x00\x05",
    "timestamp-ext": b"\xd6\xff\x00\x00\x00\x00",
    "int-key": b"\x81\x01\x02",
    "nil-key": b"\x81\xc0\x02",
    "bin-key": b"\x81\xc4\x01a\x02",
    "list-key": b"\x81\x90\x00",
    "bool-key": b"\x81\xc3\x00",
    "trailing-bytes": b"\x01\x02",
    "trailing-nul": b"\x80\x00",
    "truncated-array": b"\x92\x01",
    "truncated-str": b"\xa3ab",
    "truncated-uint32": b"\xce\x00\x01",
    "truncated-map": b"\x81\xa1a",
    "empty-input": b"",
    "reserved-0xc1": b"\xc1",
    "invalid-utf8": b"\xa1\xff",
    "overlong-utf8": b"\xa2\xc0\xaf",
    "surrogate-utf8": b"\xa3\xed\xb2\x80",
    "str-longer-than-cap": _str32(MAX_STR + 1),
    "map-larger-than-cap": b"\xde" + struct.pack(">H", MAX_MAP + 1)
                           + b"".join(msgpack.packb(f"k{i:04}") + b"\x00" for i in range(MAX_MAP + 1)),
    "nested-17-deep": b"\x91" * 17 + b"\x00",
    "nested-3000-deep": b"\x91" * 3000 + b"\x00",
    "array-claims-huge-length": b"\xdd\xff\xff\xff\xff",
}


@pytest.mark.parametrize("wire", NOT_CANONICAL.values(), ids=NOT_CANONICAL.keys())
def test_non_canonical_input_is_refused(wire, raises_exactly):
    with raises_exactly(ManifestFormatError):
        decode(wire, max_size=CAP)


def test_nesting_limit_is_sixteen_levels(raises_exactly):
    assert decode(b"\x91" * 16 + b"\x00", max_size=CAP) is not None
    with raises_exactly(ManifestFormatError):
        encode(_nest(17))


def _nest(n):
    value: object = 0
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("size,cap,ok", [(10, 10, True), (11, 10, False)], ids=["at-cap", "over-cap"])
def test_whole_document_size_cap(size, cap, ok, raises_exactly):
    wire = b"\xc4" + bytes([size - 2]) + b"x" * (size - 2)
    assert len(wire) == size
    if ok:
        assert decode(wire, max_size=cap) == b"x" * (size - 2)
    else:
        with raises_exactly(ManifestFormatError):
            decode(wire, max_size=cap)


@pytest.mark.parametrize("data", ["\x80", None, [0x80]], ids=["str", "none", "list"])
def test_decode_takes_bytes_only(data, raises_exactly):
    with raises_exactly(ManifestFormatError):
        decode(data, max_size=CAP)


def test_decode_accepts_bytearray_and_memoryview():
    assert decode(bytearray(b"\x80"), max_size=CAP) == {}
    assert decode(memoryview(b"\x91\x01"), max_size=CAP) == [1]


UNENCODABLE = {
    "float": 1.5,
    "float-in-list": [0.0],
    "int-key": {1: 2},
    "bytes-key": {b"a": 1},
    "none-key": {None: 1},
    "too-big-int": 2**64,
    "too-small-int": -(2**63) - 1,
    "set": {1},
    "bytearray": bytearray(b"x"),
    "object": object(),
    "nested-too-deep": _nest(17),
}


@pytest.mark.parametrize("value", UNENCODABLE.values(), ids=UNENCODABLE.keys())
def test_values_without_canonical_form_are_refused(value, raises_exactly):
    with raises_exactly(ManifestFormatError):
        encode(value)


TAKE_FIELDS_BAD = {
    "not-a-map": [("a", 1)],
    "none": None,
    "missing": {"a": 1},
    "unknown": {"a": 1, "b": 2, "c": 3},
}


@pytest.mark.parametrize("raw", TAKE_FIELDS_BAD.values(), ids=TAKE_FIELDS_BAD.keys())
def test_take_fields_refuses_missing_and_unknown(raw, raises_exactly):
    with raises_exactly(ManifestFormatError):
        take_fields(raw, ("a", "b"), "thing")


def test_take_fields_returns_a_copy():
    raw = {"a": 1, "b": 2}
    out = take_fields(raw, ("a", "b"), "thing")
    out.pop("a")
    assert raw == {"a": 1, "b": 2}


# --- properties ---------------------------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
            | st.text(max_size=40) | st.binary(max_size=40))
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None)
@given(_values)
def test_property_decode_inverts_encode(value):
    wire = encode(value)
    assert decode(wire, max_size=CAP) == value
    assert encode(decode(wire, max_size=CAP)) == wire


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=6), st.integers(-5, 5), min_size=2, max_size=8), st.randoms())
def test_property_insertion_order_does_not_matter_and_other_orders_are_refused(d, rnd):
    items = list(d.items())
    rnd.shuffle(items)
    shuffled = dict(items)
    assert encode(shuffled) == encode(d)
    naive = msgpack.packb(shuffled, use_bin_type=True)  # keeps insertion order
    if naive != encode(d):
        with pytest.raises(ManifestFormatError):
            decode(naive, max_size=CAP)


@settings(max_examples=100, deadline=None)
@given(_values, st.data())
def test_property_any_strict_prefix_is_refused(value, data):
    wire = encode(value)
    cut = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    with pytest.raises(ManifestFormatError):
        decode(wire[:cut], max_size=CAP)


def test_object_count_is_checked_before_anything_is_built():
    """Nested empty arrays turn each byte into a Python list: a document of more objects than allowed is refused by
    a walk of its bytes, before msgpack builds any of them; the walk counts every kind of object exactly."""
    from shardtool.manifest._canonical import check_object_count

    bomb = b"\xdd" + (3_000_000).to_bytes(4, "big") + b"\x90" * 3_000_000  # one array of 3M empty arrays
    with pytest.raises(ManifestFormatError, match="more than 1000 msgpack objects"):
        decode(bomb, max_size=1 << 30, max_objects=1000)
    with pytest.raises(ManifestFormatError, match="nests deeper"):
        check_object_count(b"\x91" * 40 + b"\xc0", 10**6)
    value = {"a": [1, -1, 300, -40000, 2**40, None, True, "s" * 40, b"b" * 70000, [], {}], "b": {"c": [b"", "x"]}}
    data = msgpack.packb(value, use_bin_type=True)
    # the map, "a", its list and 11 items, "b", its map, "c", its list and 2 items
    assert check_object_count(data, 10**6) == 1 + 1 + 1 + 11 + 1 + 1 + 1 + 1 + 2
    assert check_object_count(msgpack.packb([msgpack.ExtType(5, b"a" * 300), 1.5]), 10) == 3
    with pytest.raises(ManifestFormatError, match="ends inside"):
        check_object_count(data[:-1], 10**6)
