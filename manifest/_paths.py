"""Manifest paths: relative, `/`-separated, NFC, and unable to name anything outside the model directory."""

from __future__ import annotations

import re
import unicodedata

from shardtool.errors import ManifestFormatError

MAX_PATH_BYTES = 1024
MAX_SEGMENTS = 32
# Unicode category Cc: C0, DEL and C1 (0x80-0x9F: U+009B is a terminal CSI); none belongs in a file name.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# The common form, checked in one match: ASCII segments of letters, digits, `.`, `_`, `-` that do not start with `.`
# (so none is `.` or `..`), none empty, at most MAX_SEGMENTS of them. Such a path passes every check below (ASCII is
# NFC and holds no control character); any other path goes through them one by one.
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(?:/[A-Za-z0-9_-][A-Za-z0-9._-]*){0,%d}" % (MAX_SEGMENTS - 1),
                    re.ASCII)


def check_relpath(path: object) -> str:
    """Return `path` unchanged if it is a canonical relative path; raise ManifestFormatError naming the flaw.

    Canonical means: non-empty str, at most 1024 UTF-8 bytes, NFC, no NUL/control characters, no backslash,
    not absolute, no empty, `.` or `..` segment. We reject rather than normalise: a manifest that needs
    normalising is not in canonical form, and two spellings of one file would be two entries.
    """
    if not isinstance(path, str):
        raise ManifestFormatError(f"path must be a string, got {type(path).__name__}")
    if len(path) <= MAX_PATH_BYTES and _PLAIN.fullmatch(path):
        return path
    if not path:
        raise ManifestFormatError("path is empty")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise ManifestFormatError(f"path {path!r} is not valid UTF-8") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise ManifestFormatError(f"path longer than {MAX_PATH_BYTES} bytes: {path[:64]!r}...")
    if "\x00" in path:
        raise ManifestFormatError(f"path {path!r} contains NUL")
    if _CONTROL.search(path):
        raise ManifestFormatError(f"path {path!r} contains a control character")
    if "\\" in path:
        raise ManifestFormatError(f"path {path!r} contains a backslash; separators must be '/'")
    if path.startswith("/"):
        raise ManifestFormatError(f"path {path!r} is absolute; paths are relative to the model directory")
    if not unicodedata.is_normalized("NFC", path):
        raise ManifestFormatError(f"path {path!r} is not in Unicode NFC form")
    segments = path.split("/")
    if len(segments) > MAX_SEGMENTS:
        raise ManifestFormatError(f"path {path!r} has more than {MAX_SEGMENTS} segments")
    for segment in segments:
        if segment == "":
            raise ManifestFormatError(f"path {path!r} has an empty segment")
        if segment in (".", ".."):
            raise ManifestFormatError(f"path {path!r} has a {segment!r} segment")
    return path
