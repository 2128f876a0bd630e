"""Human text: terminal-safe strings and the one way sizes and rates are written.

Terminal-safe text: every untrusted string (a file name from disk, a path from a manifest, a name from a
checkpoint) passes through `printable` before it reaches human output, so that a name holding `\\r`, an ANSI
escape or a bidi override cannot erase or repaint what we print. `--json` output is escaped by the encoder.

Sizes and rates in human output are binary (KiB = 1024 bytes, MiB, GiB ...), the units `--memory-budget 8GiB`
and the budget's messages use; `--json` documents keep plain byte counts and their own field names.
"""

from __future__ import annotations


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str, *, backslash: bool = True) -> str:
    """`text` with every non-printable character (C0/C1 controls, line and paragraph separators, format
    characters such as bidi overrides, lone surrogates from undecodable names) written as a Python-style
    escape. With `backslash`, a literal backslash is doubled too, so the escaped form is unambiguous."""
    if text.isprintable() and (not backslash or "\\" not in text):
        return text
    out = []
    for ch in text:
        if ch == "\\" and backslash:
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(_escape(ch))
    return "".join(out)


def printable_lines(text: str) -> str:
    """Our own multi-line message: each line made printable, the line breaks we put there kept."""
    return "\n".join(printable(line, backslash=False) for line in text.split("\n"))


_BINARY_UNITS = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_size(n: float) -> str:
    """A byte count for people: '512 B', '1.50 KiB', '8.00 GiB' (binary units, two decimals)."""
    for unit, scale in _BINARY_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_rate(bytes_per_second: float) -> str:
    """Bytes per second for people: '1.86 GiB/s'."""
    return f"{format_size(bytes_per_second)}/s"
