"""Manifest paths: every bad spelling is refused by check_relpath, by Entry, and inside a decoded manifest."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardtool.errors import ManifestFormatError
from shardtool.manifest import decode_manifest, verify_manifest
from shardtool.manifest._paths import MAX_PATH_BYTES, MAX_SEGMENTS, check_relpath

BAD_PATHS = {
    "absolute": "/etc/passwd",
    "absolute-root": "/",
    "dotdot": "..",
    "dotdot-prefix": "../model/x.bin",
    "dotdot-middle": "a/../b",
    "dotdot-last": "a/..",
    "dot": ".",
    "dot-prefix": "./a",
    "dot-middle": "a/./b",
    "dot-last": "a/.",
    "empty": "",
    "empty-segment": "a//b",
    "trailing-slash": "a/b/",
    "double-leading-slash": "//a",
    "backslash": "a\\b",
    "backslash-dotdot": "..\\x",
    "windows-drive": "C:\\x",
    "nul": "a\x00b",
    "newline": "a\nb",
    "tab": "a\tb",
    "escape": "a\x1b[31mred",
    "del": "a\x7f",
    "c1-csi": "a\x9b31m",
    "c1-nel": "a\x85b",
    "non-nfc": "cafe\u0301.bin",
    "non-nfc-hangul": "\u1100\u1161.bin",
    "lone-surrogate": "a\udc80",
    "too-long": "a" * (MAX_PATH_BYTES + 1),
    "too-long-in-utf8": "\u00e9" * (MAX_PATH_BYTES // 2 + 1),  # 513 characters, 1026 bytes
    "too-many-segments": "/".join(["a"] * (MAX_SEGMENTS + 1)),
}
NON_STR_PATHS = {
    "bytes": b"a.bin",
    "none": None,
    "int": 1,
    "list": ["a.bin"],
    "pathlike": PurePosixPath("a.bin"),
}
GOOD_PATHS = {
    "plain": "config.json",
    "nested": "experts/layer-03/expert-017.safetensors",
    "hidden": ".gitattributes",
    "three-dots": "...",
    "dots-inside": "a..b/c.d",
    "nfc-accent": "caf\u00e9.bin",
    "cjk": "\u6a21\u578b/\u6743\u91cd.bin",
    "space": "a b/c d",
    "longest": "a" * MAX_PATH_BYTES,
    "most-segments": "/".join(["a"] * MAX_SEGMENTS),
}


@pytest.mark.parametrize("path", GOOD_PATHS.values(), ids=GOOD_PATHS.keys())
def test_good_paths_are_returned_unchanged(path, make_entry):
    assert check_relpath(path) is path
    assert make_entry(path).path == path


ALL_BAD = {**BAD_PATHS, **NON_STR_PATHS}


@pytest.mark.parametrize("path", ALL_BAD.values(), ids=ALL_BAD.keys())
def test_check_relpath_refuses(path, raises_exactly):
    with raises_exactly(ManifestFormatError):
        check_relpath(path)


@pytest.mark.parametrize("path", ALL_BAD.values(), ids=ALL_BAD.keys())
def test_entry_refuses(path, make_entry, raises_exactly):
    with raises_exactly(ManifestFormatError):
        make_entry(path, digest=b"\x00" * 32)


# Inside a manifest the path is a msgpack value; a lone surrogate and a PurePath have no msgpack form at all.
ENCODABLE_BAD = {k: v for k, v in ALL_BAD.items() if k not in ("lone-surrogate", "pathlike")}


@pytest.mark.parametrize("path", ENCODABLE_BAD.values(), ids=ENCODABLE_BAD.keys())
def test_decoded_manifest_refuses(path, forge, raw_entry, ed25519_keys, now, raises_exactly):
    # The bad entry is correctly committed to by the root and the head is signed: only the path is wrong.
    data = forge([raw_entry(path=path)], signers=[ed25519_keys[0]])
    with raises_exactly(ManifestFormatError):
        decode_manifest(data)
    with raises_exactly(ManifestFormatError):
        verify_manifest(data, [ed25519_keys[0].public], 1, now=now)


def test_the_forged_document_is_otherwise_valid(forge, raw_entry, ed25519_keys, now):
    # Control for the test above: the same document with a good path verifies.
    data = forge([raw_entry(path="ok.bin")], signers=[ed25519_keys[0]])
    assert [e.path for e in verify_manifest(data, [ed25519_keys[0].public], 1, now=now).entries] == ["ok.bin"]


@settings(max_examples=400, deadline=None)
@example("/".join(["a"] * MAX_SEGMENTS))
@example("/".join(["a"] * (MAX_SEGMENTS + 1)))
@example("a" * MAX_PATH_BYTES)
@example("a" * (MAX_PATH_BYTES + 1))
@example("a/b/.hidden")
@given(st.text(alphabet="ab9_-./\\\x00\x7f\x9fé", min_size=0, max_size=80))
def test_the_one_match_for_plain_paths_agrees_with_the_full_checks(path):
    """check_relpath accepts the common form in one regular-expression match; every other path goes through the
    checks one by one. Both must give the same verdict on any path."""
    import re

    from shardtool.manifest import _paths

    def verdict() -> str | None:
        try:
            _paths.check_relpath(path)
        except ManifestFormatError as e:
            return e.message
        return None

    quick = verdict()
    original = _paths._PLAIN
    _paths._PLAIN = re.compile(r"(?!)")  # matches nothing: only the full checks run
    try:
        full = verdict()
    finally:
        _paths._PLAIN = original
    assert (quick is None) == (full is None), (path, quick, full)
