"""The Merkle code instantiated with SHA-256 against the RFC 6962 vectors of transparency-dev/merkle.

Probe fields: a null proof is an empty list, a null hash is b"" (the Go test data uses nil for both).
"""

from __future__ import annotations

import pytest

from shardtool.errors import MerkleProofError
from shardtool.manifest._merkle import (
    inclusion_proof,
    leaf_hash,
    root_from_inclusion_proof,
    root_from_leaf_hashes,
    sha256,
    verify_inclusion,
)

FILE = "rfc6962_merkle.json"


def _h(value: str | None) -> bytes:
    return b"" if value is None else bytes.fromhex(value)


def _proof(values: list[str] | None) -> list[bytes]:
    return [] if values is None else [_h(v) for v in values]


@pytest.fixture(scope="module")
def vectors(load_testdata):
    return load_testdata(FILE)


@pytest.fixture(scope="module")
def leaves(vectors):
    return [leaf_hash(sha256, bytes.fromhex(x)) for x in vectors["leaf_inputs"]]


def test_vector_counts(vectors):
    assert len(vectors["leaf_inputs"]) == 8
    assert sorted(map(int, vectors["roots"])) == list(range(1, 9))
    assert (len(vectors["inclusion_proofs"]), len(vectors["consistency_proofs"])) == (5, 5)
    assert (len(vectors["inclusion_probes"]), len(vectors["consistency_probes"])) == (98, 98)


def test_empty_tree_root(vectors):
    assert root_from_leaf_hashes(sha256, []) == bytes.fromhex(vectors["empty_root"])


@pytest.mark.parametrize("size", range(1, 9))
def test_roots(vectors, leaves, size):
    assert root_from_leaf_hashes(sha256, leaves[:size]) == bytes.fromhex(vectors["roots"][str(size)])


def test_node_hashes(vectors, leaves):
    levels = vectors["node_hashes"]["levels"]
    assert [len(level) for level in levels] == [8, 4, 2, 1]
    assert [h.hex() for h in leaves] == levels[0]
    for level, hashes in enumerate(levels):
        width = 1 << level
        for i, want in enumerate(hashes):
            assert root_from_leaf_hashes(sha256, leaves[i * width:(i + 1) * width]).hex() == want, (level, i)


def _happy_inclusion(data):
    for p in data["inclusion_proofs"]:
        yield f"leaf{p['leaf_index']}-of-{p['tree_size']}", p


@pytest.mark.vectors(FILE, "case", _happy_inclusion)
def test_inclusion_happy_paths(case, leaves):
    index, size = case["leaf_index"], case["tree_size"]
    proof, root, leaf = _proof(case["proof"]), _h(case["root"]), _h(case["leaf_hash"])
    assert leaf == leaves[index]
    assert inclusion_proof(sha256, leaves[:size], index) == proof  # our generator produces the same proof
    verify_inclusion(sha256, index, size, leaf, proof, root)
    assert root_from_inclusion_proof(sha256, index, size, leaf, proof) == root


def _probe_id(p) -> str:
    # "testdata/inclusion/2/leafIdx-plus-@1.json" -> "2/leafIdx-plus-@1"
    return p["file"].split("/", 2)[2].removesuffix(".json") + ("-ERR" if p["want_error"] else "-OK")


def _inclusion_probes(data):
    return [(_probe_id(p), p) for p in data["inclusion_probes"]]


@pytest.mark.vectors(FILE, "probe", _inclusion_probes)
def test_inclusion_probe(probe, raises_exactly):
    args = (sha256, probe["leaf_index"], probe["tree_size"], _h(probe["leaf_hash"]), _proof(probe["proof"]),
            _h(probe["root"]))
    if probe["want_error"]:
        with raises_exactly(MerkleProofError):
            verify_inclusion(*args)
    else:
        verify_inclusion(*args)


def test_probe_ids_are_unique(vectors):
    ids = [_probe_id(p) for p in vectors["inclusion_probes"]]
    assert len(set(ids)) == len(ids)


# --- our own bad inputs beyond the probes --------------------------------------------------------------------


def _eight(leaves):
    return root_from_leaf_hashes(sha256, leaves), inclusion_proof(sha256, leaves, 5)


BAD_INCLUSION = {
    "index-negative": lambda a: {**a, "index": -1},
    "index-equals-size": lambda a: {**a, "index": 8},
    "size-zero": lambda a: {**a, "size": 0, "index": 0},
    "leaf-31-bytes": lambda a: {**a, "leaf": a["leaf"][:31]},
    "leaf-str": lambda a: {**a, "leaf": a["leaf"].hex()},
    "root-33-bytes": lambda a: {**a, "root": a["root"] + b"\x00"},
    "element-short": lambda a: {**a, "proof": [a["proof"][0][:16]] + a["proof"][1:]},
    "element-str": lambda a: {**a, "proof": [a["proof"][0].hex()] + a["proof"][1:]},
    "proof-reversed": lambda a: {**a, "proof": a["proof"][::-1]},
    "proof-too-long": lambda a: {**a, "proof": a["proof"] + [a["proof"][0]]},
    "proof-too-short": lambda a: {**a, "proof": a["proof"][:-1]},
    "leaf-is-inner-node": lambda a: {**a, "leaf": a["proof"][0]},
}


@pytest.mark.parametrize("mutate", BAD_INCLUSION.values(), ids=BAD_INCLUSION.keys())
def test_inclusion_refusals(mutate, leaves, raises_exactly):
    root, proof = _eight(leaves)
    good = {"index": 5, "size": 8, "leaf": leaves[5], "proof": proof, "root": root}
    verify_inclusion(sha256, good["index"], good["size"], good["leaf"], good["proof"], good["root"])
    bad = mutate(dict(good))
    with raises_exactly(MerkleProofError):
        verify_inclusion(sha256, bad["index"], bad["size"], bad["leaf"], bad["proof"], bad["root"])


def test_leaf_and_node_hashes_are_domain_separated(leaves):
    # A two-leaf tree's root is not the leaf hash of the concatenated children (the 0x00/0x01 prefixes).
    two = root_from_leaf_hashes(sha256, leaves[:2])
    assert two != sha256(leaves[0] + leaves[1])
    assert two != leaf_hash(sha256, leaves[0] + leaves[1])


@pytest.mark.parametrize("index,size", [(-1, 8), (8, 8), (0, 0)], ids=["negative", "equals-size", "empty-tree"])
def test_inclusion_proof_generator_refuses_an_index_outside_the_tree(leaves, index, size, raises_exactly):
    with raises_exactly(MerkleProofError):
        inclusion_proof(sha256, leaves[:size], index)
