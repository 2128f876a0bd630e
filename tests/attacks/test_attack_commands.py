"""The verifying commands besides audit and verify-and-run: `join` (rebuild a checkpoint from shards) and
`verify-shard` (one shard received from a peer, with its proof). Each must refuse what audit refuses, with
the same exit code, at once (no hang on a FIFO, no hashing of a 4 TiB sparse file), leave nothing that looks
complete, and decide `--model-id` before the rollback state is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import _attackkit as kit
from _attackkit import EXPERT, MANIFEST

QUICK = 20  # seconds: every refusal here is immediate; a hang or a multi-TiB hash runs into the time-out
SPARSE_SIZE = 1 << 42
OTHER_MODEL = "other/tiny-moe"


def _fifo(model, world):
    kit.replace_file(model / EXPERT, os.mkfifo)


def _socket(model, world):
    kit.plant_socket(model / EXPERT, world.tmp)


def _sparse(model, world):
    with open(model / EXPERT, "r+b") as fh:
        fh.truncate(SPARSE_SIZE)


def _rehashed_under_old_signature(model, world):
    """An evil expert swapped in and the entry list re-hashed (new root), the genuine signature kept."""
    kit.flip(model / EXPERT)
    doc = kit.Doc.read(model)
    entries = [kit.unpack(e) for e in doc.raw_entries()]
    for e in entries:
        if e["path"] == EXPERT:
            e["digest"] = kit._h((model / EXPERT).read_bytes())
    doc.entries = entries
    doc.reseal().write(model)  # the head changes, the old signature stays: it no longer verifies


JOIN_CASES = {
    "fifo-instead-of-expert": (_fifo, "NotARegularFileError", f"{EXPERT}: is a FIFO"),
    "socket-instead-of-expert": (_socket, "NotARegularFileError", f"{EXPERT}: is a socket"),
    "directory-instead-of-expert": (lambda m, w: kit.replace_file(m / EXPERT, os.mkdir), "NotARegularFileError",
                                    f"{EXPERT}: is a directory"),
    "missing-expert": (lambda m, w: (m / EXPERT).unlink(), "MissingFileError", f"{EXPERT}: file is missing"),
    "sparse-4tib-instead-of-expert": (_sparse, "DigestMismatchError", f"size is {SPARSE_SIZE} bytes"),
    "flipped-expert": (lambda m, w: kit.flip(m / EXPERT), "DigestMismatchError", f"{EXPERT}: BLAKE3 is"),
    "rehashed-entries-under-old-signature": (_rehashed_under_old_signature, "SignatureError", ""),
}


def _assert_refused(r: kit.Result, code: int, error: str, message: str = "") -> None:
    kit.assert_no_traceback(r)
    assert r.code == code, f"exited {r.code}, expected {code}:\n{r.err}"
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert r.error_class == error, r.err
    assert message in r.err, (message, r.err)


def _nothing_complete(rebuilt: Path) -> None:
    """A refused join leaves no rebuilt file under its final name (temp files are removed too)."""
    assert not rebuilt.exists() or not any(rebuilt.iterdir()), sorted(p.name for p in rebuilt.iterdir())


def _join(model: Path, rebuilt: Path, world, *extra) -> kit.Result:
    return kit.run("shardtool", "join", model, rebuilt, "-q", *extra, cwd=world.tmp, timeout=QUICK)


def _trusted(world) -> list:
    return ["--trust", world.keys.pub("A"), "--state-dir", world.tmp / "state"]


@pytest.mark.parametrize("case", list(JOIN_CASES))
def test_join_refuses(case, model, world):
    tamper, error, message = JOIN_CASES[case]
    tamper(model, world)
    rebuilt = world.tmp / "rebuilt"
    _assert_refused(_join(model, rebuilt, world, *_trusted(world)), 1, error, message)
    _nothing_complete(rebuilt)


def test_join_untouched_model_rebuilds(model, world):
    r = _join(model, world.tmp / "rebuilt", world, *_trusted(world), "--model-id", "acme/tiny-moe")
    assert r.code == 0, r.err
    assert "every file verified against acme/tiny-moe version 2" in r.err
    assert (world.tmp / "rebuilt" / "config.json").is_file()


def test_join_without_trust_is_refused(model, world):
    """join rebuilds from verified shards only; options that would have no effect are errors, not no-ops."""
    rebuilt = world.tmp / "rebuilt"
    _rehashed_under_old_signature(model, world)
    _assert_refused(_join(model, rebuilt, world), 2, "UsageError", "pass --trust")
    _assert_refused(_join(model, rebuilt, world, "--threshold", "2", "--state-dir", world.tmp / "s"), 2,
                    "UsageError", "pass --trust")
    for extra in (["--trust", world.keys.pub("A")], ["--threshold", "2"], ["--state-dir", world.tmp / "s"],
                  ["--model-id", "acme/tiny-moe"]):
        _assert_refused(_join(model, rebuilt, world, "--insecure-no-verify", *extra), 2, "UsageError",
                        "cannot be combined with --insecure-no-verify")
    _nothing_complete(rebuilt)


def test_join_insecure_no_verify_still_checks_every_file(model, world):
    """--insecure-no-verify skips the signatures, not the files: a flipped expert is still refused."""
    kit.flip(model / EXPERT)
    rebuilt = world.tmp / "rebuilt"
    _assert_refused(_join(model, rebuilt, world, "--insecure-no-verify"), 1, "DigestMismatchError", EXPERT)
    _nothing_complete(rebuilt)


def _state_records(state: Path) -> list[str]:
    path = state / "rollback.json"
    if not path.exists():
        return []
    import json
    return sorted(r["model_id"] for r in json.loads(path.read_text()).values())


def test_join_model_id_pin(model, world):
    rebuilt = world.tmp / "rebuilt"
    r = _join(model, rebuilt, world, *_trusted(world), "--model-id", OTHER_MODEL)
    _assert_refused(r, 1, "VerificationError", f"manifest is for model 'acme/tiny-moe', expected '{OTHER_MODEL}'")
    assert _state_records(world.tmp / "state") == []  # decided before the rollback state was written
    _nothing_complete(rebuilt)


# --- verify-shard ----------------------------------------------------------------------------------------


def _prove(model: Path, world) -> Path:
    proof = world.tmp / "expert.proof"
    r = kit.run("shardtool", "prove", model, "--entry", EXPERT, "--out", proof, cwd=world.tmp)
    assert r.code == 0, r.err
    return proof


def _verify_shard(shard: Path, proof: Path, world, *extra) -> kit.Result:
    return kit.run("shardtool", "verify-shard", shard, "--proof", proof, *_trusted(world), *extra,
                   cwd=world.tmp, timeout=QUICK)


def test_verify_shard_proof_is_a_fifo(model, world):
    proof = world.tmp / "fifo.proof"
    os.mkfifo(proof)
    _assert_refused(_verify_shard(model / EXPERT, proof, world), 1, "NotARegularFileError", "is a FIFO")


def test_verify_shard_sparse_shard_is_not_hashed(model, world):
    proof = _prove(model, world)
    _sparse(model, world)
    _assert_refused(_verify_shard(model / EXPERT, proof, world), 1, "DigestMismatchError",
                    f"size is {SPARSE_SIZE} bytes")


def test_verify_shard_model_id_pin(model, world):
    """A genuine shard and proof of another model by the same publisher: refused before the state moves."""
    proof = _prove(world.other, world)
    shard = world.other / EXPERT
    r = _verify_shard(shard, proof, world, "--model-id", "acme/tiny-moe", "--entry", EXPERT)
    _assert_refused(r, 1, "VerificationError", f"manifest is for model '{OTHER_MODEL}', expected 'acme/tiny-moe'")
    assert _state_records(world.tmp / "state") == []
    r = _verify_shard(model / EXPERT, _prove(model, world), world, "--model-id", "acme/tiny-moe", "--entry", EXPERT)
    assert r.code == 0, r.err
    assert _state_records(world.tmp / "state") == ["acme/tiny-moe"]


def test_audit_model_id_pin_leaves_state_untouched(model, world):
    r = kit.run(*kit.audit_cmd(model, [world.keys.pub("A")], 1, world.tmp / "state", ["--model-id", OTHER_MODEL]),
                cwd=world.tmp)
    kit.assert_audit_refused(r, "VerificationError", "expected 'other/tiny-moe'")
    assert _state_records(world.tmp / "state") == []
    assert (model / MANIFEST).is_file()


# --- inspect (a publisher's tool: malformed input is exit 2) ----------------------------------------------


@pytest.mark.parametrize("edit", ["drop-a-key", "unknown-key", "other-version"])
def test_inspect_contract_it_cannot_read(edit, model, world):
    """An unsigned manifest whose contract lacks a key used to end `inspect` with a KeyError traceback."""
    doc = kit.Doc.read(model)
    contract = doc.head["contract"]
    if edit == "drop-a-key":
        del contract["bytes_per_expert"]
    elif edit == "unknown-key":
        contract["bogus_key"] = 1
    else:
        contract["contract_version"] = 99
    doc.sign().write(model)  # unsigned: inspect never asks for signatures
    r = kit.run("shardtool", "inspect", model, cwd=world.tmp)
    _assert_refused(r, 2, "CheckpointFormatError", "resource contract")


def test_manifest_refuses_an_empty_directory(world, tmp_path):
    """`shardtool manifest` used to list a tree holding an empty directory, which audit then reported:
    the publisher's own clean tree failed its audit. The producer refuses it instead (exit 2)."""
    d = tmp_path / "md"
    (d / "assets").mkdir(parents=True)
    (d / "a.txt").write_text("hi")
    r = kit.run("shardtool", "manifest", d, cwd=world.tmp)
    _assert_refused(r, 2, "UsageError", "is an empty directory")
    assert not (d / MANIFEST).exists()
    (d / "assets" / "b.txt").write_text("b")
    assert kit.run("shardtool", "manifest", d, cwd=world.tmp).code == 0


def test_inspect_zero_streamed_bytes_prints_valid_json(model, world):
    """A contract with no expert bytes per token: tokens/s is null in --json (it was Infinity, not JSON,
    and a traceback once --json refused it)."""
    import json

    doc = kit.Doc.read(model)
    doc.head["contract"]["expert_bytes_per_token_cold"] = 0
    doc.sign().write(model)
    r = kit.run("shardtool", "inspect", model, "--json", cwd=world.tmp)
    assert r.code == 0, r.err
    assert json.loads(r.out)["tokens_per_second_cold"] is None
    r = kit.run("shardtool", "inspect", model, cwd=world.tmp)
    assert r.code == 0 and "no expert bytes stream per token" in r.err, r.err


@pytest.mark.parametrize("args", [["keygen", "--out", "", "--no-passphrase"],
                                  ["keygen", "--out", "a" * 300, "--no-passphrase"],
                                  ["inspect", "a" * 300]], ids=["keygen-empty-name", "keygen-long-name",
                                                                 "inspect-long-name"])
def test_operator_path_the_system_refuses_is_one_line(args, world):
    r = kit.run("shardtool", *args, cwd=world.tmp)
    kit.assert_no_traceback(r)
    assert r.code in (2, 3) and len(r.err.strip().splitlines()) == 1, r.err


def test_join_into_a_path_the_system_refuses_is_one_line(model, world):
    r = _join(model, world.tmp / ("a" * 300), world, *_trusted(world))
    kit.assert_no_traceback(r)
    assert r.code in (2, 3) and len(r.err.strip().splitlines()) == 1, r.err
