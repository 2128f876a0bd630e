"""`verify-and-run`: memory-budgeted MoE inference that uses no byte it has not verified."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import List, Optional

import typer

from shardtool.cli._common import (CACHE_POLICY_HELP, CLUSTER_GRAPH_HELP, INSECURE_CLUSTER_HELP, LOOKAHEAD_HELP,
                                   PAGE_CACHE_HELP, PLAN_TRUST_HELP, check_cache_policy, check_cluster_options,
                                   check_page_cache, cluster_args as _cluster_args,
                                   keep_freed_memory, load_trusted, parse_size, run_app, say, set_compute_threads,
                                   share_gil_with_readers, unpinned_warning)
from shardtool.cli._source import CACHE_HELP, FETCH_TIMEOUT_HELP, REMOTE_HELP, check_source
from shardtool.errors import UsageError
from shardtool.text import format_size

app = typer.Typer(name="verify-and-run", add_completion=False, pretty_exceptions_enable=False)

MAX_PROMPT_IDS = 1 << 20  # tokens; the memory budget usually refuses far fewer (KV cache, plan_budget)
MAX_TOKEN_ID = (1 << 31) - 1  # the largest id any vocabulary may have (checked against the model's own below)
MAX_SEED = 2**64 - 1


def parse_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]: ASCII digits, at most MAX_PROMPT_IDS ids, each at most MAX_TOKEN_ID."""
    if len(text) > MAX_PROMPT_IDS * 12:  # before splitting: no list of pieces bigger than the cap allows
        raise UsageError(f"--prompt-ids is longer than {MAX_PROMPT_IDS} token ids can be")
    pieces = [p.strip() for p in text.split(",") if p.strip()]
    if len(pieces) > MAX_PROMPT_IDS:
        raise UsageError(f"--prompt-ids has {len(pieces)} token ids, more than the cap of {MAX_PROMPT_IDS}")
    for p in pieces:
        if not (p.isascii() and p.isdigit() and len(p) <= 10 and int(p) <= MAX_TOKEN_ID):
            raise UsageError(f"--prompt-ids: {p[:20]!r} is not a token id (an integer from 0 to {MAX_TOKEN_ID})")
    if not pieces:
        raise UsageError("--prompt-ids needs at least one token id")
    return [int(p) for p in pieces]


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise UsageError(f"--prompt-ids: token id {bad} is outside this model's vocabulary of {vocab_size} ids")


class _TextStream:
    """Prints generated text as it is produced, through the runtime's incremental detokenizer."""

    def __init__(self, decode, print_ids: bool):
        from shardtool.runtime import Detokenizer

        self.print_ids = print_ids
        self.tokens = 0
        self.detok = Detokenizer(decode)

    def __call__(self, token: int) -> None:
        self.tokens += 1
        if self.print_ids:
            sys.stdout.write(("" if self.tokens == 1 else " ") + str(token))
        else:
            sys.stdout.write(self.detok.push(token))
        sys.stdout.flush()

    def finish(self) -> None:
        if not self.print_ids:
            sys.stdout.write(self.detok.finish())
        sys.stdout.write("\n")
        sys.stdout.flush()


@app.command()
def verify_and_run(
    directory: Optional[Path] = typer.Argument(None, help="Split model directory (shardtool split); or --remote."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold", help="Distinct trusted keys that must have signed."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (needs the model's tokenizer.json)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as token ids: 1,2,3."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=0, max=1_000_000),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 is greedy; finite."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, max=MAX_SEED),
    memory_budget: str = typer.Option("8GiB", "--memory-budget", help="Cached shards + KV cache + working buffers."),
    readers: int = typer.Option(2, "--readers", min=1, max=64, help="Reader/verifier threads."),
    cache_policy: Optional[str] = typer.Option(None, "--cache-policy", help=CACHE_POLICY_HELP),
    page_cache: Optional[str] = typer.Option(None, "--page-cache", help=PAGE_CACHE_HELP),
    threads: int = typer.Option(0, "--threads", min=0, max=1024,
                                help="Compute threads (the weight products'); 0: the cores the readers leave free, "
                                     "at least 1 (an OPENBLAS_NUM_THREADS or OMP_NUM_THREADS setting is kept)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help="Manifest (default DIR/manifest.msgpack)."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a manifest signed for any other model (the publisher may sign several)."),
    print_ids: bool = typer.Option(False, "--print-ids", help="Print token ids instead of text."),
    json_report: Optional[Path] = typer.Option(None, "--json-report", help="Write the run report as JSON here."),
    verify_all_first: bool = typer.Option(False, "--verify-all-first", help="Check every shard before the first token."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No report on stderr."),
    receipt_key: Optional[Path] = typer.Option(None, "--receipt-key", help="Operator private key: sign a run "
                                                                           "receipt (needs --receipt-out)."),
    receipt_passphrase_file: Optional[Path] = typer.Option(None, "--receipt-passphrase-file",
                                                           help="Passphrase of --receipt-key."),
    receipt_out: Optional[Path] = typer.Option(None, "--receipt-out", help="Write the signed run receipt here."),
    trace_out: Optional[Path] = typer.Option(None, "--trace-out", help="Write the run's routing trace here "
                                                                       "(verify-receipt --trace)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Ray cluster (HOST:PORT of its head) whose nodes "
                                                                  "compute the routed experts (needs --plan)."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="The cluster plan (shardtool plan); DIR then needs "
                                                                  "only its coordinator files."),
    plan_trust: List[Path] = typer.Option([], "--plan-trust", help=PLAN_TRUST_HELP),
    insecure_cluster: bool = typer.Option(False, "--insecure-cluster", help=INSECURE_CLUSTER_HELP),
    cluster_graph: bool = typer.Option(False, "--cluster-graph", help=CLUSTER_GRAPH_HELP),
    remote_timeout: float = typer.Option(30.0, "--remote-timeout", min=0.1, max=3600.0,
                                         help="Seconds a node has to answer one call before its replica is asked."),
    remote_store: List[str] = typer.Option([], "--remote", help=REMOTE_HELP),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=CACHE_HELP),
    fetch_timeout: float = typer.Option(60.0, "--fetch-timeout", help=FETCH_TIMEOUT_HELP),
    lookahead: bool = typer.Option(False, "--lookahead/--no-lookahead", help=LOOKAHEAD_HELP),
) -> None:
    """Verify the signed manifest, then generate, checking every shard's BLAKE3 before its weights are used."""
    # Every option is checked before anything is read: a bad value is one usage line, exit 2.
    budget, ids = parse_size(memory_budget), parse_ids(prompt_ids) if prompt_ids is not None else None
    _check_options(prompt, prompt_ids, temperature, top_p, receipt_key, receipt_out, trace_out,
                   receipt_passphrase_file, max_new_tokens)
    check_cluster_options(cluster, plan_file, remote_timeout, plan_trust, insecure_cluster, cluster_graph)
    check_source(directory, manifest_file, remote_store, cache_dir, fetch_timeout)
    page_cache = check_page_cache(page_cache)
    operator_key = None
    if receipt_key is not None:  # before any work: a wrong key or passphrase fails here, not after generating
        from shardtool.cli._common import load_operator_key
        operator_key = load_operator_key(receipt_key, receipt_passphrase_file)
    set_compute_threads(threads, readers)
    keep_freed_memory()
    if lookahead:
        share_gil_with_readers()
    from shardtool.runtime import DEFAULT_CACHE_POLICY, DEFAULT_PAGE_CACHE, open_model
    policy = check_cache_policy(cache_policy) or DEFAULT_CACHE_POLICY

    # A local DIR, or the store's files fetched into --cache-dir (the small files and the trunk now, each expert
    # when first routed to; with --cluster the nodes hold the experts, so none is fetched here).
    model = open_model(remote_store or directory, trust=load_trusted(trust), threshold=threshold,
                       model_id=expect_model, memory_budget=budget, cache_dir=cache_dir, fetch_timeout=fetch_timeout,
                       manifest=manifest_file, state_dir=state_dir, readers=readers, cache_policy=policy,
                       lookahead=lookahead, page_cache=page_cache or DEFAULT_PAGE_CACHE,
                       **_cluster_args(cluster, plan_file, plan_trust, insecure_cluster, remote_timeout, cluster_graph))
    with model:
        if ids is None:
            ids = model.encode(prompt)
            if not ids:
                raise UsageError("--prompt encodes to no tokens")
        # The KV cache is sized (and budgeted) for exactly this prompt plus the new tokens: a sequence the budget
        # cannot hold is refused here, before the first token.
        model.prepare(len(ids) + max_new_tokens)
        check_prompt_ids(ids, model.config.vocab_size)
        if verify_all_first:
            checked = model.verify_all()
            if not quiet:
                say(f"verified all {len(model.manifest.entries)} files ({format_size(checked)}) before the first token")
        out = _TextStream(model.decode, print_ids)
        model.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, on_token=out,
                       record=operator_key is not None)
        out.finish()
        summary = model.summary()
        signed = model.receipt(operator_key) if operator_key is not None else None
        if signed is not None:
            summary["receipt_id"] = signed.id
    _write_outputs(signed, summary, receipt_out, trace_out, json_report, quiet)
    if expect_model is None and not quiet:  # after the output: a refused run still prints one line only
        say(unpinned_warning(model.model_id))


def _check_options(prompt, prompt_ids, temperature, top_p, receipt_key, receipt_out, trace_out,
                   receipt_passphrase_file, max_new_tokens) -> None:
    if (prompt is None) == (prompt_ids is None):
        raise UsageError("give exactly one of --prompt and --prompt-ids")
    if not math.isfinite(temperature):
        raise UsageError(f"--temperature must be a finite number >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    if (receipt_key is None) != (receipt_out is None):
        raise UsageError("--receipt-key and --receipt-out go together")
    if receipt_key is None and (trace_out is not None or receipt_passphrase_file is not None):
        raise UsageError("--trace-out and --receipt-passphrase-file need --receipt-key")
    if max_new_tokens == 0 and receipt_key is not None:
        raise UsageError("a receipt covers an answer: --max-new-tokens must be at least 1 with --receipt-key")


def _write_outputs(signed, summary: dict, receipt_out, trace_out, json_report, quiet: bool) -> None:
    from shardtool.atomic import atomic_write_bytes

    if signed is not None:  # the trace first: a receipt on disk always has its trace beside it when asked for
        if trace_out is not None:
            atomic_write_bytes(trace_out, signed.trace)
        atomic_write_bytes(receipt_out, signed.data)
        if not quiet:
            say(f"wrote receipt {signed.id} to {receipt_out}" + (f" and its routing trace to {trace_out}"
                                                                  if trace_out is not None else ""))
    if json_report is not None:
        atomic_write_bytes(json_report, (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())
    if not quiet:
        _print_report(summary)


def _print_report(s: dict) -> None:
    def rate(x):
        return f"{x:.2f}" if x else "-"
    sec, pt, cache = s["seconds"], s["per_token_seconds"], s["cache"]
    say(f"verify-and-run: {s['model_id']} v{s['manifest_version']}: {s['prompt_tokens']} prompt + "
        f"{s['new_tokens']} new tokens; prefill {rate(s['prefill_tokens_per_s'])} tok/s, "
        f"decode {rate(s['decode_tokens_per_s'])} tok/s")
    say(f"  per token: read {pt['read'] * 1e3:.2f} ms, verify {pt['verify'] * 1e3:.2f} ms, "
        f"compute {pt['compute'] * 1e3:.2f} ms (reads and verification overlap compute; waited "
        f"{sec['waiting_for_shards']:.3f}s in all)")
    predicted = s["contract_expert_bytes_per_token_cold"]
    measured = s["decode_expert_bytes_per_token"]
    say(f"  bytes read: {format_size(s['bytes_read'])} ({format_size(s['bytes_read_per_token'])}/token); "
        f"expert bytes per decode token: measured {format_size(measured) if measured is not None else '-'}, "
        f"contract (cold) {format_size(predicted) if predicted else '-'}")
    cluster = s.get("cluster")
    if cluster is not None:
        fed = max(s["prompt_tokens"] + s["new_tokens"] - 1, 1)
        wall = sec["prefill"] + sec["decode"]
        dropped = ", ".join(cluster["dropped_nodes"]) or "none"
        say(f"  cluster: {cluster['calls']} node calls, {format_size(cluster['wire_bytes'] / fed)} on the wire per "
            f"token, {cluster['remote_seconds'] / wall if wall else 0:.0%} of the time in node calls; "
            f"{cluster['retries']} experts retried on a replica; nodes dropped: {dropped}")
    if cache["fetched_from_remote"]:
        say(f"  remote: {cache['fetched_from_remote']} shards fetched into the cache directory first "
            f"({cache['fetch_seconds']:.2f}s), each then read and verified like any other")
    say("  " + lookahead_line(s))
    say(f"  cache ({cache['policy']}): {cache['hits']} hits, {cache['misses']} misses, {cache['evictions']} evictions; "
        f"shard cache {format_size(s['budget']['shard_cache'])} of budget {format_size(s['budget']['total'])}; "
        f"peak RSS {format_size(s['peak_rss_bytes'])}")


def lookahead_line(summary: dict) -> str:
    """verify-and-run's report line on the lookahead: its recall, what its prefetches read, the expert cache's hit rate
    and the time the forward pass waited for shards per new token."""
    la, cache = summary["lookahead"], summary["cache"]
    waited = f"waited {summary['per_token_seconds']['waiting_for_shards'] * 1e3:.2f} ms per new token for shards"
    hit = cache["expert_hit_rate"]
    hits = f"expert cache hit rate {hit:.0%}" if hit is not None else "no experts asked for"
    if not la["enabled"]:
        why = " (the shard cache holds less than two layers' trunk + top-k experts)" if la["requested"] else ""
        return f"lookahead: off{why}; {hits}; {waited}"
    recall = f"recall {la['recall']:.0%} ({la['matched']} of {la['actual']})" if la["recall"] is not None else "no predictions"
    return (f"lookahead: on, from {la['predicted_from']}: {recall}; {la['prefetched']} experts prefetched, "
            f"{la['prefetch_used']} used; {hits}; {waited}")


def main(args: list[str] | None = None) -> None:
    run_app(app, args)
