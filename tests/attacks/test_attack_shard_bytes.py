"""Attacks on the bytes of listed files: flipped, truncated, extended, replaced by a same-size file.

Each case runs `shardtool audit --json` and `verify-and-run` on its own copy of a signed model. The run must
stop with exit 1 before printing a single token (every expert is used during prefill), naming the file.
"""

from __future__ import annotations

import os

import pytest

import _attackkit as kit
from _attackkit import EXPERT, TRUNK, Attack, found, refused

DIGEST = "DigestMismatchError"


def _truncate(path, n=1):
    path.write_bytes(path.read_bytes()[:-n])


def _extend(path):
    path.write_bytes(path.read_bytes() + b"\x00")


def _same_size(path):
    path.write_bytes(os.urandom(path.stat().st_size))


CASES = {
    "flip-expert": Attack(lambda m, w: kit.flip(m / EXPERT), found((EXPERT, "digest-mismatch")),
                          refused(DIGEST, f"{EXPERT}: BLAKE3 is")),
    "flip-expert-header": Attack(lambda m, w: kit.flip(m / EXPERT, offset=20), found((EXPERT, "digest-mismatch")),
                                 refused(DIGEST, f"{EXPERT}: BLAKE3 is")),
    "flip-trunk": Attack(lambda m, w: kit.flip(m / TRUNK), found((TRUNK, "digest-mismatch")),
                         refused(DIGEST, f"{TRUNK}: BLAKE3 is")),
    "flip-embedding": Attack(lambda m, w: kit.flip(m / "trunk/embed.safetensors"),
                             found(("trunk/embed.safetensors", "digest-mismatch")),
                             refused(DIGEST, "trunk/embed.safetensors: BLAKE3 is")),
    "flip-config-json": Attack(lambda m, w: kit.flip(m / "config.json"), found(("config.json", "digest-mismatch")),
                               refused(DIGEST, "config.json: BLAKE3 is")),
    "flip-tokenizer-json": Attack(lambda m, w: kit.flip(m / "tokenizer.json"),
                                  found(("tokenizer.json", "digest-mismatch")),
                                  refused(DIGEST, "tokenizer.json: BLAKE3 is")),
    "truncate-expert": Attack(lambda m, w: _truncate(m / EXPERT), found((EXPERT, "size-mismatch")),
                              refused(DIGEST, f"{EXPERT}: size is ")),
    "truncate-expert-to-empty": Attack(lambda m, w: (m / EXPERT).write_bytes(b""), found((EXPERT, "size-mismatch")),
                                       refused(DIGEST, f"{EXPERT}: size is 0 bytes")),
    "extend-expert": Attack(lambda m, w: _extend(m / EXPERT), found((EXPERT, "size-mismatch")),
                            refused(DIGEST, f"{EXPERT}: size is ")),
    "same-size-replacement-expert": Attack(lambda m, w: _same_size(m / EXPERT), found((EXPERT, "digest-mismatch")),
                                           refused(DIGEST, f"{EXPERT}: BLAKE3 is")),
    # A listed file the runtime never reads: audit catches it; the run is unaffected (it never touches those
    # bytes) unless asked to verify everything first.
    "flip-unused-side-file": Attack(lambda m, w: kit.flip(m / "tokenizer_config.json"),
                                    found(("tokenizer_config.json", "digest-mismatch")), kit.CLEAN),
    "flip-unused-side-file-verify-all-first": Attack(
        lambda m, w: kit.flip(m / "tokenizer_config.json"), found(("tokenizer_config.json", "digest-mismatch")),
        refused(DIGEST, "tokenizer_config.json: BLAKE3 is"), run_extra=("--verify-all-first",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shard_bytes(case, model, world):
    kit.check_attack(CASES[case], model, world)


def test_untouched_model_passes_both(model, world):
    """The control: the same harness on an untouched copy gives exit 0 and the reference output."""
    kit.check_attack(Attack(lambda m, w: None, kit.CLEAN, kit.CLEAN), model, world)
