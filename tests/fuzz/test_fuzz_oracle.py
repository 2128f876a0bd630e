"""The fuzz oracle itself: it must fail on a foreign exception, a huge allocation and a hang, or every fuzz
test above could pass without checking anything."""

from __future__ import annotations

import time

import pytest

import _fuzzkit
from _fuzzkit import only_our_errors
from shardtool.errors import ManifestFormatError


def _raise(exc):
    raise exc


def _spin():
    while True:
        time.sleep(0.01)


CASES = {
    "foreign-exception": (lambda: _raise(ValueError("boom")), "raised ValueError"),
    "huge-allocation": (lambda: bytearray(4 * _fuzzkit.ALLOCATION_BUDGET), "tried to allocate more than"),
    "hang": (_spin, "hung"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fuzz_oracle_catches(case, monkeypatch):
    fn, message = CASES[case]
    monkeypatch.setattr(_fuzzkit, "WATCHDOG_SECONDS", 0.2)
    with pytest.raises(AssertionError, match=message):
        only_our_errors(fn)


def test_fuzz_oracle_passes_our_errors_through():
    err = only_our_errors(lambda: _raise(ManifestFormatError("bad")))
    assert type(err) is ManifestFormatError
    assert only_our_errors(lambda: 7) == 7
    assert len(only_our_errors(lambda: bytearray(64 * 1024 * 1024))) == 64 * 1024 * 1024  # within budget
