"""The manifest document: build/encode/decode round trips, and verify_manifest refusing each kind of lie
with its exact error class."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtool.errors import (
    ExpiredError,
    ManifestFormatError,
    MerkleProofError,
    SignatureError,
    ThresholdError,
    TrustSettingsError,
)
from shardtool.manifest import (
    PAYLOAD_TYPE,
    Entry,
    Manifest,
    build_manifest,
    decode_manifest,
    entry_bytes,
    verify_manifest,
)
from shardtool.manifest import _canonical
from shardtool.manifest._document import CLOCK_SKEW, DAY, FORMAT, MAX_ENTRY_BYTES, head_digest
from shardtool.manifest._merkle import blake3_256, inclusion_proof, leaf_hash, verify_inclusion
from shardtool.manifest._records import MAX_EXPERT, MAX_LAYER


def _sign(manifest: Manifest, *keys) -> Manifest:
    env = manifest.envelope
    for k in keys:
        env = env.signed_by(k)
    return manifest.with_envelope(env)


@pytest.fixture
def entries(make_entry):
    return [
        make_entry("config.json", "config", 120),
        make_entry("tokenizer.json", "tokenizer", 4000),
        make_entry("trunk/layer-00.safetensors", "trunk", 1 << 20, layer=0),
        make_entry("experts/l00/e000.safetensors", "expert", 1 << 16, layer=0, expert=0),
        make_entry("experts/l00/e001.safetensors", "expert", 1 << 16, layer=0, expert=1),
        make_entry("README.md", "other", 7),
    ]


@pytest.fixture
def built(entries, now):
    return build_manifest(entries, model_id="acme/moe-tiny", version=4, expires_in_days=30,
                          contract={"ram_bytes": 1 << 30}, now=now)


# --- build / encode / decode --------------------------------------------------------------------------------


def test_build_encode_decode_round_trip(built, entries, now):
    assert [e.path for e in built.entries] == sorted(e.path for e in entries)
    assert (built.head.version, built.head.created, built.head.expires) == (4, now, now + 30 * DAY)
    assert built.head.entry_count == len(entries) and dict(built.head.contract) == {"ram_bytes": 1 << 30}
    wire = built.to_bytes()
    again = decode_manifest(wire)
    assert again == built
    assert again.to_bytes() == wire


def test_signed_round_trip_verifies(built, ed25519_keys, now):
    a, b = ed25519_keys[:2]
    wire = _sign(built, a, b).to_bytes()
    verified = verify_manifest(wire, [a.public, b.public], 2, now=now)
    assert verified.head == built.head and verified.entries == built.entries
    assert set(verified.signers) == {a.public, b.public}
    assert verified.by_path()["config.json"].kind == "config"
    assert decode_manifest(wire).to_bytes() == wire


def test_input_order_does_not_change_the_bytes(entries, now):
    shuffled = list(entries)
    random.Random(7).shuffle(shuffled)
    one = build_manifest(entries, model_id="m", now=now).to_bytes()
    two = build_manifest(shuffled, model_id="m", now=now).to_bytes()
    assert one == two


def test_entries_sort_by_utf8_bytes(make_entry, now):
    paths = ["\U0001f600.bin", "\ufffd.bin", "a.bin", "\u00e9.bin", "Z.bin", "a/b.bin", "a.bin2"]
    m = build_manifest([make_entry(p) for p in paths], model_id="m", now=now)
    assert [e.path for e in m.entries] == sorted(paths, key=lambda p: p.encode("utf-8"))
    assert [e.path for e in m.entries][:3] == ["Z.bin", "a.bin", "a.bin2"]


def test_single_entry_is_authenticated_alone_by_its_inclusion_proof(built, make_entry):
    leaves = [leaf_hash(blake3_256, entry_bytes(e)) for e in built.entries]
    for i, entry in enumerate(built.entries):
        proof = inclusion_proof(blake3_256, leaves, i)
        verify_inclusion(blake3_256, i, built.head.entry_count, leaf_hash(blake3_256, entry_bytes(entry)), proof,
                         built.head.merkle_root)
    forged = make_entry(built.entries[2].path, built.entries[2].kind, built.entries[2].size + 1,
                        layer=built.entries[2].layer, expert=built.entries[2].expert)
    with pytest.raises(MerkleProofError):
        verify_inclusion(blake3_256, 2, built.head.entry_count, leaf_hash(blake3_256, entry_bytes(forged)),
                         inclusion_proof(blake3_256, leaves, 2), built.head.merkle_root)


def test_empty_manifest_round_trips(now, ed25519_keys):
    m = _sign(build_manifest([], model_id="empty", now=now), ed25519_keys[0])
    assert verify_manifest(m.to_bytes(), [ed25519_keys[0].public], 1, now=now).entries == ()


BAD_BUILDS = {
    "duplicate-path": (lambda e: e + [e[0]], {}),
    "duplicate-path-other-content": (lambda e: e + [Entry(e[0].path, "other", 1, b"\x00" * 32)], {}),
    "expires-in-zero-days": (lambda e: e, {"expires_in_days": 0}),
    "expires-in-too-many-days": (lambda e: e, {"expires_in_days": 36501}),
    "expires-in-bool": (lambda e: e, {"expires_in_days": True}),
    "expires-in-float": (lambda e: e, {"expires_in_days": 1.5}),
    "model-id-empty": (lambda e: e, {"model_id": ""}),
    "version-zero": (lambda e: e, {"version": 0}),
    "contract-bad-key": (lambda e: e, {"contract": {"Bad": 1}}),
    "now-negative": (lambda e: e, {"now": -1}),
}


@pytest.mark.parametrize("mutate,kwargs", BAD_BUILDS.values(), ids=BAD_BUILDS.keys())
def test_build_refuses(mutate, kwargs, entries, now, raises_exactly):
    args = {"model_id": "m", "now": now, **kwargs}
    with raises_exactly(ManifestFormatError):
        build_manifest(mutate(list(entries)), **args)


# --- property: random valid entry sets ----------------------------------------------------------------------

_segment = st.text(alphabet="abcXYZ019_-.\u00e9\u6a21", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))
_path = st.lists(_segment, min_size=1, max_size=4).map("/".join)
_layer = st.integers(0, MAX_LAYER)


@st.composite
def _entry(draw, path):
    kind = draw(st.sampled_from(["expert", "trunk", "config", "tokenizer", "other"]))
    layer = draw(_layer) if kind == "expert" else draw(st.none() | _layer) if kind == "trunk" else None
    expert = draw(st.integers(0, MAX_EXPERT)) if kind == "expert" else None
    return Entry(path=path, kind=kind, size=draw(st.integers(0, 2**50)), digest=draw(st.binary(min_size=32, max_size=32)),
                 layer=layer, expert=expert)


_entry_sets = st.lists(_path, max_size=25, unique_by=lambda p: p.encode()).flatmap(
    lambda paths: st.tuples(*[_entry(p) for p in paths]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_entry_sets, st.integers(1, 2**40), st.randoms())
def test_property_random_entry_sets_round_trip(entries, version, rnd):
    keys = _PROPERTY_KEYS
    m = build_manifest(entries, model_id="acme/prop", version=version, now=1_750_000_000)
    wire = _sign(m, keys[0]).to_bytes()
    decoded = decode_manifest(wire)
    assert decoded.entries == tuple(sorted(entries, key=lambda e: e.path.encode()))
    assert decoded.to_bytes() == wire
    verified = verify_manifest(wire, [keys[0].public], 1, now=1_750_000_000)
    assert verified.entries == decoded.entries and verified.head.version == version
    shuffled = list(entries)
    rnd.shuffle(shuffled)
    assert _sign(build_manifest(shuffled, model_id="acme/prop", version=version, now=1_750_000_000),
                 keys[0]).to_bytes() == wire


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_property_single_byte_changes_never_slip_through(data):
    """Flip one byte anywhere: the result is refused with a verification error of the format, signature or
    Merkle kind, or (only where the byte is an unsigned label such as a keyid) verifies to the very same
    head and entries. Never another exception type, never a different accepted manifest."""
    wire = _PROPERTY_WIRE
    i = data.draw(st.integers(0, len(wire) - 1), label="offset")
    x = data.draw(st.integers(1, 255), label="xor")
    mutated = wire[:i] + bytes([wire[i] ^ x]) + wire[i + 1:]
    try:
        v = verify_manifest(mutated, [_PROPERTY_KEYS[0].public], 1, now=1_750_000_000)
    except (ManifestFormatError, SignatureError, MerkleProofError):
        return
    assert head_digest(v.head) == head_digest(_PROPERTY_ORIGINAL.head) and v.entries == _PROPERTY_ORIGINAL.entries


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_property_truncation_is_a_format_error(data):
    cut = data.draw(st.integers(0, len(_PROPERTY_WIRE) - 1))
    with pytest.raises(ManifestFormatError):
        verify_manifest(_PROPERTY_WIRE[:cut], [_PROPERTY_KEYS[0].public], 1, now=1_750_000_000)


def _property_fixtures():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardtool.keys import PrivateKey

    keys = [PrivateKey(Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32)) for i in (1, 2)]
    entries = [Entry(f"experts/l{i // 4}/e{i % 4}.bin", "expert", 100 + i, blake3_256(bytes([i])), layer=i // 4,
                     expert=i % 4) for i in range(8)] + [Entry("config.json", "config", 5, blake3_256(b"c"))]
    m = _sign(build_manifest(entries, model_id="acme/prop", version=2, now=1_750_000_000), keys[0])
    return keys, m, m.to_bytes()


_PROPERTY_KEYS, _PROPERTY_ORIGINAL, _PROPERTY_WIRE = _property_fixtures()


# --- verify_manifest: refusals ------------------------------------------------------------------------------


def _corrupt_sig(sig: dict) -> dict:
    flipped = sig["sig"][:5] + bytes([sig["sig"][5] ^ 1]) + sig["sig"][6:]
    return {"keyid": sig["keyid"], "sig": flipped}


def _rewrite(wire: bytes, fn) -> bytes:
    """Decode the outer document, let `fn` change it (entries stay raw bytes), re-encode canonically."""
    doc = _canonical.decode(wire, max_size=1 << 28)
    fn(doc)
    return _canonical.encode(doc)


class Ctx:
    """What a case builder gets: keys, a built manifest's entries and a forger (see conftest)."""

    def __init__(self, keys, entries, forge, raw_entry, now):
        self.k, self.entries, self.forge, self.raw_entry, self.now = keys, entries, forge, raw_entry, now
        self.sorted = sorted(entries, key=lambda e: e.path.encode())
        self.raw = [entry_bytes(e) for e in self.sorted]

    def built(self, *signers, **kw):
        args = {"model_id": "acme/moe-tiny", "version": 4, "now": self.now, **kw}
        return _sign(build_manifest(self.entries, **args), *signers).to_bytes()


def _with_signatures(ctx, sigs_fn, *signers):
    return _rewrite(ctx.built(*signers), lambda d: d["envelope"].update(signatures=sigs_fn(d["envelope"]["signatures"])))


def _entries_changed(ctx, fn):
    return _rewrite(ctx.built(ctx.k[0]), lambda d: d.update(entries=fn(list(d["entries"]))))


REFUSALS = {
    # name: (builder(ctx) -> bytes, trusted key indices, threshold, now offset from ctx.now, error)
    "unsigned": (lambda c: c.built(), [0], 1, 0, SignatureError),
    "untrusted-key": (lambda c: c.built(c.k[1]), [0], 1, 0, SignatureError),
    "signature-bit-flipped": (lambda c: _with_signatures(c, lambda s: [_corrupt_sig(s[0])], c.k[0]), [0], 1, 0,
                              SignatureError),
    "one-of-two-corrupted-threshold-2": (
        lambda c: _with_signatures(c, lambda s: [s[0], _corrupt_sig(s[1])], c.k[0], c.k[1]), [0, 1], 2, 0,
        ThresholdError),
    "one-key-signed-twice-same-keyid": (lambda c: _with_signatures(c, lambda s: [s[0], s[0]], c.k[0]), [0, 1], 2, 0,
                                        ThresholdError),
    "one-key-signed-twice-two-keyids": (
        lambda c: _with_signatures(c, lambda s: [s[0], {"keyid": c.k[1].public.keyid, "sig": s[0]["sig"]}], c.k[0]),
        [0, 1], 2, 0, ThresholdError),
    "trusted-key-passed-twice": (lambda c: c.built(c.k[0]), [0, 0, 1], 2, 0, ThresholdError),
    "trusted-key-passed-twice-only-key": (lambda c: c.built(c.k[0]), [0, 0], 2, 0, TrustSettingsError),
    "wrong-payload-type-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], payload_type="application/vnd.in-toto+json"),
                                  [0], 1, 0, ManifestFormatError),
    "wrong-payload-type-unsigned": (lambda c: c.forge(c.raw, payload_type="application/vnd.in-toto+json"), [0], 1, 0,
                                    SignatureError),
    "wrong-payload-type-untrusted": (lambda c: c.forge(c.raw, signers=[c.k[1]], payload_type="text/plain"), [0], 1, 0,
                                     SignatureError),
    "entry-dropped": (lambda c: _entries_changed(c, lambda e: e[:-1]), [0], 1, 0, MerkleProofError),
    "entry-added": (lambda c: _entries_changed(c, lambda e: e + [c.raw_entry(path="zzz.bin")]), [0], 1, 0,
                    MerkleProofError),
    "entry-size-changed": (lambda c: _entries_changed(c, lambda e: [c.raw_entry(path=c.sorted[0].path, kind="config",
                                                                                size=c.sorted[0].size + 1,
                                                                                digest=c.sorted[0].digest)] + e[1:]),
                           [0], 1, 0, MerkleProofError),
    "entry-digest-changed": (lambda c: _entries_changed(c, lambda e: e[:-1] + [
        entry_bytes(Entry(c.sorted[-1].path, c.sorted[-1].kind, c.sorted[-1].size, b"\x00" * 32,
                          c.sorted[-1].layer, c.sorted[-1].expert))]), [0], 1, 0, MerkleProofError),
    "entries-swapped": (lambda c: _entries_changed(c, lambda e: [e[1], e[0]] + e[2:]), [0], 1, 0, MerkleProofError),
    "entries-reversed": (lambda c: _entries_changed(c, lambda e: e[::-1]), [0], 1, 0, MerkleProofError),
    "entry-replaced-same-count": (lambda c: _entries_changed(c, lambda e: e[:-1] + [c.raw_entry(path="zzz.bin")]),
                                  [0], 1, 0, MerkleProofError),
    "entry-not-msgpack-same-count": (lambda c: _entries_changed(c, lambda e: e[:-1] + [b"\xc1"]), [0], 1, 0,
                                     MerkleProofError),
    "count-claims-one-more": (lambda c: c.forge(c.raw, signers=[c.k[0]], entry_count=len(c.raw) + 1), [0], 1, 0,
                              MerkleProofError),
    "count-claims-one-less": (lambda c: c.forge(c.raw, signers=[c.k[0]], entry_count=len(c.raw) - 1), [0], 1, 0,
                              MerkleProofError),
    "root-of-other-entries": (lambda c: c.forge(c.raw[1:] + [c.raw_entry(path="zzz.bin")], signers=[c.k[0]],
                                                merkle_root=_root(c.raw)), [0], 1, 0, MerkleProofError),
    "unsorted-entries-signed": (lambda c: c.forge([c.raw[1], c.raw[0]] + c.raw[2:], signers=[c.k[0]]), [0], 1, 0,
                                ManifestFormatError),
    "duplicate-entries-signed": (lambda c: c.forge(c.raw + [c.raw[-1]], signers=[c.k[0]]), [0], 1, 0,
                                 ManifestFormatError),
    "duplicate-path-signed": (lambda c: c.forge([c.raw_entry(path="a.bin", size=1), c.raw_entry(path="a.bin", size=2)],
                                                signers=[c.k[0]]), [0], 1, 0, ManifestFormatError),
    "entry-unknown-field-signed": (lambda c: c.forge([c.raw_entry(mode=420)], signers=[c.k[0]]), [0], 1, 0,
                                   ManifestFormatError),
    "entry-missing-field-signed": (lambda c: c.forge([c.raw_entry(layer=...)], signers=[c.k[0]]), [0], 1, 0,
                                   ManifestFormatError),
    "entry-digest-as-str-signed": (lambda c: c.forge([c.raw_entry(digest="11" * 32)], signers=[c.k[0]]), [0], 1, 0,
                                   ManifestFormatError),
    "entry-size-as-bool-signed": (lambda c: c.forge([c.raw_entry(size=True)], signers=[c.k[0]]), [0], 1, 0,
                                  ManifestFormatError),
    "entry-non-canonical-signed": (lambda c: c.forge([c.raw_entry()[:1] + b"\xd9\x06digest" + c.raw_entry()[8:]],
                                                     signers=[c.k[0]]), [0], 1, 0, ManifestFormatError),
    "entry-trailing-byte-signed": (lambda c: c.forge([c.raw_entry() + b"\x00"], signers=[c.k[0]]), [0], 1, 0,
                                   ManifestFormatError),
    "expert-without-index-signed": (lambda c: c.forge([c.raw_entry(kind="expert", layer=1)], signers=[c.k[0]]),
                                    [0], 1, 0, ManifestFormatError),
    "head-unknown-field-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], note="hi"), [0], 1, 0,
                                  ManifestFormatError),
    "head-missing-field-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], contract=...), [0], 1, 0,
                                  ManifestFormatError),
    "head-wrong-type-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], type="in-toto"), [0], 1, 0,
                               ManifestFormatError),
    "head-format-version-2-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], format_version=2), [0], 1, 0,
                                     ManifestFormatError),
    "head-hash-alg-sha256-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], hash_alg="sha256"), [0], 1, 0,
                                    ManifestFormatError),
    "head-version-zero-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], version=0), [0], 1, 0,
                                 ManifestFormatError),
    "head-version-bool-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], version=True), [0], 1, 0,
                                 ManifestFormatError),
    "head-non-canonical-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]],
                                                    payload=_unsorted_head(c)), [0], 1, 0, ManifestFormatError),
    "head-not-msgpack-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], payload=b"{\"version\": 4}"), [0], 1, 0,
                                ManifestFormatError),
    "head-is-a-list-signed": (lambda c: c.forge(c.raw, signers=[c.k[0]], payload=_canonical.encode([1])), [0], 1, 0,
                              ManifestFormatError),
    "expired-exactly-now": (lambda c: c.built(c.k[0], expires_in_days=1), [0], 1, DAY, ExpiredError),
    "expired-long-ago": (lambda c: c.built(c.k[0], expires_in_days=1), [0], 1, 400 * DAY, ExpiredError),
    "created-in-the-future": (lambda c: c.built(c.k[0]), [0], 1, -CLOCK_SKEW - 1, ExpiredError),
    "expired-and-under-threshold": (lambda c: c.built(c.k[0], expires_in_days=1), [0, 1], 2, 2 * DAY, ThresholdError),
}


def _root(raw):
    from shardtool.manifest._document import entries_root

    return entries_root(raw)


def _unsorted_head(c) -> bytes:
    import msgpack

    from shardtool.manifest._records import HEAD_TYPE

    d = {"version": 4, "type": HEAD_TYPE, "format_version": 1, "model_id": "acme/moe-tiny", "created": c.now,
         "expires": c.now + DAY, "entry_count": len(c.raw), "merkle_root": _root(c.raw), "hash_alg": "blake3",
         "contract": None}
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("build,trusted,threshold,offset,error", REFUSALS.values(), ids=REFUSALS.keys())
def test_verify_manifest_refuses(build, trusted, threshold, offset, error, ed25519_keys, entries, forge, raw_entry,
                                 now, raises_exactly):
    ctx = Ctx(ed25519_keys, entries, forge, raw_entry, now)
    data = build(ctx)
    with raises_exactly(error):
        verify_manifest(data, [ed25519_keys[i].public for i in trusted], threshold, now=now + offset)


ACCEPTS = {
    # name: (builder, trusted, threshold, now offset)
    "plain": (lambda c: c.built(c.k[0]), [0], 1, 0),
    "forged-equals-built": (lambda c: c.forge(c.raw, signers=[c.k[0]], version=4, expires=c.now + 365 * DAY), [0], 1, 0),
    "one-second-before-expiry": (lambda c: c.built(c.k[0], expires_in_days=1), [0], 1, DAY - 1),
    "created-within-clock-skew": (lambda c: c.built(c.k[0]), [0], 1, -CLOCK_SKEW),
    "trusted-key-passed-twice-threshold-1": (lambda c: c.built(c.k[0]), [0, 0], 1, 0),
    "two-of-three": (lambda c: c.built(c.k[2], c.k[1]), [0, 1, 2], 2, 0),
    "untrusted-extra-signature": (lambda c: c.built(c.k[3], c.k[0]), [0], 1, 0),
    "keyid-label-is-not-consulted": (
        lambda c: _with_signatures(c, lambda s: [{"keyid": "0" * 32, "sig": s[0]["sig"]}], c.k[0]), [0], 1, 0),
}


@pytest.mark.parametrize("build,trusted,threshold,offset", ACCEPTS.values(), ids=ACCEPTS.keys())
def test_verify_manifest_accepts(build, trusted, threshold, offset, ed25519_keys, entries, forge, raw_entry, now):
    ctx = Ctx(ed25519_keys, entries, forge, raw_entry, now)
    verified = verify_manifest(build(ctx), [ed25519_keys[i].public for i in trusted], threshold, now=now + offset)
    assert verified.entries == tuple(ctx.sorted)


# Malformed files: refused as a format problem before any signature is looked at.
def _doc(c, **changes):
    doc = _canonical.decode(c.built(c.k[0]), max_size=1 << 28)
    doc.update(changes)
    return _canonical.encode({k: v for k, v in doc.items() if v is not ...})


MALFORMED = {
    "empty": lambda c: b"",
    "garbage": lambda c: b"\x00garbage",
    "json": lambda c: b'{"format": "shardtool-manifest-v1"}',
    "truncated": lambda c: c.built(c.k[0])[:-1],
    "trailing-byte": lambda c: c.built(c.k[0]) + b"\x00",
    "wrong-format": lambda c: _doc(c, format="shardtool-manifest-v2"),
    "format-bytes": lambda c: _doc(c, format=FORMAT.encode()),
    "unknown-top-field": lambda c: _doc(c, extra=1),
    "missing-entries": lambda c: _doc(c, entries=...),
    "missing-envelope": lambda c: _doc(c, envelope=...),
    "entries-a-map": lambda c: _doc(c, entries={}),
    "entry-not-binary": lambda c: _doc(c, entries=[{"path": "a"}]),
    "entry-too-large": lambda c: _doc(c, entries=[b"\x00" * (MAX_ENTRY_BYTES + 1)]),
    "envelope-a-list": lambda c: _doc(c, envelope=[]),
    "signature-63-bytes": lambda c: _with_signatures(c, lambda s: [{"keyid": s[0]["keyid"], "sig": s[0]["sig"][:63]}],
                                                     c.k[0]),
    "signature-keyid-uppercase": lambda c: _with_signatures(
        c, lambda s: [{"keyid": s[0]["keyid"].upper(), "sig": s[0]["sig"]}], c.k[0]),
    "signatures-not-a-list": lambda c: _with_signatures(c, lambda s: s[0], c.k[0]),
    "not-canonical-outer": lambda c: _unsorted_outer(c),
}


def _unsorted_outer(c) -> bytes:
    import msgpack

    doc = _canonical.decode(c.built(c.k[0]), max_size=1 << 28)
    return msgpack.packb({"format": doc["format"], "envelope": doc["envelope"], "entries": doc["entries"]},
                         use_bin_type=True)


@pytest.mark.parametrize("build", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_manifest_is_a_format_error(build, ed25519_keys, entries, forge, raw_entry, now, raises_exactly):
    data = build(Ctx(ed25519_keys, entries, forge, raw_entry, now))
    with raises_exactly(ManifestFormatError):
        verify_manifest(data, [ed25519_keys[0].public], 1, now=now)
    with raises_exactly(ManifestFormatError):
        decode_manifest(data)


DECODE_REFUSALS = {
    "wrong-payload-type": (lambda c: c.forge(c.raw, payload_type="text/plain"), ManifestFormatError),
    "entries-vs-root": (lambda c: c.forge(c.raw[:-1], merkle_root=_root(c.raw)), MerkleProofError),
    "count-vs-entries": (lambda c: c.forge(c.raw, entry_count=1), MerkleProofError),
    "unsorted": (lambda c: c.forge(c.raw[::-1]), ManifestFormatError),
}


@pytest.mark.parametrize("build,error", DECODE_REFUSALS.values(), ids=DECODE_REFUSALS.keys())
def test_decode_manifest_checks_everything_but_signatures(build, error, ed25519_keys, entries, forge, raw_entry, now,
                                                          raises_exactly):
    with raises_exactly(error):
        decode_manifest(build(Ctx(ed25519_keys, entries, forge, raw_entry, now)))


def test_unsigned_manifest_decodes_for_publishers(built):
    assert decode_manifest(built.to_bytes()).envelope.signatures == ()
    assert built.envelope.payload_type == PAYLOAD_TYPE
