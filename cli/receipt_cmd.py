"""`shardtool verify-receipt`: check that an answer came from the signed weights.

The receipt's operator signature is checked first, then its payload is decoded with caps, then DIR's
manifest goes through the one trust decision, and the receipt must name exactly those weights; only then is
the prompt + answer replayed teacher-forced (`shardtool.runtime.replay_receipt`). Exit 0 valid, 1 not.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import stat
from pathlib import Path
from typing import List, Optional

import typer

from shardtool.errors import ReceiptMismatchError, ShardtoolError, UsageError

RECEIPT_SUFFIX = ".receipt"
TRACE_SUFFIX = ".trace"
MAX_LOG_ENTRIES = 1_000_000


def register(app: typer.Typer) -> None:
    app.command("verify-receipt")(verify_receipt)


def verify_receipt(
    receipt: Path = typer.Argument(..., help="Receipt file (or, with --sample, a directory of *.receipt files)."),
    directory: Path = typer.Argument(..., help="The split model directory the receipt names."),
    operator: List[Path] = typer.Option([], "--operator", help="Operator public key that signs receipts "
                                                               "(repeatable: any one of them)."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted publisher public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold", help="Distinct trusted publisher keys that must have signed."),
    expect_model: Optional[str] = typer.Option(None, "--model-id", help="Refuse a manifest for any other model."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="The run's routing trace: locates a routing "
                                                              "divergence to its token and layer."),
    sample: Optional[float] = typer.Option(None, "--sample", help="Spot-check: verify this fraction (0-1] of the "
                                                                  "*.receipt files in the RECEIPT directory."),
    sample_seed: Optional[int] = typer.Option(None, "--sample-seed", min=0, max=2**63 - 1,
                                              help="Seed of the sample (default: random)."),
    memory_budget: str = typer.Option("8GiB", "--memory-budget", help="Budget of the replay."),
    readers: int = typer.Option(2, "--readers", min=1, max=64, help="Reader/verifier threads."),
    threads: int = typer.Option(0, "--threads", min=0, max=1024, help="Compute (BLAS) threads; 0: automatic."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help="Manifest (default DIR/manifest.msgpack)."),
    as_json: bool = typer.Option(False, "--json", help="The verdict as one JSON document on stdout."),
) -> None:
    """Verify a run receipt: operator signature, the weights it names, then a teacher-forced replay of prompt
    and answer (tokens, routing, activation fingerprint) within documented tolerances."""
    from shardtool.cli._common import emit_json, load_trusted, manifest_path, model_dir, say
    from shardtool.cli._common import keep_freed_memory, parse_size, set_blas_threads

    budget = parse_size(memory_budget)
    if sample is not None and not (math.isfinite(sample) and 0 < sample <= 1):
        raise UsageError(f"--sample must be a fraction in (0, 1], got {sample}")
    if sample is not None and trace is not None:
        raise UsageError("--trace names one receipt's trace; with --sample, NAME.trace beside NAME.receipt is used")
    if sample is None and sample_seed is not None:
        raise UsageError("--sample-seed needs --sample")
    if not operator:
        raise UsageError("no operator public key given", hint="pass --operator OPERATOR.pub (repeatable)")
    operators = [_load_public(p) for p in operator]
    trusted = load_trusted(trust)
    directory = model_dir(directory)
    set_blas_threads(threads, readers)
    keep_freed_memory()
    from shardtool.manifest import load_trusted_manifest

    def trusted_manifest():
        return load_trusted_manifest(manifest_path(directory, manifest_file), trusted, threshold, state_dir,
                                     model_id=expect_model)

    if sample is None:
        opened = _open(receipt, operators)  # a bad receipt is refused before the model is touched
        verdict = _verify_one(opened, receipt, trace, directory, trusted_manifest(), budget, readers)
        if as_json:
            emit_json(verdict)
        else:
            _say_verdict(say, receipt, verdict)
        raise typer.Exit(0 if verdict["valid"] else 1)
    names = _receipts_in(receipt)
    k = max(1, math.ceil(sample * len(names)))
    seed = sample_seed if sample_seed is not None else secrets.randbits(63)
    chosen = sorted(random.Random(seed).sample(names, k))
    verified = trusted_manifest()
    results = []
    engines = _Engines(directory, verified, budget, readers)
    try:
        for name in chosen:
            path = receipt / name
            trace_path = receipt / (name[: -len(RECEIPT_SUFFIX)] + TRACE_SUFFIX)
            try:
                verdict = _verify_one(_open(path, operators), path, trace_path if trace_path.is_file() else None,
                                      directory, verified, budget, readers, engines)
            except ShardtoolError as err:
                if not err.exit_code == 1:
                    raise  # our own trouble (I/O, usage) is not a verdict on the node
                verdict = {"valid": False, "error": err.one_line()}
            verdict["file"] = name
            results.append(verdict)
            if not as_json:
                _say_verdict(say, path, verdict)
    finally:
        engines.close()
    invalid = [r["file"] for r in results if not r["valid"]]
    summary = {"receipts": len(names), "sampled": len(chosen), "sample_seed": seed, "valid": len(chosen) - len(invalid),
               "invalid": invalid, "replay_engines_built": engines.built, "results": results}
    if as_json:
        emit_json(summary)
    else:
        say(f"verify-receipt: {len(chosen) - len(invalid)} of {len(chosen)} sampled receipts valid "
            f"({len(names)} in the log, sample seed {seed})")
    raise typer.Exit(0 if not invalid else 1)


def _load_public(path: Path):
    from shardtool.keys import load_public_key
    return load_public_key(path)


def _open(path: Path, operators):
    """(receipt, signer): the file read capped by its size, its signature checked, then its payload decoded."""
    from shardtool.manifest import MAX_RECEIPT_BYTES, open_receipt
    from shardtool.safeio import read_regular

    if not os.path.lexists(path):
        raise UsageError("receipt file does not exist", path=str(path))
    data = read_regular(path, MAX_RECEIPT_BYTES, what="receipt", too_large=ReceiptMismatchError)
    try:
        return open_receipt(data, operators)
    except ShardtoolError as err:
        err.path = err.path or str(path)
        raise


class _Engines:
    """One replay engine for a whole sample (its verified weights stay cached from receipt to receipt), built
    at the first receipt that names these weights and rebuilt larger only for a longer receipt."""

    def __init__(self, directory: Path, verified, budget: int, readers: int):
        self.directory, self.verified, self.budget, self.readers = directory, verified, budget, readers
        self.engine = None
        self.built = 0

    def for_receipt(self, receipt):
        from shardtool.runtime import check_weights, replay_engine

        check_weights(receipt, self.verified)  # a receipt for other weights is refused before any engine is built
        if self.engine is not None and self.engine.max_request_tokens < receipt.positions + 1:
            self.close()
        if self.engine is None:
            self.engine = replay_engine(self.directory, self.verified, receipt.positions, budget=self.budget,
                                        readers=self.readers)
            self.built += 1
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _verify_one(opened, path: Path, trace: Path | None, directory: Path, verified, budget: int,
                readers: int, engines: _Engines | None = None) -> dict:
    from shardtool.manifest import MAX_TRACE_BYTES
    from shardtool.runtime import replay_receipt
    from shardtool.safeio import read_regular

    receipt, signer = opened
    trace_bytes = None
    if trace is not None:
        trace_bytes = read_regular(trace, MAX_TRACE_BYTES, what="routing trace", too_large=ReceiptMismatchError)
    try:
        engine = engines.for_receipt(receipt) if engines is not None else None
        verdict = replay_receipt(directory, verified, receipt, budget=budget, readers=readers, trace=trace_bytes,
                                 engine=engine)
    except ReceiptMismatchError as err:
        verdict = {"valid": False, "error": err.message}
    except ShardtoolError as err:
        if err.path is None and trace is not None and "routing trace" in err.message:
            err.path = str(trace)
        raise
    verdict.update({"receipt_id": receipt.id, "operator_keyid": signer.keyid, "model_id": receipt.model_id,
                    "manifest_version": receipt.manifest_version, "prompt_ids": list(receipt.prompt_ids),
                    "token_ids": list(receipt.token_ids), "finish_reason": receipt.finish_reason,
                    "request": {"max_new_tokens": receipt.max_new_tokens, "temperature": receipt.temperature,
                                "top_p": receipt.top_p, "seed": receipt.seed}})
    return verdict


def _receipts_in(directory: Path) -> list[str]:
    """Names of the regular *.receipt files directly in `directory` (links are not followed)."""
    if not directory.is_dir():
        raise UsageError("--sample needs a directory of *.receipt files", path=str(directory))
    names = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if len(names) >= MAX_LOG_ENTRIES:
                    raise UsageError(f"more than {MAX_LOG_ENTRIES} receipts in one directory", path=str(directory))
                if entry.name.endswith(RECEIPT_SUFFIX) and stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                    names.append(entry.name)
    except OSError as e:
        from shardtool.errors import StorageError
        raise StorageError(f"cannot list receipts: {e.strerror}", path=str(directory)) from e
    if not names:
        raise UsageError(f"no *{RECEIPT_SUFFIX} files here", path=str(directory))
    return sorted(names)


def _say_verdict(say, path: Path, v: dict) -> None:
    from shardtool.text import printable

    where = printable(str(path))
    if v.get("error"):
        say(f"verify-receipt: {where}: NOT VALID: {v['error']}")
        return
    if v["valid"]:
        ties = v["near_ties"]
        say(f"verify-receipt: {where}: VALID: receipt {v['receipt_id']} of {v['model_id']} v{v['manifest_version']}: "
            f"{len(v['prompt_ids'])} prompt + {len(v['token_ids'])} answer tokens replayed in "
            f"{v['replay_seconds']:.2f}s; near-ties tolerated: {ties['tokens']} token, {ties['routing']} routing, "
            f"{ties['fingerprint']} fingerprint")
        return
    d = v["first_divergence"]
    at = "the routing trace" if d["position"] < 0 else (
        f"position {d['position']}" + (f" (new token {d['token_index']})" if d["token_index"] is not None else
                                       " (prompt)") + (f", layer {d['layer']}" if d["layer"] is not None else ""))
    say(f"verify-receipt: {where}: NOT VALID: {d['check']} diverges at {at}: {d['detail']}")
