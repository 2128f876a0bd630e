"""Fuzzing manifest path validation: any object, any text, and path-like strings built from the pieces attacks use.

Contract: `check_relpath` returns its argument unchanged or raises ManifestFormatError; and whatever it accepts
names a place strictly inside the model directory, in exactly one spelling.
"""

from __future__ import annotations

import posixpath
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from _fuzzkit import msgpack_values, only_our_errors
from shardtool.errors import ManifestFormatError
from shardtool.manifest._paths import check_relpath

ROOT = "/srv/model"
PIECES = st.sampled_from(["a", "experts", "layer-000", "expert-0001.safetensors", "..", ".", "", "...", "/", "\\",
                          "\x00", "\x1b", "\x85", "\u202e", "e\u0301", "\u00e9", "C:", "~", " ", "\ud800",
                          "\uff0e\uff0e", "a" * 300])


def _accepted(path) -> bool:
    got = only_our_errors(check_relpath, path)
    if isinstance(got, ManifestFormatError):
        return False
    assert got is path
    return True


def _assert_confined(path: str) -> None:
    joined = posixpath.normpath(posixpath.join(ROOT, path))
    assert joined.startswith(ROOT + "/"), f"{path!r} leaves the model directory: {joined}"
    assert posixpath.normpath(path) == path, f"{path!r} has a second spelling {posixpath.normpath(path)!r}"
    assert "\\" not in path and "\x00" not in path and not path.startswith("/")
    assert unicodedata.normalize("NFC", path) == path
    assert all(seg not in ("", ".", "..") for seg in path.split("/"))


@given(st.text(max_size=200))
def test_fuzz_paths_any_text(path):
    if _accepted(path):
        _assert_confined(path)


@given(st.lists(PIECES, min_size=1, max_size=12), st.sampled_from(["/", "", "\\"]))
def test_fuzz_paths_from_attack_pieces(pieces, sep):
    path = sep.join(pieces)
    if _accepted(path):
        _assert_confined(path)


@given(msgpack_values(4))
def test_fuzz_paths_any_object(value):
    if _accepted(value):
        _assert_confined(value)
