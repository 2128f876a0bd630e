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


def decode_shallow(data: bytes, *, max_size: int, what: str = "document") -> Any:
    """Parse msgpack with every cap and duplicate-key check but WITHOUT the canonical re-encoding check;
    the caller must compare its own re-encoding of the parsed value with `data` (see `decode_entry`)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestFormatError(f"{what} must be bytes")
    if len(data) > max_size:
        raise ManifestFormatError(f"{what} is {len(data)} bytes, more than the {max_size}-byte cap")
    if len(data) == 0:
        raise ManifestFormatError(f"{what} is empty")
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


def decode(data: bytes, *, max_size: int, what: str = "document") -> Any:
    """Parse canonical msgpack bytes; raise ManifestFormatError for anything else.

    `max_size` caps the whole input; the parser's own caps bound every string, binary, array and map.
    """
    value = decode_shallow(data, max_size=max_size, what=what)
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
