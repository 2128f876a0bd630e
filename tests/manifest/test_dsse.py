"""DSSE: the PAE vector byte for byte, the protocol's ECDSA envelope verified against our PAE, and the
envelope/signature records and threshold verification shardtool builds on them."""

from __future__ import annotations

import base64

import pytest
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from shardtool.errors import ManifestFormatError, SignatureError, ThresholdError, TrustSettingsError
from shardtool.manifest import PAYLOAD_TYPE, Envelope, Signature, pae, verify_envelope
from shardtool.manifest._envelope import MAX_PAYLOAD, MAX_SIGNATURES

FILE = "dsse_pae.json"


def _pae_vectors(data):
    return [(v["payloadType"], v) for v in data["pae_vectors"]]


@pytest.mark.vectors(FILE, "vector", _pae_vectors)
def test_pae_vector_byte_exact(vector):
    payload = bytes.fromhex(vector["payload_hex"])
    assert payload == vector["payload_utf8"].encode()
    out = pae(vector["payloadType"], payload)
    assert out == bytes.fromhex(vector["pae_hex"])
    assert out == vector["pae_utf8"].encode()


PAE_CASES = {
    "empty": ("", b"", b"DSSEv1 0  0 "),
    "lengths-are-bytes-not-chars": ("\u00e9", b"\xff", b"DSSEv1 2 \xc3\xa9 1 \xff"),
    "ten-byte-length-no-padding": ("t", b"0123456789", b"DSSEv1 1 t 10 0123456789"),
    "body-with-spaces": ("a b", b"c d", b"DSSEv1 3 a b 3 c d"),
}


@pytest.mark.parametrize("payload_type,payload,expected", PAE_CASES.values(), ids=PAE_CASES.keys())
def test_pae_definition(payload_type, payload, expected):
    assert pae(payload_type, payload) == expected


def test_pae_is_injective_where_naive_concatenation_is_not():
    assert pae("ab", b"c") != pae("a", b"bc")
    assert pae("a 1 b", b"") != pae("a", b"b")


def _envelopes(data):
    for v in data["envelope_vectors"]:
        for which in ("envelope_protocol_md", "envelope_signing_spec_py"):
            yield f"{v['name']}-{which}", (v, v[which])


def _p256(key):
    assert key["curve"] == "P-256"
    public = ec.EllipticCurvePublicNumbers(int(key["x"]), int(key["y"]), ec.SECP256R1()).public_key()
    return public, ec.derive_private_key(int(key["d"]), ec.SECP256R1())


def _verify_raw(public, raw_sig: bytes, message: bytes) -> None:
    assert len(raw_sig) == 64
    der = encode_dss_signature(int.from_bytes(raw_sig[:32], "big"), int.from_bytes(raw_sig[32:], "big"))
    public.verify(der, message, ec.ECDSA(hashes.SHA256()))


@pytest.mark.vectors(FILE, "case", _envelopes)
def test_protocol_ecdsa_envelope_verifies_over_our_pae(case):
    vector, envelope = case
    public, private = _p256(vector["key"])
    assert private.public_key().public_numbers() == public.public_numbers()
    payload = base64.b64decode(envelope["payload"])
    assert payload == vector["payload_utf8"].encode() and envelope["payloadType"] == vector["payloadType"]
    sig = base64.b64decode(envelope["signatures"][0]["sig"])
    _verify_raw(public, sig, pae(envelope["payloadType"], payload))

    tampered = {
        "payload": (envelope["payloadType"], payload + b"!", sig),
        "payload-bit": (envelope["payloadType"], b"hello World", sig),
        "payloadType": (envelope["payloadType"] + "2", payload, sig),
        "payloadType-case": (envelope["payloadType"].upper(), payload, sig),
        "sig-r": (envelope["payloadType"], payload, bytes([sig[0] ^ 1]) + sig[1:]),
        "sig-s": (envelope["payloadType"], payload, sig[:63] + bytes([sig[63] ^ 1])),
        "sig-r-s-swapped": (envelope["payloadType"], payload, sig[32:] + sig[:32]),
    }
    for name, (payload_type, body, signature) in tampered.items():
        with pytest.raises(InvalidSignature):
            _verify_raw(public, signature, pae(payload_type, body))
    # Signing without PAE (the bare payload) is not what was signed either.
    with pytest.raises(InvalidSignature):
        _verify_raw(public, sig, payload)


def _has_deterministic_ecdsa() -> bool:
    try:
        ec.derive_private_key(1, ec.SECP256R1()).sign(b"", ec.ECDSA(hashes.SHA256(), deterministic_signing=True))
    except (TypeError, UnsupportedAlgorithm):  # cryptography < 43, or built against OpenSSL < 3.2
        return False
    return True


@pytest.mark.skipif(not _has_deterministic_ecdsa(), reason="cryptography lacks deterministic (RFC 6979) ECDSA")
@pytest.mark.vectors(FILE, "case", _envelopes)
def test_protocol_signature_is_the_rfc6979_one(case):
    vector, envelope = case
    _, private = _p256(vector["key"])
    der = private.sign(pae(envelope["payloadType"], base64.b64decode(envelope["payload"])),
                       ec.ECDSA(hashes.SHA256(), deterministic_signing=True))
    r, s = decode_dss_signature(der)
    assert r.to_bytes(32, "big") + s.to_bytes(32, "big") == base64.b64decode(envelope["signatures"][0]["sig"])


# --- shardtool's envelope records ----------------------------------------------------------------------------

SIG = b"\x01" * 64
BAD_SIGNATURES = {
    "keyid-empty": dict(keyid=""),
    "keyid-uppercase": dict(keyid="ABCD"),
    "keyid-non-hex": dict(keyid="xyz"),
    "keyid-65-chars": dict(keyid="a" * 65),
    "keyid-bytes": dict(keyid=b"abcd"),
    "keyid-trailing-newline": dict(keyid="abcd\n"),
    "sig-63-bytes": dict(sig=SIG[:63]),
    "sig-65-bytes": dict(sig=SIG + b"\x00"),
    "sig-str": dict(sig=SIG.hex()),
    "sig-none": dict(sig=None),
}


@pytest.mark.parametrize("changes", BAD_SIGNATURES.values(), ids=BAD_SIGNATURES.keys())
def test_signature_record_refuses(changes, raises_exactly):
    with raises_exactly(ManifestFormatError):
        Signature(**{"keyid": "abcd", "sig": SIG, **changes})


BAD_ENVELOPE_DICTS = {
    "not-a-map": [],
    "missing-signatures": {"payloadType": PAYLOAD_TYPE, "payload": b"x"},
    "unknown-field": {"payloadType": PAYLOAD_TYPE, "payload": b"x", "signatures": [], "extra": 1},
    "payload-type-empty": {"payloadType": "", "payload": b"x", "signatures": []},
    "payload-type-too-long": {"payloadType": "a" * 257, "payload": b"x", "signatures": []},
    "payload-type-bytes": {"payloadType": PAYLOAD_TYPE.encode(), "payload": b"x", "signatures": []},
    "payload-str": {"payloadType": PAYLOAD_TYPE, "payload": "x", "signatures": []},
    "payload-too-big": {"payloadType": PAYLOAD_TYPE, "payload": b"x" * (MAX_PAYLOAD + 1), "signatures": []},
    "signatures-map": {"payloadType": PAYLOAD_TYPE, "payload": b"x", "signatures": {}},
    "signature-not-a-map": {"payloadType": PAYLOAD_TYPE, "payload": b"x", "signatures": [SIG]},
    "signature-missing-keyid": {"payloadType": PAYLOAD_TYPE, "payload": b"x", "signatures": [{"sig": SIG}]},
    "signature-unknown-field": {"payloadType": PAYLOAD_TYPE, "payload": b"x",
                                "signatures": [{"keyid": "ab", "sig": SIG, "alg": "ed25519"}]},
    "too-many-signatures": {"payloadType": PAYLOAD_TYPE, "payload": b"x",
                            "signatures": [{"keyid": "ab", "sig": SIG}] * (MAX_SIGNATURES + 1)},
}


@pytest.mark.parametrize("raw", BAD_ENVELOPE_DICTS.values(), ids=BAD_ENVELOPE_DICTS.keys())
def test_envelope_from_dict_refuses(raw, raises_exactly):
    with raises_exactly(ManifestFormatError):
        Envelope.from_dict(raw)


def test_envelope_round_trip_and_signed_by_replaces_own_signature(ed25519_keys):
    a, b = ed25519_keys[:2]
    env = Envelope(PAYLOAD_TYPE, b"payload").signed_by(a).signed_by(b).signed_by(a)
    assert [s.keyid for s in env.signatures] == [b.public.keyid, a.public.keyid]
    assert Envelope.from_dict(env.to_dict()) == env
    a.public.verify(env.signatures[1].sig, pae(PAYLOAD_TYPE, b"payload"))


# --- verify_envelope ----------------------------------------------------------------------------------------


def _signed(keys, payload=b"head", payload_type=PAYLOAD_TYPE):
    env = Envelope(payload_type, payload)
    for k in keys:
        env = env.signed_by(k)
    return env


def _corrupt(sig: Signature) -> Signature:
    return Signature(sig.keyid, bytes([sig.sig[0] ^ 0x80]) + sig.sig[1:])


def test_threshold_counts_distinct_trusted_keys(ed25519_keys):
    a, b, c = ed25519_keys[:3]
    env = _signed([a, b, c])
    payload, signers = verify_envelope(env, [a.public, b.public, c.public], 3)
    assert payload == b"head" and set(signers) == {a.public, b.public, c.public}
    # Signatures by untrusted keys are ignored, not fatal.
    payload, signers = verify_envelope(env, [b.public], 1)
    assert signers == (b.public,)


def _dup_same_keyid(keys):
    a = keys[0]
    sig = _signed([a]).signatures[0]
    return Envelope(PAYLOAD_TYPE, b"head", (sig, sig))


def _dup_other_keyid(keys):
    a, b = keys[:2]
    sig = _signed([a]).signatures[0]
    return Envelope(PAYLOAD_TYPE, b"head", (sig, Signature(b.public.keyid, sig.sig)))


def _one_corrupted(keys):
    env = _signed(keys[:2])
    return Envelope(PAYLOAD_TYPE, b"head", (env.signatures[0], _corrupt(env.signatures[1])))


def _keyid_lies(keys):
    # c signs but claims to be a; the keyid is a label and must not make a's trust flow to c.
    a, c = keys[0], keys[2]
    sig = _signed([c]).signatures[0]
    return Envelope(PAYLOAD_TYPE, b"head", (Signature(a.public.keyid, sig.sig),))


VERIFY_CASES = {
    # name: (envelope builder, trusted key indices, threshold, expected error)
    "unsigned": (lambda k: Envelope(PAYLOAD_TYPE, b"head"), [0], 1, SignatureError),
    "untrusted-signer": (lambda k: _signed([k[1]]), [0], 1, SignatureError),
    "keyid-claims-a-trusted-key": (_keyid_lies, [0], 1, SignatureError),
    "corrupted-only-signature": (lambda k: Envelope(PAYLOAD_TYPE, b"head", (_corrupt(_signed([k[0]]).signatures[0]),)),
                                 [0], 1, SignatureError),
    "signature-over-other-payload": (lambda k: Envelope(PAYLOAD_TYPE, b"other", _signed([k[0]]).signatures),
                                     [0], 1, SignatureError),
    "signature-over-other-type": (lambda k: Envelope("x/y", b"head", _signed([k[0]]).signatures), [0], 1,
                                  SignatureError),
    "one-of-two-corrupted": (_one_corrupted, [0, 1], 2, ThresholdError),
    "one-key-twice-same-keyid": (_dup_same_keyid, [0, 1], 2, ThresholdError),
    "one-key-twice-two-keyids": (_dup_other_keyid, [0, 1], 2, ThresholdError),
    "trusted-key-listed-twice": (lambda k: _signed([k[0]]), [0, 0, 1], 2, ThresholdError),
    "two-of-three-needed-one-given": (lambda k: _signed([k[2]]), [0, 1, 2], 2, ThresholdError),
    "wrong-payload-type-signed": (lambda k: _signed([k[0]], payload_type="application/json"), [0], 1,
                                  ManifestFormatError),
    "wrong-payload-type-unsigned": (lambda k: Envelope("application/json", b"head"), [0], 1, SignatureError),
    "wrong-payload-type-untrusted": (lambda k: _signed([k[1]], payload_type="application/json"), [0], 1,
                                     SignatureError),
    "wrong-payload-type-under-threshold": (lambda k: _signed([k[0]], payload_type="application/json"), [0, 1], 2,
                                           ThresholdError),
    "no-trusted-keys": (lambda k: _signed([k[0]]), [], 1, TrustSettingsError),
    "threshold-zero": (lambda k: _signed([k[0]]), [0], 0, TrustSettingsError),
    "threshold-above-distinct-keys": (lambda k: _signed([k[0]]), [0, 0], 2, TrustSettingsError),
    "threshold-bool": (lambda k: _signed([k[0]]), [0], True, TrustSettingsError),
}


@pytest.mark.parametrize("build,trusted,threshold,error", VERIFY_CASES.values(), ids=VERIFY_CASES.keys())
def test_verify_envelope_refuses(build, trusted, threshold, error, ed25519_keys, raises_exactly):
    env = build(ed25519_keys)
    with raises_exactly(error):
        verify_envelope(env, [ed25519_keys[i].public for i in trusted], threshold)


ACCEPT_CASES = {
    "one-of-one": (lambda k: _signed([k[0]]), [0], 1, {0}),
    "trusted-key-listed-twice-threshold-1": (lambda k: _signed([k[0]]), [0, 0], 1, {0}),
    "one-key-twice-threshold-1": (_dup_other_keyid, [0, 1], 1, {0}),
    "one-of-two-corrupted-threshold-1": (_one_corrupted, [0, 1], 1, {0}),
    "extra-untrusted-and-garbage-signatures": (
        lambda k: Envelope(PAYLOAD_TYPE, b"head", _signed([k[3], k[0]]).signatures + (Signature("00", b"\x00" * 64),)),
        [0], 1, {0}),
    "two-of-three": (lambda k: _signed([k[2], k[0]]), [0, 1, 2], 2, {0, 2}),
}


@pytest.mark.parametrize("build,trusted,threshold,signers", ACCEPT_CASES.values(), ids=ACCEPT_CASES.keys())
def test_verify_envelope_accepts(build, trusted, threshold, signers, ed25519_keys):
    payload, got = verify_envelope(build(ed25519_keys), [ed25519_keys[i].public for i in trusted], threshold)
    assert payload == b"head"
    assert sorted(k.raw for k in got) == sorted(ed25519_keys[i].public.raw for i in signers)
