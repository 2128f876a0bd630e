"""A size typed by a user (`--memory-budget 8GiB`, `open_model(memory_budget="8GiB")`) read exactly, or refused with
one line naming where it was given."""

from __future__ import annotations

import re

from shardtool.errors import UsageError


# ASCII digits only (`\d` would take any Unicode digit); at most 30 characters, so no text is big to parse.
_SIZE = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,6})?)\s*(B|K|KB|KiB|M|MB|MiB|G|GB|GiB|T|TB|TiB)?",
                   re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
MAX_SIZE_TEXT = 30
MAX_MEMORY_BUDGET = 2**50  # 1 PiB: beyond any machine's memory, and every sum the plan makes stays exact


def parse_size(text: str, flag: str = "--memory-budget") -> int:
    """'8GiB', '512MiB', '1.5G', '1000000' -> bytes (K/M/G/T alone are binary units), in [1, 1 PiB].

    Any other text is a UsageError naming `flag`: the arithmetic is exact (integers and Fraction, never float),
    so no string can reach an OverflowError or an infinity."""
    from fractions import Fraction

    m = _SIZE.fullmatch(text.strip()) if len(text) <= MAX_SIZE_TEXT else None
    if not m:
        raise UsageError(f"{flag} {text[:40]!r} is not a size from 1 byte to 1PiB (examples: 8GiB, 512MiB, "
                         f"2000000000)")
    value = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if not 1 <= value <= MAX_MEMORY_BUDGET:
        raise UsageError(f"{flag} must be between 1 byte and 1PiB, got {text!r}")
    return value
