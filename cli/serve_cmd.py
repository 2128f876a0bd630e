"""`shardtool serve`: verify the signed manifest once, then serve the model over an OpenAI-style HTTP API,
every weight still verified before use, every request inside one memory budget."""

from __future__ import annotations

import math
from pathlib import Path
from typing import List, Optional

import typer

from shardtool.cli._common import (CACHE_POLICY_HELP, CLUSTER_GRAPH_HELP, INSECURE_CLUSTER_HELP, LOOKAHEAD_HELP,
                                   PAGE_CACHE_HELP, PLAN_TRUST_HELP)
from shardtool.cli._source import CACHE_HELP, FETCH_TIMEOUT_HELP, REMOTE_HELP
from shardtool.errors import UsageError

# Connections and requests uvicorn lets in beyond the engine's batch and queue (health checks, scrapes, idle
# keep-alive connections); past the sum it answers 503 itself, before the engine's own 503 with Retry-After.
SPARE_CONNECTIONS = 128


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    directory: Optional[Path] = typer.Argument(None, help="Split model directory (shardtool split); or --remote."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold", help="Distinct trusted keys that must have signed."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a manifest signed for any other model; also the `model` clients name."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help="Manifest (default DIR/manifest.msgpack)."),
    memory_budget: str = typer.Option(..., "--memory-budget",
                                      help="Cached shards + KV cache of all requests + working buffers, e.g. 8GiB."),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="KV cache share of the budget (default: the "
                                                                     "engine's choice)."),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1, max=1 << 24,
                                              help="Most prompt + max_tokens tokens one request may ask for."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="0: any free port (printed)."),
    max_batch: int = typer.Option(16, "--max-batch", min=1, max=1024, help="Requests decoded together."),
    max_queue: int = typer.Option(64, "--max-queue", min=0, max=1 << 16,
                                  help="Requests waiting for admission; past it, HTTP 503 with Retry-After."),
    readers: int = typer.Option(2, "--readers", min=1, max=64, help="Reader/verifier threads."),
    cache_policy: Optional[str] = typer.Option(None, "--cache-policy", help=CACHE_POLICY_HELP),
    page_cache: Optional[str] = typer.Option(None, "--page-cache", help=PAGE_CACHE_HELP),
    threads: int = typer.Option(0, "--threads", min=0, max=1024,
                                help="Compute threads (the weight products'); 0: the cores the readers leave free, at least 1."),
    read_timeout: float = typer.Option(30.0, "--read-timeout", min=0.1, max=3600.0,
                                       help="Seconds a client has to send a request's headers, and again its body."),
    max_body: str = typer.Option("1MiB", "--max-body", help="Largest request body (HTTP 413 past it)."),
    receipt_key: Optional[Path] = typer.Option(None, "--receipt-key", help="Operator private key: sign a run "
                                                                         "receipt for every completion."),
    receipt_passphrase_file: Optional[Path] = typer.Option(None, "--receipt-passphrase-file",
                                                           help="Passphrase of --receipt-key (default: "
                                                                "SHARDTOOL_PASSPHRASE, then a prompt)."),
    max_receipts: int = typer.Option(4096, "--max-receipts", min=1, max=1 << 20,
                                     help="Receipts kept for GET /v1/receipts/{id} (the oldest is evicted)."),
    max_receipt_bytes: str = typer.Option("256MiB", "--max-receipt-bytes",
                                          help="Receipt + trace bytes kept in memory (outside --memory-budget)."),
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
    verify_all_first: bool = typer.Option(False, "--verify-all-first",
                                          help="Check every listed shard before the socket opens (exit 1 on any)."),
    allowed_hosts: List[str] = typer.Option([], "--allowed-hosts", help="Host header a request may carry: NAME or "
                                            "NAME:PORT (repeatable; default: the bound address and localhost)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SHARDTOOL_API_KEY", show_envvar=True,
                                          help="Every route but /health and the status page / (no data: it asks "
                                               "for the key) needs Authorization: Bearer KEY (prefer the "
                                               "environment variable: an argument shows in ps)."),
    ssl_certfile: Optional[Path] = typer.Option(None, "--ssl-certfile", help="HTTPS: certificate chain (PEM)."),
    ssl_keyfile: Optional[Path] = typer.Option(None, "--ssl-keyfile", help="HTTPS: its private key (PEM)."),
    access_log: bool = typer.Option(True, "--access-log/--no-access-log",
                                    help="One line per request on stderr: client, method, path, status, seconds."),
) -> None:
    """Serve a verified model: POST /v1/completions and /v1/chat/completions (OpenAI-style, streaming as
    server-sent events), GET /v1/models, /health, /metrics; with --receipt-key, a signed run receipt per
    completion and GET /v1/receipts/{id}."""
    from shardtool.cli._common import (check_cache_policy, check_cluster_options, check_page_cache, cluster_args,
                                       keep_freed_memory, load_operator_key, load_trusted, parse_size, say,
                                       set_compute_threads, share_gil_with_readers)
    from shardtool.cli._source import check_source

    # Every option is checked before anything is read: a bad value is one usage line, exit 2.
    budget = parse_size(memory_budget)
    kv_bytes = parse_size(kv_cache, "--kv-cache") if kv_cache is not None else None
    body_cap = parse_size(max_body, "--max-body")
    receipt_bytes = parse_size(max_receipt_bytes, "--max-receipt-bytes")
    if not math.isfinite(read_timeout):
        raise UsageError(f"--read-timeout must be a number of seconds, got {read_timeout}")
    check_cluster_options(cluster, plan_file, remote_timeout, plan_trust, insecure_cluster, cluster_graph)
    check_source(directory, manifest_file, remote_store, cache_dir, fetch_timeout)
    page_cache = check_page_cache(page_cache)
    # Before anything loads numpy (shardtool.serve does): OpenBLAS sizes its thread pool as it loads. Loaded first,
    # it ran attention's products on 2 spinning threads beside the kernels', and 16 chat prompts' prefill steps took
    # twice the wall time of the same steps with the one BLAS thread the kernels leave it.
    set_compute_threads(threads, readers)
    from shardtool.serve import Access, Limits, Stopped, check_tls_files, stop_on_signals
    access = Access(tuple(allowed_hosts) or None, api_key)
    check_tls_files(*(str(p) if p is not None else None for p in (ssl_certfile, ssl_keyfile)))
    if receipt_key is None and receipt_passphrase_file is not None:
        raise UsageError("--receipt-passphrase-file needs --receipt-key")
    operator_key = None
    if receipt_key is not None:  # before any work: a wrong key or passphrase fails here, not at the first request
        operator_key = load_operator_key(receipt_key, receipt_passphrase_file)
    keep_freed_memory()
    if lookahead:
        share_gil_with_readers()
    from shardtool.runtime import DEFAULT_CACHE_POLICY, DEFAULT_PAGE_CACHE, open_model  # loads numpy
    policy = check_cache_policy(cache_policy) or DEFAULT_CACHE_POLICY
    settings = _settings(read_timeout, max_batch + max_queue, ssl_certfile, ssl_keyfile)
    with stop_on_signals():
        try:
            # A local DIR, or the store's small files and trunk fetched into --cache-dir now and each expert when
            # first routed to (with --cluster the nodes hold the experts).
            model = open_model(remote_store or directory, trust=load_trusted(trust), threshold=threshold,
                               model_id=expect_model, memory_budget=budget, cache_dir=cache_dir,
                               fetch_timeout=fetch_timeout, manifest=manifest_file, state_dir=state_dir,
                               readers=readers, cache_policy=policy, lookahead=lookahead,
                               page_cache=page_cache or DEFAULT_PAGE_CACHE,
                               **cluster_args(cluster, plan_file, plan_trust, insecure_cluster, remote_timeout,
                                              cluster_graph))
        except Stopped:
            say("shardtool serve: stopped before serving")
            return
        with model:
            _run(model, verify_all_first, dict(max_batch=max_batch, max_queue=max_queue, kv_cache=kv_bytes,
                                               max_context=max_context),
                 (operator_key, access, settings, host, port, expect_model, policy,
                  Limits(max_body_bytes=body_cap, body_timeout=read_timeout), max_receipts, receipt_bytes,
                  access_log))
    say("shardtool serve: stopped")


def _run(model, verify_all_first: bool, engine_options: dict, serving: tuple) -> None:
    """The serving engine over the opened model, every shard checked first with --verify-all-first, then the HTTP
    server until a signal. The engine's reader threads end on every path, a refused --verify-all-first included."""
    from shardtool.cli._common import say
    from shardtool.serve import Stopped

    try:
        engine = model.engine(**engine_options)
    except Stopped:
        say("shardtool serve: stopped before serving")
        return
    try:
        if verify_all_first:
            try:
                checked = model.verify_all()
            except Stopped:
                say("shardtool serve: stopped before serving")
                return
            say(f"verified all {len(model.manifest.entries)} files ({checked / 2**20:.1f} MiB) before serving")
        _serve(engine, model, *serving)
    except Stopped:
        pass
    finally:
        engine.close()


def _settings(read_timeout: float, requests: int, ssl_certfile: Optional[Path], ssl_keyfile: Optional[Path]):
    from shardtool.serve import ServerSettings

    return ServerSettings(header_timeout=read_timeout, limit_concurrency=requests + SPARE_CONNECTIONS,
                          ssl_certfile=ssl_certfile and str(ssl_certfile), ssl_keyfile=ssl_keyfile and str(ssl_keyfile))


def _serve(engine, model, operator_key, access, settings, host: str, port: int, expect_model, policy: str, limits,
           max_receipts: int, receipt_bytes: int, access_log: bool) -> None:
    """Serve until stopped: the app over the engine, on a socket bound now."""
    from shardtool.cli._common import say, unpinned_warning
    from shardtool.serve import ChatTemplate, ReceiptSigner, bind, create_app, run, url_of

    if engine.tokenizer is None:
        raise UsageError("this model ships no tokenizer.json: serve answers with text, so it needs one",
                         hint="use verify-and-run --prompt-ids --print-ids")
    chat = ChatTemplate.from_tokenizer_config(engine.signed_json("tokenizer_config.json"),
                                              engine.signed_text("chat_template.jinja"))
    if isinstance(chat.problem, Exception) and not isinstance(chat.problem, UsageError):
        say(f"warning: chat is unavailable (/v1/chat/completions answers 500): {chat.problem.one_line()}")
    receipts = (ReceiptSigner(operator_key, model.manifest, engine.config, max_receipts, receipt_bytes)
                if operator_key is not None else None)
    app = create_app(engine, model_id=model.model_id, chat=chat, limits=limits, receipts=receipts, access=access,
                     access_log=say if access_log else None)
    app.state.renderer.warm()  # chat template workers started now, not at the first chat request
    sock = bind(host, port)
    try:
        engine.start()
        if expect_model is None:
            say(unpinned_warning(model.model_id))
        say(f"serving {model.model_id} on {url_of(sock, settings.tls)} (shard cache policy {policy})")
        run(app, sock, settings)
    finally:
        sock.close()
