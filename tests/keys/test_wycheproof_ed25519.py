"""Wycheproof Ed25519 vectors through shardtool's own verify path (`PublicKey.verify`).

Every "valid" vector verifies; every "invalid" one raises SignatureError and nothing else. All public keys in
the file are 32 bytes, so the KeyFileError a wrong-length key would raise at construction never comes up;
`test_wrong_length_public_key_is_refused_at_construction` pins that behaviour separately.
"""

from __future__ import annotations

import pytest

from shardtool.errors import KeyFileError, SignatureError
from shardtool.keys import PublicKey

FILE = "wycheproof_ed25519_test.json"


def _cases(data):
    for group in data["testGroups"]:
        for t in group["tests"]:
            name = f"tc{t['tcId']}-{t['result']}" + (f"-{t['comment'].replace(' ', '_')}" if t["comment"] else "")
            yield name, (group["publicKey"]["pk"], t["msg"], t["sig"], t["result"], t["flags"])


def test_vector_file_is_complete(load_testdata):
    data = load_testdata(FILE)
    tests = [t for g in data["testGroups"] for t in g["tests"]]
    assert data["algorithm"] == "EDDSA"
    assert data["numberOfTests"] == len(tests) == 151
    results = [t["result"] for t in tests]
    assert (results.count("valid"), results.count("invalid"), results.count("acceptable")) == (88, 63, 0)
    assert len({t["tcId"] for t in tests}) == 151


@pytest.mark.vectors(FILE, "case", _cases)
def test_wycheproof(case, raises_exactly):
    pk, msg, sig, result, flags = case
    key = PublicKey(bytes.fromhex(pk))
    if result == "valid":
        assert key.verify(bytes.fromhex(sig), bytes.fromhex(msg)) is None
    else:
        assert result == "invalid", f"unexpected result {result!r} ({flags})"
        with raises_exactly(SignatureError):
            key.verify(bytes.fromhex(sig), bytes.fromhex(msg))


@pytest.mark.parametrize("raw", [b"", b"\x00" * 31, b"\x00" * 33, "00" * 32, bytearray(32), None],
                         ids=["empty", "31-bytes", "33-bytes", "hex-str", "bytearray", "none"])
def test_wrong_length_public_key_is_refused_at_construction(raw, raises_exactly):
    # A key that is not 32 raw bytes never becomes a PublicKey, so it can never be asked to verify anything.
    with raises_exactly(KeyFileError):
        PublicKey(raw)
