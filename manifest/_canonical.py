"""Canonical msgpack: one byte string per value, and a strict decoder that accepts nothing else.

Canonical form: maps with str keys sorted by their UTF-8 bytes, no duplicate keys, shortest integer
encodings, str for text and bin for bytes, no floats, no ext types. The decoder re-encodes what it parsed
and rejects input that differs, so every accepted document has exactly one encoding.
"""

from __future__ import annotations

from typing import Any

import msgpack

from shardtool.errors import ManifestFormatError

# Caps applied by the msgpack parser itself, before any Python object of that size exists.
MAX_STR = 64 * 1024
MAX_BIN = 64 * 1024 * 1024
MAX_ARRAY = 4_000_000
MAX_MAP = 256


def _canonicalize(value: Any, depth: int = 0) -> Any:
    if depth > 16:
        raise ManifestFormatError("value nests deeper than 16 levels")
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ManifestFormatError(f"integer {value} does not fit in 64 bits")
        return value
    if isinstance(value, (list, tuple)):
        return [_canonicalize(v, depth + 1) for v in value]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ManifestFormatError(f"map key {key!r} is not a string")
        return {k: _canonicalize(value[k], depth + 1) for k in sorted(value, key=lambda k: k.encode("utf-8"))}
    raise ManifestFormatError(f"type {type(value).__name__} has no canonical encoding")


def encode(value: Any) -> bytes:
    """Canonical bytes of `value` (None, bool, int, str, bytes, list/tuple, dict with str keys)."""
    return msgpack.packb(_canonicalize(value), use_bin_type=True)


def _pairs_to_dict(pairs: list[tuple[Any, Any]]) -> dict:
    result: dict = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise ManifestFormatError(f"map key {key!r} is not a string")
        if key in result:
            raise ManifestFormatError(f"duplicate map key {key!r}")
        result[key] = value
    return result


# msgpack type byte -> (bytes of a length field, fixed bytes that follow) for the types that hold no other object.
_SKIP_LEN = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
_SKIP_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
               0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # array16/32, map16/32: (length bytes, x)


def check_object_count(data: bytes | bytearray | memoryview, max_objects: int, *, max_depth: int = 32,
                       what: str = "document") -> int:
    """Walk msgpack bytes without building a Python object: refuse more than `max_objects` objects or nesting
    deeper than `max_depth` before `unpackb` turns each byte of nested empty arrays into a 56-byte list (a
    256 MiB document could become tens of GB). Returns the number of objects."""
    mv = memoryview(data).cast("B")
    n, pos, count = len(mv), 0, 0
    remaining = [1]  # objects still to read in each open container; the document itself is one object
    while remaining:
        if remaining[-1] == 0:
            remaining.pop()
            continue
        remaining[-1] -= 1
        if pos >= n:
            raise ManifestFormatError(f"{what} is not valid msgpack: it ends inside an object")
        b = mv[pos]
        pos += 1
        count += 1
        if count > max_objects:
            raise ManifestFormatError(f"{what} holds more than {max_objects} msgpack objects")
        items = -1
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            continue
        if 0x80 <= b <= 0x8F:
            items = 2 * (b & 0x0F)
        elif 0x90 <= b <= 0x9F:
            items = b & 0x0F
        elif 0xA0 <= b <= 0xBF:
            pos += b & 0x1F
        elif b in _SKIP_LEN:
            width = _SKIP_LEN[b]
            length = int.from_bytes(mv[pos:pos + width], "big")
            pos += width + length + (1 if b in (0xC7, 0xC8, 0xC9) else 0)  # ext: one more byte, its type
        elif b in _SKIP_FIXED:
            pos += _SKIP_FIXED[b]
        elif b in _CONTAINERS:
            width, per_item = _CONTAINERS[b]
            items = per_item * int.from_bytes(mv[pos:pos + width], "big")
            pos += width
        else:  # 0xC1, never used
            raise ManifestFormatError(f"{what} is not valid msgpack: type byte 0x{b:02x}")
        if items >= 0:
            if len(remaining) > max_depth:
                raise ManifestFormatError(f"{what} nests deeper than {max_depth} levels")
            remaining.append(items)
    if pos > n:
        raise ManifestFormatError(f"{what} is not valid msgpack: it ends inside an object")
    return count


def decode_shallow(data: bytes, *, max_size: int, what: str = "document", max_objects: int | None = None) -> Any:
    """Parse msgpack with every cap and duplicate-key check but WITHOUT the canonical re-encoding check;
    the caller must compare its own re-encoding of the parsed value with `data` (see `decode_entry`).
    `max_objects`: walk the bytes first and refuse a document of more objects (`check_object_count`)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestFormatError(f"{what} must be bytes")
    if len(data) > max_size:
        raise ManifestFormatError(f"{what} is {len(data)} bytes, more than the {max_size}-byte cap")
    if len(data) == 0:
        raise ManifestFormatError(f"{what} is empty")
    if max_objects is not None:
        check_object_count(data, max_objects, what=what)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_pairs_hook=_pairs_to_dict,
            max_str_len=MAX_STR,
            max_bin_len=MAX_BIN,
            max_array_len=MAX_ARRAY,
            max_map_len=MAX_MAP,
            max_ext_len=0,
        )
    except ManifestFormatError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError,
            UnicodeDecodeError) as e:
        raise ManifestFormatError(f"{what} is not valid msgpack: {type(e).__name__}: {str(e)[:200]}") from e


def decode(data: bytes, *, max_size: int, what: str = "document", max_objects: int | None = None) -> Any:
    """Parse canonical msgpack bytes; raise ManifestFormatError for anything else.

    `max_size` caps the whole input; the parser's own caps bound every string, binary, array and map;
    `max_objects` (when given) the number of objects, checked before any is built.
    """
    value = decode_shallow(data, max_size=max_size, what=what, max_objects=max_objects)
    if isinstance(value, float):
        raise ManifestFormatError(f"{what} contains a float")
    try:
        again = encode(value)
    except ManifestFormatError as e:
        raise ManifestFormatError(f"{what} is not canonical: {e.message}") from e
    if again != bytes(data):
        raise ManifestFormatError(f"{what} is not in canonical msgpack form (key order, integer width, or types)")
    return value


def take_fields(d: Any, keys: tuple[str, ...], what: str) -> dict:
    """A copy of map `d` once it has exactly `keys`: missing and unknown fields are both errors."""
    if not isinstance(d, dict):
        raise ManifestFormatError(f"{what} must be a map, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ManifestFormatError(f"{what} lacks field(s) {', '.join(missing)}")
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise ManifestFormatError(f"{what} has unknown field(s) {', '.join(unknown)}")
    return dict(d)
