"""Property tests for the BLAKE3 Merkle tree: the tree hash matches RFC 9162's recursive definition, and
inclusion proofs verify for every leaf of every size and stop verifying when anything in them changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.errors import MerkleProofError
from shardtool.manifest._merkle import (
    blake3_256,
    inclusion_proof,
    leaf_hash,
    node_hash,
    root_from_leaf_hashes,
    verify_inclusion,
)

SETTINGS = settings(max_examples=60, deadline=None)


def _k(n: int) -> int:
    """Largest power of two strictly below n, computed the slow obvious way."""
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def _mth(leaves: list[bytes]) -> bytes:
    """RFC 9162 §2.1.1 MTH, literally recursive, over leaf hashes."""
    if not leaves:
        return blake3_256(b"")
    if len(leaves) == 1:
        return leaves[0]
    k = _k(len(leaves))
    return node_hash(blake3_256, _mth(leaves[:k]), _mth(leaves[k:]))


def _sides(m: int, n: int) -> list[bool]:
    """Shape of RFC 9162 PATH(m, D[n]), leaf upwards: True where the sibling is on the left."""
    if n == 1:
        return []
    k = _k(n)
    return _sides(m, k) + [False] if m < k else _sides(m - k, n - k) + [True]


def _leaves(data: list[bytes]) -> list[bytes]:
    return [leaf_hash(blake3_256, d) for d in data]


# Distinct leaf data: equal leaves would make "another index" legitimately prove the same thing.
_leaf_data = st.lists(st.binary(max_size=12), min_size=1, max_size=150, unique=True)


@SETTINGS
@given(st.lists(st.binary(max_size=12), max_size=150))
def test_root_matches_recursive_definition(data):
    leaves = _leaves(data)
    assert root_from_leaf_hashes(blake3_256, leaves) == _mth(leaves)


@SETTINGS
@given(_leaf_data, st.data())
def test_inclusion_proof_verifies_and_has_the_rfc_shape(data, draw):
    leaves = _leaves(data)
    n = len(leaves)
    index = draw.draw(st.integers(0, n - 1), label="index")
    proof = inclusion_proof(blake3_256, leaves, index)
    assert len(proof) == len(_sides(index, n))
    verify_inclusion(blake3_256, index, n, leaves[index], proof, _mth(leaves))


@SETTINGS
@given(_leaf_data, st.data())
def test_any_tampered_proof_element_fails(data, draw):
    leaves = _leaves(data)
    n = len(leaves)
    index = draw.draw(st.integers(0, n - 1), label="index")
    proof = inclusion_proof(blake3_256, leaves, index)
    root = root_from_leaf_hashes(blake3_256, leaves)
    if not proof:  # a one-leaf tree: the leaf is the root; tamper with the leaf instead
        with pytest.raises(MerkleProofError):
            verify_inclusion(blake3_256, 0, 1, bytes([leaves[0][0] ^ 1]) + leaves[0][1:], proof, root)
        return
    j = draw.draw(st.integers(0, len(proof) - 1), label="element")
    byte = draw.draw(st.integers(0, 31), label="byte")
    bit = draw.draw(st.integers(0, 7), label="bit")
    tampered = list(proof)
    tampered[j] = tampered[j][:byte] + bytes([tampered[j][byte] ^ (1 << bit)]) + tampered[j][byte + 1:]
    with pytest.raises(MerkleProofError):
        verify_inclusion(blake3_256, index, n, leaves[index], tampered, root)
    for bad in (proof[:j] + proof[j + 1:], proof + [proof[j]], proof[:j] + [proof[j], proof[j]] + proof[j + 1:]):
        with pytest.raises(MerkleProofError):
            verify_inclusion(blake3_256, index, n, leaves[index], bad, root)


@SETTINGS
@given(_leaf_data.filter(lambda d: len(d) >= 2), st.data())
def test_any_other_index_fails(data, draw):
    leaves = _leaves(data)
    n = len(leaves)
    index = draw.draw(st.integers(0, n - 1), label="index")
    other = draw.draw(st.integers(-2, n + 2).filter(lambda i: i != index), label="other")
    proof = inclusion_proof(blake3_256, leaves, index)
    with pytest.raises(MerkleProofError):
        verify_inclusion(blake3_256, other, n, leaves[index], proof, root_from_leaf_hashes(blake3_256, leaves))


@SETTINGS
@given(_leaf_data, st.data())
def test_another_size_fails_unless_the_path_has_the_same_shape(data, draw):
    """RFC 9162 §2.1.3.2 folds the proof by (index, size); a size whose path to `index` has the same shape
    (e.g. leaf 0 of 3 and of 4) folds identically, so an inclusion proof alone cannot pin the size. That is
    why the size comes from the signed head (`entry_count`), never from the proof's carrier."""
    leaves = _leaves(data)
    n = len(leaves)
    index = draw.draw(st.integers(0, n - 1), label="index")
    size = draw.draw(st.integers(0, 2 * n + 2).filter(lambda s: s != n), label="size")
    proof = inclusion_proof(blake3_256, leaves, index)
    root = root_from_leaf_hashes(blake3_256, leaves)
    if index < size and _sides(index, size) == _sides(index, n):
        verify_inclusion(blake3_256, index, size, leaves[index], proof, root)
    else:
        with pytest.raises(MerkleProofError):
            verify_inclusion(blake3_256, index, size, leaves[index], proof, root)


def test_same_shape_sizes_exist_so_the_property_above_is_not_vacuous():
    assert _sides(0, 3) == _sides(0, 4) == [False, False]
    leaves = _leaves([b"a", b"b", b"c"])
    verify_inclusion(blake3_256, 0, 4, leaves[0], inclusion_proof(blake3_256, leaves, 0),
                     root_from_leaf_hashes(blake3_256, leaves))


@SETTINGS
@given(_leaf_data, st.data())
def test_wrong_leaf_or_root_fails(data, draw):
    leaves = _leaves(data)
    n = len(leaves)
    index = draw.draw(st.integers(0, n - 1), label="index")
    proof = inclusion_proof(blake3_256, leaves, index)
    root = root_from_leaf_hashes(blake3_256, leaves)
    with pytest.raises(MerkleProofError):
        verify_inclusion(blake3_256, index, n, leaf_hash(blake3_256, b"not in the tree"), proof, root)
    with pytest.raises(MerkleProofError):
        verify_inclusion(blake3_256, index, n, leaves[index], proof, blake3_256(root))
