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

from shardtool.errors import (DigestMismatchError, MissingFileError, NotARegularFileError, ReceiptMismatchError,
                              ShardFormatError, ShardtoolError, UnreadableFileError, UsageError, VerificationError)

RECEIPT_SUFFIX = ".receipt"
TRACE_SUFFIX = ".trace"
MAX_LOG_ENTRIES = 1_000_000
# What a verified read of the validator's own model directory raises: in a spot-check these end the run, since a
# replay over bad local weights can judge no receipt.
_LOCAL_WEIGHT_FAULTS = (DigestMismatchError, MissingFileError, NotARegularFileError, UnreadableFileError,
                        ShardFormatError)


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
    threads: int = typer.Option(0, "--threads", min=0, max=1024, help="Compute threads (the weight products'); 0: automatic."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help="Manifest (default DIR/manifest.msgpack)."),
    stop_ids: Optional[str] = typer.Option(None, "--stop-ids", help="The stop token ids the request named, "
                                                                    "comma-separated (default: the signed "
                                                                    "config.json's end-of-sequence ids)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="The request asked for ignore_eos: it named no "
                                                                "stop token at all."),
    as_json: bool = typer.Option(False, "--json", help="The verdict as one JSON document on stdout."),
) -> None:
    """Verify a run receipt: operator signature, the weights it names, then a teacher-forced replay of prompt
    and answer (tokens, routing, activation fingerprint) within documented tolerances."""
    from shardtool.cli._common import emit_json, load_trusted, model_dir, say
    from shardtool.cli._common import keep_freed_memory, parse_size, set_compute_threads

    budget = parse_size(memory_budget)
    _check_sample(sample, sample_seed, trace)
    stops = _parse_stop_ids(stop_ids) if stop_ids is not None else None
    if ignore_eos:  # serve's ignore_eos runs with an empty stop list, which is what its receipt records
        if stops is not None:
            raise UsageError("give --ignore-eos or --stop-ids, not both")
        stops = ()
    if not operator:
        raise UsageError("no operator public key given", hint="pass --operator OPERATOR.pub (repeatable)")
    operators = [_load_public(p) for p in operator]
    trusted = load_trusted(trust)
    directory = model_dir(directory)
    set_compute_threads(threads, readers)
    keep_freed_memory()
    from shardtool.runtime import open_source

    def trusted_manifest():  # the same opening as open_model's, after the receipt's own checks
        return open_source(directory, trusted, threshold=threshold, manifest_file=manifest_file, state_dir=state_dir,
                           model_id=expect_model).manifest

    if sample is None:
        opened = _open(receipt, operators)  # a bad receipt is refused before the model is touched
        trace_bytes = _read_trace(trace) if trace is not None else None
        verdict = _verify_one(opened, receipt, trace, trace_bytes, directory, trusted_manifest(), budget, readers,
                              stops)
        if as_json:
            emit_json(verdict)
        if not as_json or not verdict["valid"]:  # a refusal is also one line on stderr, with --json too
            _say_verdict(say, receipt, verdict)
        raise typer.Exit(0 if verdict["valid"] else 1)
    names = _receipts_in(receipt)
    k = max(1, math.ceil(sample * len(names)))
    seed = sample_seed if sample_seed is not None else secrets.randbits(63)
    chosen = sorted(random.Random(seed).sample(names, k))
    verified = trusted_manifest()
    results = []
    engines = _Engines(directory, verified, budget, readers, stops)
    unchecked_exit = 0
    try:
        for name in chosen:
            path = receipt / name
            verdict, code = _judge(receipt, name, operators, directory, verified, budget, readers, stops, engines)
            unchecked_exit = unchecked_exit or code
            verdict["file"] = name
            results.append(verdict)
            if not as_json:
                _say_verdict(say, path, verdict)
    finally:
        engines.close()
    invalid = _log_summary(results, len(names), len(chosen), seed, engines.built, as_json)
    raise typer.Exit(1 if invalid else unchecked_exit)


def _log_summary(results: list[dict], listed: int, sampled: int, seed: int, built: int, as_json: bool) -> list[str]:
    """The sampled log's summary, printed; returns the invalid receipts' names."""
    from shardtool.cli._common import emit_json, say

    invalid = [r["file"] for r in results if r["valid"] is False]
    unchecked = [r["file"] for r in results if r["valid"] is None]
    valid = len(results) - len(invalid) - len(unchecked)
    summary = {"receipts": listed, "sampled": sampled, "sample_seed": seed, "valid": valid,
               "invalid": invalid, "unchecked": unchecked, "replay_engines_built": built, "results": results}
    if as_json:
        emit_json(summary)
    if not as_json or invalid or unchecked:
        say(f"verify-receipt: {valid} of {sampled} sampled receipts valid"
            + (f", {len(unchecked)} not checked" if unchecked else "")
            + f" ({listed} in the log, sample seed {seed})")
    return invalid


def _check_sample(sample: Optional[float], sample_seed: Optional[int], trace: Optional[Path]) -> None:
    if sample is not None and not (math.isfinite(sample) and 0 < sample <= 1):
        raise UsageError(f"--sample must be a fraction in (0, 1], got {sample}")
    if sample is not None and trace is not None:
        raise UsageError("--trace names one receipt's trace; with --sample, NAME.trace beside NAME.receipt is used")
    if sample is None and sample_seed is not None:
        raise UsageError("--sample-seed needs --sample")


def _judge(log: Path, name: str, operators, directory: Path, verified, budget: int, readers: int, stops,
           engines) -> tuple[dict, int]:
    """One sampled receipt of a log: its verdict, and the exit code it asks for when it could not be judged."""
    path = log / name
    trace_path = log / (name[: -len(RECEIPT_SUFFIX)] + TRACE_SUFFIX)
    # A NAME.trace that is present but a link or not a regular file is refused with its receipt, not skipped.
    if not os.path.lexists(trace_path):
        trace_path = None
    try:
        opened = _open(path, operators, in_log=True)
        trace_bytes = _read_trace(trace_path, in_log=True) if trace_path is not None else None
    except ShardtoolError as err:
        if err.exit_code != 1:  # gone or unreadable since the listing: no verdict on it either way
            return {"valid": None, "unchecked": err.one_line()}, err.exit_code
        return {"valid": False, "error": err.one_line()}, 0
    try:
        return _verify_one(opened, path, trace_path, trace_bytes, directory, verified, budget, readers, stops,
                           engines), 0
    except _LOCAL_WEIGHT_FAULTS as err:  # the replay's own weights failed: a local fault, not the node's
        raise VerificationError(f"the model directory failed verification while replaying {name} "
                                f"(no receipt is judged by it): {err.message}", path=err.path) from err
    except ShardtoolError as err:
        if err.exit_code == 1:  # e.g. a trace that does not open the receipt's routing root
            return {"valid": False, "error": err.one_line()}, 0
        # e.g. too small a --memory-budget for this receipt
        return {"valid": None, "unchecked": err.one_line()}, err.exit_code


def _parse_stop_ids(text: str) -> tuple[int, ...]:
    """'1,2' -> (1, 2): ASCII digits only (str.isdigit alone takes '²', which int() refuses)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or len(parts) > 64 or not all(p.isascii() and p.isdigit() and len(p) <= 10 for p in parts):
        raise UsageError(f"--stop-ids must be 1 to 64 comma-separated token ids, got {text[:80]!r}")
    ids = tuple(int(p) for p in parts)
    if max(ids) >= 2**31:
        raise UsageError(f"--stop-ids: token id {max(ids)} is out of range")
    return ids


def _load_public(path: Path):
    from shardtool.keys import load_public_key
    return load_public_key(path)


def _open(path: Path, operators, *, in_log: bool = False):
    """(receipt, signer): the file read capped by its size, its signature checked, then its payload decoded.
    `in_log`: a file of the --sample directory, which others may write: no link at its name is followed."""
    from shardtool.manifest import MAX_RECEIPT_BYTES, open_receipt
    from shardtool.safeio import read_regular

    if not os.path.lexists(path):
        raise UsageError("receipt file does not exist", path=str(path))
    data = read_regular(path, MAX_RECEIPT_BYTES, what="receipt", too_large=ReceiptMismatchError,
                        follow_link=not in_log)
    try:
        return open_receipt(data, operators)
    except ShardtoolError as err:
        err.path = err.path or str(path)
        raise


class _Engines:
    """One replay engine for a whole sample (its verified weights stay cached from receipt to receipt), built
    at the first receipt that names these weights and rebuilt larger only for a longer receipt."""

    def __init__(self, directory: Path, verified, budget: int, readers: int, stops):
        self.directory, self.verified, self.budget, self.readers = directory, verified, budget, readers
        self.stops = stops
        self.engine = None
        self.config = None
        self.built = 0

    def for_receipt(self, receipt):
        from shardtool.runtime import check_request, check_weights, replay_engine, verified_config

        check_weights(receipt, self.verified)  # a receipt for other weights is refused before any engine is built
        if self.config is None:
            self.config = verified_config(self.directory, self.verified)
        check_request(receipt, self.config, self.stops)  # and one no honest run served (past the context)
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


def _read_trace(path: Path, *, in_log: bool = False) -> bytes:
    """A routing trace's bytes, capped; `in_log` as for `_open`."""
    from shardtool.manifest import MAX_TRACE_BYTES
    from shardtool.safeio import read_regular

    return read_regular(path, MAX_TRACE_BYTES, what="routing trace", too_large=ReceiptMismatchError,
                        follow_link=not in_log)


def _verify_one(opened, path: Path, trace: Path | None, trace_bytes: bytes | None, directory: Path, verified,
                budget: int, readers: int, stops, engines: _Engines | None = None) -> dict:
    """`trace_bytes`: the routing trace read from `trace` (which names it in errors), or None."""
    from shardtool.runtime import replay_receipt

    receipt, signer = opened
    try:
        engine = engines.for_receipt(receipt) if engines is not None else None
        verdict = replay_receipt(directory, verified, receipt, budget=budget, readers=readers, trace=trace_bytes,
                                 engine=engine, stop_token_ids=stops)
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
                                "top_p": receipt.top_p, "seed": receipt.seed,
                                "stop_token_ids": list(receipt.stop_token_ids)}})
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
    if v.get("unchecked"):
        say(f"verify-receipt: {where}: NOT CHECKED: {v['unchecked']}")
        return
    if v.get("error"):
        say(f"verify-receipt: {where}: NOT VALID: {v['error']}")
        return
    if v["valid"]:
        ties, r = v["near_ties"], v["request"]
        # The request settings are printed so the client can compare them with what it asked for.
        say(f"verify-receipt: {where}: VALID: receipt {printable(v['receipt_id'])} of {printable(v['model_id'])} "
            f"v{v['manifest_version']}: {len(v['prompt_ids'])} prompt + {len(v['token_ids'])} answer tokens "
            f"(finish {v['finish_reason']}; max_new_tokens {r['max_new_tokens']}, temperature {r['temperature']:g}, "
            f"top_p {r['top_p']:g}, seed {r['seed']}, stop ids {r['stop_token_ids'][:8]}) replayed in "
            f"{v['replay_seconds']:.2f}s; near-ties tolerated: {ties['tokens']} token, {ties['routing']} routing, "
            f"{ties['fingerprint']} fingerprint")
        return
    d = v["first_divergence"]
    at = "the routing trace" if d["position"] < 0 else (
        f"position {d['position']}" + (f" (new token {d['token_index']})" if d["token_index"] is not None else
                                       " (prompt)") + (f", layer {d['layer']}" if d["layer"] is not None else ""))
    say(f"verify-receipt: {where}: NOT VALID: {d['check']} diverges at {at}: {d['detail']}")
