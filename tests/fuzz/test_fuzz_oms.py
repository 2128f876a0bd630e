"""Fuzzing the OMS bundle and statement decoders: arbitrary bytes, JSON-shaped bundles, byte-level mutations of a
genuine bundle, and hostile statements signed by the trusted key (so the statement decoder behind the signature is
reached).

Contract: only ShardtoolError subclasses escape; a mutated bundle that still opens says exactly what the original
said; every path an accepted statement names is a checked relative path.
"""

from __future__ import annotations

import base64
import json

from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st

from _fuzzkit import mutated, only_our_errors
from shardtool.errors import ShardtoolError
from shardtool.keys import EcPrivateKey
from shardtool.manifest import OmsResource, check_relpath, make_oms_bundle, open_oms_bundle
from shardtool.manifest._envelope import pae
from shardtool.manifest._oms import PAYLOAD_TYPE, decode_statement

KEY = EcPrivateKey(ec.derive_private_key(0x5EED, ec.SECP256R1()))
TRUSTED = [KEY.public]
GENUINE = make_oms_bundle("fuzz/model", [OmsResource("config.json", b"\x01" * 32),
                                         OmsResource("experts/layer-000/expert-0000.safetensors", b"\x02" * 32)],
                          ["model.sig", "manifest.msgpack"], KEY)
STATEMENT = open_oms_bundle(GENUINE, TRUSTED)

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=40)
JSON = st.recursive(JSON_SCALARS, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=12), c,
                                                                                        max_size=5), max_leaves=25)
STATEMENT_KEYS = ("_type", "subject", "predicateType", "predicate", "resources", "serialization", "name", "digest",
                  "algorithm", "method", "hash_type", "allow_symlinks", "ignore_paths", "sha256")


def _signed(payload: bytes) -> bytes:
    sig = KEY.sign(pae(PAYLOAD_TYPE, payload))
    return json.dumps({"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
                       "verificationMaterial": {"publicKey": {"hint": KEY.public.hint}, "tlogEntries": []},
                       "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                                        "signatures": [{"sig": base64.b64encode(sig).decode()}]}}).encode()


def _accepted_is_checked(result) -> None:
    if isinstance(result, ShardtoolError):
        return
    for r in result.resources:
        assert check_relpath(r.name) == r.name
    for p in result.ignore_paths:
        assert check_relpath(p) == p


@given(st.binary(max_size=4096))
def test_fuzz_oms_bundle_random_bytes(data):
    _accepted_is_checked(only_our_errors(open_oms_bundle, data, TRUSTED))


@given(JSON)
def test_fuzz_oms_bundle_any_json(value):
    assert isinstance(only_our_errors(open_oms_bundle, json.dumps(value).encode(), TRUSTED), ShardtoolError)


@given(st.data())
def test_fuzz_oms_bundle_mutated_signed(data):
    result = only_our_errors(open_oms_bundle, data.draw(mutated(GENUINE)), TRUSTED)
    if not isinstance(result, ShardtoolError):
        assert (result.resources, result.ignore_paths, result.hash_type) == (
            STATEMENT.resources, STATEMENT.ignore_paths, STATEMENT.hash_type)


@st.composite
def _statement_shaped(draw):
    """A genuine statement with one field replaced by any JSON value: the shapes a signer's bug (or a stolen key) sends."""
    st_ = json.loads(base64.b64decode(json.loads(GENUINE)["dsseEnvelope"]["payload"]))
    path = draw(st.sampled_from([("_type",), ("subject",), ("subject", 0, "name"), ("subject", 0, "digest"),
                                 ("predicateType",), ("predicate", "resources"), ("predicate", "resources", 0),
                                 ("predicate", "resources", 0, "name"), ("predicate", "resources", 1, "digest"),
                                 ("predicate", "serialization", "ignore_paths"),
                                 ("predicate", "serialization", "hash_type"),
                                 ("predicate", "serialization", "allow_symlinks")]))
    node = st_
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = draw(JSON | st.sampled_from(["../x", "/abs", "a//b", "a\\b", "\x00", ".", "x/..", "é"]))
    return json.dumps(st_).encode()


@given(_statement_shaped())
def test_fuzz_oms_statement_shaped_signed(payload):
    _accepted_is_checked(only_our_errors(open_oms_bundle, _signed(payload), TRUSTED))


@given(st.binary(max_size=2048) | JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzz_oms_statement_any_payload(payload):
    _accepted_is_checked(only_our_errors(decode_statement, payload, KEY.public))
