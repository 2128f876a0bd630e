"""Fuzzing the run-receipt decoder and the routing-trace decoder like the manifest's: arbitrary bytes, arbitrary
msgpack, receipt-shaped payloads with hostile fields signed by the operator (so the decoder behind the signature
is reached), and byte-level mutations of a genuine signed receipt.

Contract: only ShardtoolError subclasses escape; a mutated receipt that still opens says exactly what the
original said; an accepted payload is canonical (one encoding per receipt).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from _fuzzkit import INT64, msgpack_values, mutated, only_our_errors, packb
from shardtool.errors import ShardtoolError
from shardtool.keys import PrivateKey
from shardtool.manifest import Receipt, decode_trace, encode_trace, open_receipt, routing_leaves, routing_root, sign_receipt
from shardtool.manifest import _canonical
from shardtool.manifest._envelope import pae
from shardtool.manifest._receipt import RECEIPT_FORMAT, RECEIPT_PAYLOAD_TYPE, decode_payload

OPERATOR = PrivateKey(Ed25519PrivateKey.from_private_bytes(b"\x09" * 32))
OPERATORS = [OPERATOR.public]
ROUTES = np.array([[[1, 3], [0, 2]], [[2, 3], [1, 2]], [[0, 1], [0, 3]], [[1, 2], [2, 3]]])  # [4 positions, 2 layers, k=2]


def _genuine() -> Receipt:
    fp = np.zeros(4, dtype=np.dtype([("i", "<u4"), ("v", "<f4")]))
    fp["i"], fp["v"] = [3, 1, 4, 1], [1.5, -2.25, 0.5, 3.0]
    return Receipt(id="rcpt-fuzz", created=1_750_000_000, model_id="fuzz/model", manifest_version=3,
                   merkle_root=b"\x01" * 32, prompt_ids=(5, 6, 7), max_new_tokens=2, temperature=0.7, top_p=0.9,
                   seed=42, stop_token_ids=(2,), token_ids=(9, 2), finish_reason="stop", moe_layers=(0, 1), top_k=2,
                   routing_root=routing_root(routing_leaves(ROUTES)), fingerprint=fp.tobytes())


GENUINE = _genuine()
SIGNED = sign_receipt(GENUINE, OPERATOR)
TRACE = encode_trace(GENUINE.id, GENUINE.moe_layers, GENUINE.top_k, ROUTES)


@pytest.mark.parametrize("version", [True, False, "1", 2, 0])
def test_a_receipt_version_that_only_compares_equal_is_refused(version):
    """msgpack's true compares equal to version 1 in Python: only the integer 1 is a version-1 receipt (the fuzzer
    found `version: true`, in canonical form, accepted and re-encoded as 1)."""
    payload = GENUINE.to_payload()
    payload["version"] = version
    with pytest.raises(ShardtoolError, match="type/version"):
        decode_payload(_canonical.encode(payload))


def test_genuine_receipt_round_trips():
    got, signer = open_receipt(SIGNED, OPERATORS)
    assert got == GENUINE and signer == OPERATOR.public
    assert np.array_equal(decode_trace(TRACE, GENUINE), ROUTES)


@given(st.binary(max_size=4096))
def test_fuzz_receipt_random_bytes(data):
    only_our_errors(open_receipt, data, OPERATORS)
    only_our_errors(decode_payload, data)
    only_our_errors(decode_trace, data, GENUINE)


@given(msgpack_values(12))
def test_fuzz_receipt_any_structure(value):
    only_our_errors(open_receipt, packb(value), OPERATORS)
    only_our_errors(decode_payload, packb(value))
    only_our_errors(decode_trace, packb(value), GENUINE)


@given(mutated(SIGNED, max_ops=3))
def test_fuzz_receipt_mutated_signed(data):
    got = only_our_errors(open_receipt, data, OPERATORS)
    if not isinstance(got, ShardtoolError):
        assert got[0] == GENUINE  # only unsigned labels (the key ID) may have changed


@given(mutated(TRACE, max_ops=3))
def test_fuzz_trace_mutated(data):
    got = only_our_errors(decode_trace, data, GENUINE)
    if not isinstance(got, ShardtoolError):
        assert np.array_equal(got, ROUTES)  # the signed root pins every expert id


def _hostile(value_strategy):
    return st.dictionaries(st.sampled_from(["id", "created", "model_id", "manifest_version", "merkle_root",
                                            "prompt_ids", "max_new_tokens", "temperature", "top_p", "seed",
                                            "stop_token_ids", "token_ids", "finish_reason", "moe_layers", "top_k",
                                            "root", "scheme", "data", "type", "version"]),
                           value_strategy, max_size=4)


_VALUES = (INT64 | st.none() | st.booleans() | st.text(max_size=20) | st.binary(max_size=40)
           | st.lists(INT64, max_size=6) | st.just([2**40]) | st.just(struct.pack(">d", float("nan")))
           | st.just(struct.pack(">d", -1.0)) | st.just(struct.pack(">d", 1e308)))


@given(_hostile(_VALUES), st.sampled_from(["model", "request", "answer", "routing", "fingerprint", None]),
       st.booleans())
def test_fuzz_receipt_shaped(noise, section, sign):
    """The right skeleton, hostile fields, sometimes signed by the operator so the payload decoder is reached."""
    payload = GENUINE.to_payload()
    target = payload if section is None else payload[section]
    target.update(noise)
    try:
        raw = _canonical.encode(payload)
    except ShardtoolError:
        raw = packb(payload)
    got = only_our_errors(decode_payload, raw)
    if not isinstance(got, ShardtoolError):
        assert _canonical.encode(got.to_payload()) == raw
    sigs = [{"keyid": OPERATOR.public.keyid, "sig": OPERATOR.sign(pae(RECEIPT_PAYLOAD_TYPE, raw))}] if sign else []
    doc = {"envelope": {"payload": raw, "payloadType": RECEIPT_PAYLOAD_TYPE, "signatures": sigs},
           "format": RECEIPT_FORMAT}
    only_our_errors(open_receipt, packb(doc), OPERATORS)
