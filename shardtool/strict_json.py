"""Strict JSON for untrusted bytes (config.json, tokenizer configs, safetensors headers, index files): UTF-8
only, a key named twice is an error (not last-one-wins), NaN and Infinity are not JSON, nesting is bounded.
One reader for every JSON document the tool parses.
"""

from __future__ import annotations

import json
from typing import Any

from shardtool.errors import CheckpointFormatError


def strict_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook for untrusted JSON: a key named twice is an error, not last-one-wins."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointFormatError(f"names {key!r} twice")
        out[key] = value
    return out


def reject_json_constant(name: str) -> Any:
    """json parse_constant hook: NaN and Infinity are not JSON."""
    raise CheckpointFormatError(f"contains the non-JSON constant {name}")


def loads_strict(data: bytes, where: str | None = None) -> Any:
    """Parse untrusted JSON bytes; every failure is one CheckpointFormatError naming `where`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"not UTF-8 ({e.reason} at byte {e.start})", path=where) from None
    try:
        return json.loads(text, object_pairs_hook=strict_json_object, parse_constant=reject_json_constant)
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"not valid JSON: {e.msg} at line {e.lineno}", path=where) from None
    except RecursionError:
        raise CheckpointFormatError("JSON nested too deeply", path=where) from None
    except CheckpointFormatError as e:
        raise CheckpointFormatError(e.message, path=where) from None
    except ValueError as e:  # e.g. an integer beyond Python's digit limit
        raise CheckpointFormatError(f"not usable JSON: {str(e)[:120]}", path=where) from None
