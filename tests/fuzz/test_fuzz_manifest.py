"""Fuzzing the manifest decoder and the DSSE envelope: arbitrary bytes, arbitrary msgpack structures, manifest-
shaped documents with hostile fields, and byte-level mutations of a genuine signed manifest.

Contract: only ShardtoolError subclasses escape; and no mutation of a signed manifest changes what is trusted
(when a mutated document still verifies, its head and entries are exactly the original's).
"""

from __future__ import annotations

import re

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from _fuzzkit import INT64, msgpack_values, mutated, only_our_errors, packb
from shardtool.errors import ShardtoolError
from shardtool.keys import PrivateKey
from shardtool.manifest import Entry, Envelope, build_manifest, decode_manifest, verify_envelope, verify_manifest
from shardtool.manifest import _canonical
from shardtool.manifest._document import FORMAT, decode_entries, decode_entry, entry_bytes

NOW = 1_750_000_000
KEY = PrivateKey(Ed25519PrivateKey.from_private_bytes(b"\x07" * 32))
TRUSTED = [KEY.public]


def _signed_manifest() -> bytes:
    entries = [Entry(f"experts/layer-000/expert-{i:04d}.safetensors", "expert", 100 + i, bytes([i]) * 32, 0, i)
               for i in range(5)]
    entries += [Entry("config.json", "config", 10, b"\x11" * 32), Entry("trunk/embed.safetensors", "trunk", 7,
                                                                         b"\x22" * 32)]
    m = build_manifest(entries, model_id="fuzz/model", version=3, now=NOW, contract={"total_bytes": 1234})
    return m.with_envelope(m.envelope.signed_by(KEY)).to_bytes()


SIGNED = _signed_manifest()
GENUINE = verify_manifest(SIGNED, TRUSTED, 1, now=NOW)


def _verify(data: bytes):
    return verify_manifest(data, TRUSTED, 1, now=NOW)


@given(st.binary(max_size=4096))
def test_fuzz_canonical_decoder_random_bytes(data):
    only_our_errors(_canonical.decode, data, max_size=1 << 20)


@given(msgpack_values())
def test_fuzz_canonical_decoder_any_msgpack(value):
    data = packb(value)
    got = only_our_errors(_canonical.decode, data, max_size=1 << 20)
    if not isinstance(got, ShardtoolError):
        assert _canonical.encode(got) == data  # accepted means canonical: one encoding per value


@given(st.binary(max_size=4096))
def test_fuzz_manifest_decoder_random_bytes(data):
    only_our_errors(decode_manifest, data)
    only_our_errors(_verify, data)


@given(mutated(SIGNED, max_ops=3))
def test_fuzz_manifest_decoder_mutated_signed(data):
    got = only_our_errors(_verify, data)
    if not isinstance(got, ShardtoolError):
        # Only the unsigned labels (key IDs) may differ; what is trusted may not.
        assert got.head == GENUINE.head and got.entries == GENUINE.entries
    only_our_errors(decode_manifest, data)


def _entry_like():
    fields = {"path": st.text(max_size=30) | st.binary(max_size=8) | INT64,
              "kind": st.sampled_from(["expert", "trunk", "config", "tokenizer", "other", "EXPERT", ""]) | INT64,
              "layer": st.none() | INT64, "expert": st.none() | INT64, "size": INT64 | st.none(),
              "digest": st.binary(max_size=40) | st.text(max_size=4)}
    return st.fixed_dictionaries(fields, optional={"extra": msgpack_values(4)})


@given(st.lists(_entry_like().map(lambda d: _canonical.encode(d)
                                  if "extra" not in d and isinstance(d["path"], str) else packb(d)), max_size=5),
       msgpack_values(8), st.sampled_from([FORMAT, "x"]), st.booleans())
def test_fuzz_manifest_decoder_manifest_shaped(raw_entries, head_noise, fmt, sign):
    """Documents with the right skeleton and hostile fields; sometimes with a genuine signature over a
    hostile head, so the decoder behind the signature check is reached too."""
    head = {"type": "shardtool/manifest-head", "format_version": 1, "model_id": "fuzz/model", "version": 1,
            "created": NOW, "expires": NOW + 10, "entry_count": len(raw_entries),
            "merkle_root": b"\x00" * 32, "hash_alg": "blake3", "contract": None}
    if isinstance(head_noise, dict):
        head.update({k: v for k, v in head_noise.items() if isinstance(k, str)})
    from shardtool.manifest._document import entries_root
    from shardtool.manifest._envelope import PAYLOAD_TYPE, pae
    head["merkle_root"] = entries_root(raw_entries)
    try:
        payload = _canonical.encode(head)
    except ShardtoolError:
        payload = packb(head)
    sigs = [{"keyid": KEY.public.keyid, "sig": KEY.sign(pae(PAYLOAD_TYPE, payload))}] if sign else []
    doc = {"entries": raw_entries, "envelope": {"payload": payload, "payloadType": PAYLOAD_TYPE, "signatures": sigs},
           "format": fmt}
    data = packb(dict(sorted(doc.items())))
    only_our_errors(_verify, data)
    only_our_errors(decode_manifest, data)


@given(msgpack_values(12))
def test_fuzz_manifest_decoder_any_structure(value):
    only_our_errors(_verify, packb(value))


@given(_entry_like())
def test_fuzz_entry_decoder(fields):
    raw = packb(dict(sorted(fields.items())))
    got = only_our_errors(decode_entry, raw, 0)
    if not isinstance(got, ShardtoolError):
        assert got.to_dict() == {k: v for k, v in fields.items() if k != "extra"}


def _same_verdict(raw: bytes) -> None:
    """The fast list decoder accepts exactly what the strict one-entry decoder accepts, as the same entry,
    and refuses the rest with the strict decoder's own message."""
    strict = only_our_errors(decode_entry, raw, 0)
    fast = only_our_errors(decode_entries, [raw])
    if isinstance(strict, ShardtoolError):
        assert isinstance(fast, ShardtoolError) and fast.message == strict.message
    else:
        assert fast == (strict,)


GENUINE_ENTRY = entry_bytes(GENUINE.entries[0])


@given(_entry_like(), st.booleans())
def test_fuzz_entry_list_decoder_agrees_on_fields(fields, canonical):
    plain = {k: v for k, v in fields.items() if k != "extra"}
    try:
        raw = _canonical.encode(plain) if canonical else packb(dict(sorted(fields.items())))
    except ShardtoolError:
        raw = packb(dict(sorted(fields.items())))
    _same_verdict(raw)


@given(mutated(GENUINE_ENTRY, max_ops=3))
def test_fuzz_entry_list_decoder_agrees_on_mutations(raw):
    _same_verdict(raw)


def _pairs(pairs) -> bytes:
    return msgpack.Packer().pack_map_header(len(pairs)) + b"".join(packb(k) + packb(v) for k, v in pairs)


_FIELDS = sorted(GENUINE.entries[0].to_dict().items())
NON_CANONICAL = {
    "keys-out-of-order": _pairs(list(reversed(_FIELDS))),
    "key-as-str8": GENUINE_ENTRY[:1] + b"\xd9\x06digest" + GENUINE_ENTRY[8:],
    "size-as-uint64": msgpack.Packer().pack_map_header(6) + b"".join(packb(k) + packb(v) for k, v in _FIELDS[:-1]) + packb("size")
    + b"\xcf" + GENUINE.entries[0].size.to_bytes(8, "big"),
}


@pytest.mark.parametrize("raw", NON_CANONICAL.values(), ids=NON_CANONICAL)
def test_entry_list_decoder_refuses_non_canonical_encodings(raw):
    assert msgpack.unpackb(raw) == msgpack.unpackb(GENUINE_ENTRY)  # the same entry, other bytes
    with pytest.raises(ShardtoolError, match="not in canonical msgpack form"):
        decode_entries([raw])


def _with_layer(raw_value: bytes) -> bytes:
    """The genuine entry with its `layer` value replaced by raw msgpack bytes."""
    fields = dict(_FIELDS)
    del fields["layer"]
    pairs = sorted([*fields.items(), ("layer", None)])
    return msgpack.Packer().pack_map_header(6) + b"".join(
        packb(k) + (raw_value if k == "layer" else packb(v)) for k, v in pairs)


REFUSED_BY_BOTH = {
    # A bytes key inside a value: msgpack's strict_map_key allows it, only the strict parser's hook refuses it.
    "bytes-key-in-a-value": (_with_layer(b"\x81\xc4\x00\xc0"), "map key b'' is not a string"),
    # A value nested 1,000 deep (msgpack allows 1,024): quoted in the message, it must not exhaust repr's recursion.
    "value-nested-1000-deep": (_with_layer(b"\x91" * 1000 + b"\xc0"), "layer must be an integer"),
}


@pytest.mark.parametrize("raw, message", REFUSED_BY_BOTH.values(), ids=REFUSED_BY_BOTH)
def test_both_entry_decoders_refuse_with_the_strict_message(raw, message):
    for decode in (lambda: decode_entry(raw, 0), lambda: decode_entries([raw])):
        with pytest.raises(ShardtoolError, match=re.escape(message)):
            decode()


def test_a_head_value_nested_deep_is_refused_not_a_crash():
    from shardtool.manifest._records import Head

    fields = {"type": "shardtool/manifest-head", "format_version": 1, "model_id": [[[[[[[[1]]]]]]]], "version": 1,
              "created": NOW, "expires": NOW + 10, "entry_count": 0, "merkle_root": b"\x00" * 32,
              "hash_alg": "blake3", "contract": None}
    deep = msgpack.unpackb(b"\x91" * 1000 + b"\xc0")
    for name in ("model_id", "hash_alg"):
        with pytest.raises(ShardtoolError, match=name):
            Head.from_dict({**fields, "model_id": "fuzz/model", name: deep})
    with pytest.raises(ShardtoolError, match="contract value"):
        Head.from_dict({**fields, "model_id": "fuzz/model", "contract": {"total_bytes": deep}})


def test_entry_list_decoder_refuses_a_duplicate_key_by_name():
    """A key twice is the one flaw the fast path does not parse for (the map it builds holds the key once):
    its re-encoding differs, and the strict decoder names it."""
    pairs = sorted(GENUINE.entries[0].to_dict().items()) + [("size", GENUINE.entries[0].size)]
    raw = msgpack.Packer().pack_map_header(len(pairs)) + b"".join(packb(k) + packb(v) for k, v in sorted(pairs))
    with pytest.raises(ShardtoolError, match="duplicate map key 'size'"):
        decode_entries([GENUINE_ENTRY, raw])


@given(msgpack_values(10))
def test_fuzz_envelope_from_any_structure(value):
    env = only_our_errors(Envelope.from_dict, value)
    if not isinstance(env, ShardtoolError):
        only_our_errors(verify_envelope, env, TRUSTED, 1)


@given(st.text(max_size=300), st.binary(max_size=300),
       st.lists(st.fixed_dictionaries({"keyid": st.text(max_size=70) | INT64, "sig": st.binary(max_size=70)}),
                max_size=4),
       st.integers(-2, 3))
def test_fuzz_envelope_fields(payload_type, payload, signatures, threshold):
    env = only_our_errors(Envelope.from_dict, {"payloadType": payload_type, "payload": payload,
                                               "signatures": signatures})
    if not isinstance(env, ShardtoolError):
        only_our_errors(verify_envelope, env, TRUSTED, threshold)
