"""The one entry check (`check_entry`: size first, then BLAKE3) and the forms built on it: the descriptor form
(`verify_open_file`) raises the same error, audit's finding form reports it with the error's finding class.
A table of named files against one entry, then the changed-while-hashed cases, then a guard that no reader of a
listed file compares digests by hand again."""

from __future__ import annotations

import ast
import os
import tomllib
from pathlib import Path

import blake3
import pytest

from shardtool.errors import DigestMismatchError
from shardtool.manifest import Entry, FileDigest, check_entry, check_size, verify_open_file
from shardtool.manifest.audit import check_file

REPO = Path(__file__).resolve().parents[2]
DATA = bytes(range(256)) * 20  # 5120 bytes


def _entry(data: bytes) -> Entry:
    return Entry(path="layers/1/experts/1.safetensors", kind="other", size=len(data),
                 digest=blake3.blake3(data).digest())


def _flip(data: bytes) -> bytes:
    return data[:100] + bytes([data[100] ^ 1]) + data[101:]


# name: (bytes on disk, bytes the entry was made from, error finding class or None)
CASES = {
    "right-file": (DATA, DATA, None),
    "size-short": (DATA[:-1], DATA, "size-mismatch"),
    "size-long": (DATA + b"\0", DATA, "size-mismatch"),
    "same-size-wrong-bytes": (_flip(DATA), DATA, "digest-mismatch"),
    "empty-entry-empty-file": (b"", b"", None),
    "empty-entry-file-with-bytes": (b"x", b"", "size-mismatch"),
    "entry-with-bytes-empty-file": (b"", DATA, "size-mismatch"),
    "empty-entry-same-size-other-digest": (b"", b"", "digest-mismatch"),  # the entry's digest is changed below
}


def _case(name: str) -> tuple[bytes, Entry, str | None]:
    on_disk, signed, finding = CASES[name]
    entry = _entry(signed)
    if name == "empty-entry-same-size-other-digest":
        entry = Entry(path=entry.path, kind=entry.kind, size=0, digest=b"\x11" * 32)
    return on_disk, entry, finding


def _assert_names_it(err: DigestMismatchError, entry: Entry, on_disk: bytes, where: str) -> None:
    found = len(on_disk) if err.finding == "size-mismatch" else blake3.blake3(on_disk).hexdigest()
    expected = entry.size if err.finding == "size-mismatch" else entry.digest.hex()
    assert (err.expected, err.actual) == (str(expected), str(found))
    assert str(err).startswith(f"{where}: ") and str(expected) in str(err) and str(found) in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize("name", CASES)
def test_entry_check_over_measured_bytes(name, raises_exactly):
    on_disk, entry, finding = _case(name)
    found = FileDigest(len(on_disk), blake3.blake3(on_disk).digest())
    if finding is None:
        check_entry(entry, found)
        return
    with raises_exactly(DigestMismatchError) as info:
        check_entry(entry, found)
    assert info.value.finding == finding
    _assert_names_it(info.value, entry, on_disk, entry.path)


@pytest.mark.parametrize("name", CASES)
def test_descriptor_form_raises_what_the_check_raises(name, tmp_path, raises_exactly):
    on_disk, entry, finding = _case(name)
    path = tmp_path / "shard"
    path.write_bytes(on_disk)
    fd = os.open(path, os.O_RDONLY)
    try:
        if finding is None:
            assert verify_open_file(fd, entry, where=str(path)).size == len(on_disk)
            return
        with raises_exactly(DigestMismatchError) as info:
            verify_open_file(fd, entry, where=str(path))
    finally:
        os.close(fd)
    assert info.value.finding == finding
    if finding == "size-mismatch":  # the size decides before a byte is read: nothing was hashed
        assert (info.value.expected, info.value.actual) == (str(entry.size), str(len(on_disk)))
    else:
        _assert_names_it(info.value, entry, on_disk, str(path))


@pytest.mark.parametrize("name", CASES)
def test_audit_finding_form_reports_the_checks_error(name, tmp_path):
    on_disk, entry, finding = _case(name)
    (tmp_path / entry.path).parent.mkdir(parents=True)
    (tmp_path / entry.path).write_bytes(on_disk)
    got = check_file(tmp_path, entry)
    if finding is None:
        assert got is None
        return
    assert (got.path, got.finding, got.found_size, got.expected_size) == (entry.path, finding, len(on_disk), entry.size)
    with pytest.raises(DigestMismatchError) as info:
        check_entry(entry, FileDigest(len(on_disk), None if finding == "size-mismatch"
                                      else blake3.blake3(on_disk).digest()))
    assert got.detail == info.value.message


# name: (what reading measured, actual in the error, the message's end)
CHANGED = {
    "shrank-while-read": (FileDigest(1000, None, changed=True), "1000", " (1000 bytes, manifest says 5120)"),
    "grew-while-read": (FileDigest(5120, b"\0" * 32, changed=True, grew=True), "5120+",
                        " (5120+ bytes, manifest says 5120)"),
    "same-size-mtime-moved": (FileDigest(5120, b"\0" * 32, changed=True), "5120", ""),
    "changed-and-right-digest": (FileDigest(5120, blake3.blake3(DATA).digest(), changed=True), "5120", ""),
}


@pytest.mark.parametrize("name", CHANGED)
def test_a_file_that_changed_while_hashed_is_refused_first(name, raises_exactly):
    found, actual, tail = CHANGED[name]
    with raises_exactly(DigestMismatchError) as info:
        check_entry(_entry(DATA), found, "model/x")
    assert (info.value.finding, info.value.expected, info.value.actual) == ("unreadable", "5120", actual)
    assert str(info.value) == f"model/x: file changed while it was being hashed{tail}"


def test_check_size_is_the_first_half(raises_exactly):
    check_size(_entry(DATA), len(DATA))
    with raises_exactly(DigestMismatchError) as info:
        check_size(_entry(DATA), len(DATA) - 1)
    assert (info.value.finding, info.value.expected, info.value.actual) == ("size-mismatch", "5120", "5119")


def test_a_right_size_with_no_digest_is_a_bug_not_a_verdict():
    with pytest.raises(ValueError):
        check_entry(_entry(DATA), FileDigest(len(DATA), None))


def _source_files() -> list[Path]:
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted(p for d in set(dirs) for p in (REPO / d).rglob("*.py"))


ENTRY_CHECK_HOME = REPO / "manifest" / "_files.py"


def test_no_digest_is_compared_outside_the_entry_check():
    """A `.digest` compared with == or != anywhere in the installed code but the entry check's own module is a
    second, hand-written entry check: call `check_entry` (and catch its error where a yes or no is needed)."""
    files = _source_files()
    assert ENTRY_CHECK_HOME in files and len(files) > 50
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops) and any(
                    isinstance(x, ast.Attribute) and x.attr == "digest" for x in (node.left, *node.comparators)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert [f for f in found if not f.startswith(str(ENTRY_CHECK_HOME.relative_to(REPO)))] == []
    assert found, "the entry check itself should be found: the scan is broken"
