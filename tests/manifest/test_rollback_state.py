"""Rollback floor: per (model, trusted key set), lower versions and equivocation are refused, higher versions
raise the floor, and a corrupt state file is an error rather than a silent reset."""

from __future__ import annotations

import json
import stat

import pytest

from shardtool.errors import RollbackError, StorageError
from shardtool.manifest import check_and_record
from shardtool.manifest._records import Head
from shardtool.manifest._state import STATE_FILE, trust_set_id

ROOT = b"\x42" * 32


def _head(version: int, *, model_id: str = "acme/moe", root: bytes = ROOT, created: int = 1_000) -> Head:
    return Head(model_id=model_id, version=version, created=created, expires=created + 10_000, entry_count=3,
                merkle_root=root)


@pytest.fixture
def pubs(ed25519_keys):
    return [k.public for k in ed25519_keys]


def test_first_use_records_and_higher_version_raises_the_floor(tmp_path, pubs, raises_exactly):
    assert check_and_record(tmp_path, _head(3), [pubs[0]]) is None
    assert check_and_record(tmp_path, _head(3), [pubs[0]]) == 3  # the same head again is fine
    assert check_and_record(tmp_path, _head(5), [pubs[0]]) == 3
    for lower in (4, 3, 1):
        with raises_exactly(RollbackError):
            check_and_record(tmp_path, _head(lower), [pubs[0]])
    assert check_and_record(tmp_path, _head(5), [pubs[0]]) == 5
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert [r["version"] for r in state.values()] == [5]
    assert stat.S_IMODE((tmp_path / STATE_FILE).stat().st_mode) == 0o600


REFUSALS = {
    "lower-version": lambda: _head(1),
    "same-version-other-root": lambda: _head(2, root=b"\x43" * 32),
    "same-version-other-created": lambda: _head(2, created=1_001),
}


@pytest.mark.parametrize("make", REFUSALS.values(), ids=REFUSALS.keys())
def test_rollback_and_equivocation_are_refused(tmp_path, pubs, make, raises_exactly):
    check_and_record(tmp_path, _head(2), [pubs[0]])
    before = (tmp_path / STATE_FILE).read_bytes()
    with raises_exactly(RollbackError):
        check_and_record(tmp_path, make(), [pubs[0]])
    assert (tmp_path / STATE_FILE).read_bytes() == before, "a refused head must not move the floor"


def test_different_key_sets_keep_separate_floors(tmp_path, pubs, raises_exactly):
    check_and_record(tmp_path, _head(9), [pubs[0]])
    assert check_and_record(tmp_path, _head(1), [pubs[1]]) is None
    assert check_and_record(tmp_path, _head(1), [pubs[0], pubs[1]]) is None
    assert check_and_record(tmp_path, _head(1, model_id="acme/other"), [pubs[0]]) is None
    with raises_exactly(RollbackError):
        check_and_record(tmp_path, _head(8), [pubs[0]])
    with raises_exactly(RollbackError):  # the {0, 1} floor is 1 now: equal version, other head
        check_and_record(tmp_path, _head(1, root=b"\x00" * 32), [pubs[1], pubs[0]])


def test_key_set_identity_ignores_order_and_repeats(pubs):
    a, b = pubs[:2]
    assert trust_set_id("m", [a, b]) == trust_set_id("m", [b, a]) == trust_set_id("m", [a, b, a])
    assert len({trust_set_id("m", [a]), trust_set_id("m", [b]), trust_set_id("m", [a, b]),
                trust_set_id("n", [a])}) == 4


def test_state_dir_may_be_a_string(tmp_path, pubs):
    assert check_and_record(str(tmp_path / "nested" / "state"), _head(1), [pubs[0]]) is None
    assert (tmp_path / "nested" / "state" / STATE_FILE).is_file()


CORRUPT = {
    "garbage": b"\x00\xff garbage",
    "empty": b"",
    "json-list": b"[]",
    "json-string": b'"x"',
    "record-not-object": b'{"abc": 3}',
    "version-missing": b'{"abc": {"head": "00"}}',
    "version-str": b'{"abc": {"version": "3", "head": "00"}}',
    "version-bool": b'{"abc": {"version": true, "head": "00"}}',
    "version-float": b'{"abc": {"version": 3.0, "head": "00"}}',
    "head-missing": b'{"abc": {"version": 3}}',
    "truncated": b'{"abc": {"version": 3, "he',
    "invalid-utf8": b'{"\xff": 1}',
    "deeply-nested": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_state_file_is_a_storage_error(tmp_path, pubs, content, raises_exactly):
    (tmp_path / STATE_FILE).write_bytes(content)
    with raises_exactly(StorageError):
        check_and_record(tmp_path, _head(1), [pubs[0]])
    assert (tmp_path / STATE_FILE).read_bytes() == content, "a corrupt file is left for a human to inspect"


def test_unusable_state_dir_is_a_storage_error(tmp_path, pubs, raises_exactly):
    (tmp_path / "file").write_bytes(b"")
    with raises_exactly(StorageError):
        check_and_record(tmp_path / "file", _head(1), [pubs[0]])
