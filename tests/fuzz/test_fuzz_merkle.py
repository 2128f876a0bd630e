"""Fuzzing inclusion proofs and the self-contained proof document (`shardtool prove`).

Contract: only ShardtoolError subclasses escape, for any index, size, hash or path element of any type; and a
proof document that still verifies after mutation proves the very entry the genuine one did.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from _fuzzkit import msgpack_values, mutated, only_our_errors, packb
from shardtool.errors import ShardtoolError
from shardtool.keys import PrivateKey
from shardtool.manifest import Entry, build_manifest, build_proof, verify_proof
from shardtool.manifest._merkle import (
    blake3_256,
    inclusion_proof,
    leaf_hash,
    root_from_leaf_hashes,
    verify_inclusion,
)

NOW = 1_750_000_000
KEY = PrivateKey(Ed25519PrivateKey.from_private_bytes(b"\x09" * 32))
HASHISH = st.binary(min_size=32, max_size=32) | st.binary(max_size=40) | st.none() | st.integers() | st.text(max_size=4)
SIZES = st.integers(-3, 70) | st.sampled_from([2**31, 2**63, 2**64, -(2**63)])


def _proof_doc() -> bytes:
    entries = [Entry(f"experts/layer-000/expert-{i:04d}.safetensors", "expert", i, bytes([i]) * 32, 0, i)
               for i in range(11)]
    m = build_manifest(entries, model_id="fuzz/proof", version=1, now=NOW)
    return build_proof(m.with_envelope(m.envelope.signed_by(KEY)), entries[6].path)


PROOF = _proof_doc()
GENUINE = verify_proof(PROOF, [KEY.public], 1, now=NOW)


@given(SIZES, SIZES, HASHISH, st.lists(HASHISH, max_size=70), HASHISH)
def test_fuzz_inclusion_proof_any_input(index, size, leaf, path, root):
    only_our_errors(verify_inclusion, blake3_256, index, size, leaf, path, root)


@given(st.integers(1, 40), st.data())
def test_fuzz_inclusion_proof_mutated(n, data):
    """A genuine proof with one field changed never verifies (and never crashes)."""
    leaves = [leaf_hash(blake3_256, bytes([i])) for i in range(n)]
    index = data.draw(st.integers(0, n - 1))
    path, root = inclusion_proof(blake3_256, leaves, index), root_from_leaf_hashes(blake3_256, leaves)
    assert only_our_errors(verify_inclusion, blake3_256, index, n, leaves[index], path, root) is None
    what = data.draw(st.sampled_from(["index", "size", "leaf", "element", "drop", "extra", "root"]))
    args = [index, n, leaves[index], list(path), root]
    if what == "index":
        args[0] = data.draw(st.integers(-2, n + 2).filter(lambda i: i != index))
    elif what == "size":
        args[1] = data.draw(st.integers(-2, 2 * n + 2).filter(lambda s: s != n))
    elif what == "leaf":
        args[2] = data.draw(st.binary(min_size=32, max_size=32).filter(lambda b: b != leaves[index]))
    elif what == "element" and path:
        i = data.draw(st.integers(0, len(path) - 1))
        args[3][i] = bytes([args[3][i][0] ^ 1]) + args[3][i][1:]
    elif what == "drop" and path:
        args[3].pop(data.draw(st.integers(0, len(path) - 1)))
    elif what == "extra":
        args[3].insert(data.draw(st.integers(0, len(path))), data.draw(st.binary(min_size=32, max_size=32)))
    elif what == "root":
        args[4] = bytes([root[0] ^ 1]) + root[1:]
    else:
        return
    got = only_our_errors(verify_inclusion, blake3_256, *args)
    # A different tree size can share a genuine path (RFC 9162: the path depends on size only through its
    # shape); what matters is that no change to index, leaf, elements or root passes.
    if what != "size":
        assert isinstance(got, ShardtoolError), f"mutated proof ({what}) verified"


def _verify(data: bytes):
    return verify_proof(data, [KEY.public], 1, now=NOW)


@given(st.binary(max_size=2048))
def test_fuzz_proof_document_random_bytes(data):
    only_our_errors(_verify, data)


@given(mutated(PROOF, max_ops=3))
def test_fuzz_proof_document_mutated(data):
    got = only_our_errors(_verify, data)
    if not isinstance(got, ShardtoolError):
        assert (got.entry, got.index, got.head) == (GENUINE.entry, GENUINE.index, GENUINE.head)


@given(st.fixed_dictionaries({"format": st.sampled_from(["shardtool-proof-v1", "x"]),
                              "envelope": msgpack_values(6), "index": msgpack_values(1),
                              "entry": msgpack_values(3), "path": msgpack_values(6)}))
def test_fuzz_proof_document_shaped(doc):
    only_our_errors(_verify, packb(dict(sorted(doc.items()))))
