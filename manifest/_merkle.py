"""Merkle tree hash and inclusion proofs in the shape of RFC 9162 §2.1.

The hash function is a parameter: shardtool uses BLAKE3-256, and the tests run the same code with
SHA-256 against the RFC 6962 vectors. Leaf = H(0x00 || data), node = H(0x01 || left || right).
"""

from __future__ import annotations

from typing import Callable, Sequence

import blake3

from shardtool.errors import MerkleProofError

HashFn = Callable[[bytes], bytes]
HASH_SIZE = 32
_LEAF = b"\x00"
_NODE = b"\x01"


def blake3_256(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def sha256(data: bytes) -> bytes:
    import hashlib  # here: only the RFC 6962 vectors use it, and it loads OpenSSL (5 ms at every start)

    return hashlib.sha256(data).digest()


def leaf_hash(h: HashFn, data: bytes) -> bytes:
    return h(_LEAF + data)


def leaf_hashes(h: HashFn, items: Sequence[bytes]) -> list[bytes]:
    """`leaf_hash` of each item, in one loop (a manifest has one leaf per file: 100k+ calls)."""
    return [h(_LEAF + data) for data in items]


def node_hash(h: HashFn, left: bytes, right: bytes) -> bytes:
    return h(_NODE + left + right)


def root_from_leaf_hashes(h: HashFn, leaves: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes (RFC 9162 §2.1.1). Pairing bottom-up and carrying an odd last node up a level
    gives the same tree as splitting at the largest power of two below n, in O(n) without recursion."""
    if not leaves:
        return h(b"")
    level = list(leaves)
    while len(level) > 1:
        nxt = [node_hash(h, level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _split_point(n: int) -> int:
    """Largest power of two strictly below n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def inclusion_proof(h: HashFn, leaves: Sequence[bytes], index: int) -> list[bytes]:
    """PATH(index, D[n]) of RFC 9162 §2.1.3.1, over leaf hashes."""
    if not 0 <= index < len(leaves):
        raise MerkleProofError(f"leaf index {index} is outside a tree of size {len(leaves)}")
    proof: list[bytes] = []
    lo, hi = 0, len(leaves)
    # Walk down from the root, collecting the sibling subtree's root at each split; reverse at the end
    # because the proof lists siblings from the leaf upwards.
    while hi - lo > 1:
        k = _split_point(hi - lo)
        if index - lo < k:
            proof.append(root_from_leaf_hashes(h, leaves[lo + k:hi]))
            hi = lo + k
        else:
            proof.append(root_from_leaf_hashes(h, leaves[lo:lo + k]))
            lo = lo + k
    proof.reverse()
    return proof


def _check_hash(value: object, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_SIZE:
        raise MerkleProofError(f"{what} must be a {HASH_SIZE}-byte hash")
    return value


def root_from_inclusion_proof(h: HashFn, index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """RFC 9162 §2.1.3.2: the root that `proof` implies for leaf hash `leaf` at `index` in a tree of `size`."""
    if not 0 <= index < size:
        raise MerkleProofError(f"leaf index {index} is outside a tree of size {size}")
    _check_hash(leaf, "leaf hash")
    fn, sn, r = index, size - 1, leaf
    for i, p in enumerate(proof):
        _check_hash(p, f"proof element {i}")
        if sn == 0:
            raise MerkleProofError(f"inclusion proof is longer than a tree of size {size} allows")
        if fn & 1 or fn == sn:
            r = node_hash(h, p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(h, r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise MerkleProofError(f"inclusion proof is shorter than a tree of size {size} needs")
    return r


def verify_inclusion(h: HashFn, index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> None:
    """Raise MerkleProofError unless `proof` shows leaf hash `leaf` at `index` under `root`."""
    _check_hash(root, "root")
    computed = root_from_inclusion_proof(h, index, size, leaf, proof)
    if computed != root:
        raise MerkleProofError(f"inclusion proof leads to root {computed.hex()}, expected {root.hex()}")
