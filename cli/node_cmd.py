"""`shardtool node`: check this node's planned experts, join a Ray cluster and serve them to a coordinator
(`verify-and-run` / `serve` with --cluster) until SIGTERM or SIGINT."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import List, Optional

import typer

from shardtool.cli._common import CACHE_POLICY_HELP, INSECURE_CLUSTER_HELP, PLAN_TRUST_HELP
from shardtool.cli._source import CACHE_HELP, FETCH_TIMEOUT_HELP, REMOTE_HELP
from shardtool.errors import UnavailableError, UsageError

# How often the waiting node checks that its actor still answers (an actor that died ends the node, exit 3).
HEALTH_SECONDS = 5.0


def register(app: typer.Typer) -> None:
    app.command("node")(node)


def node(
    directory: Optional[Path] = typer.Argument(None, help="This node's directory: its planned expert shards, "
                                                          "config.json and the manifest; or --remote."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold", help="Distinct trusted keys that must have signed."),
    plan_file: Path = typer.Option(..., "--plan", help="The cluster plan (shardtool plan), signed (PLAN.sig)."),
    plan_trust: List[Path] = typer.Option([], "--plan-trust", help=PLAN_TRUST_HELP),
    name: str = typer.Option(..., "--name", help="This node's name in the plan."),
    node_key: Optional[Path] = typer.Option(None, "--node-key", help="This node's private key (shardtool keygen): the plan must "
                                                          "name its .pub for --name; it signs the node's info(), which "
                                                          "opens the sessions whose keys MAC its answers."),
    node_passphrase_file: Optional[Path] = typer.Option(None, "--node-passphrase-file",
                                                        help="Passphrase of --node-key."),
    insecure_cluster: bool = typer.Option(False, "--insecure-cluster", help=INSECURE_CLUSTER_HELP),
    memory_budget: str = typer.Option(..., "--memory-budget", help="Cached verified experts + working buffers."),
    address: str = typer.Option(..., "--address", help="The Ray cluster to join, HOST:PORT of its head (run "
                                                       "`ray start --address HOST:PORT` on this machine first when it "
                                                       "is not the head's)."),
    readers: int = typer.Option(2, "--readers", min=1, max=64,  # runtime's NODE_READERS: the plan's floors assume it
                                help="Reader/verifier threads."),
    cache_policy: Optional[str] = typer.Option(None, "--cache-policy", help=CACHE_POLICY_HELP),
    join_timeout: float = typer.Option(60.0, "--join-timeout", min=0.1, max=3600.0,
                                       help="Seconds to wait for the node's actor to start."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help="Manifest (default DIR/manifest.msgpack)."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a manifest signed for any other model (the publisher may sign several)."),
    remote_store: List[str] = typer.Option([], "--remote", help=REMOTE_HELP),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=CACHE_HELP + " A node fetches only the "
                                                                                    "experts it is asked for."),
    fetch_timeout: float = typer.Option(60.0, "--fetch-timeout", help=FETCH_TIMEOUT_HELP),
    max_sequences: int = typer.Option(16, "--max-sequences", min=1, max=4096,  # _cluster_spans.DEFAULT_MAX_SEQUENCES
                                      help="A pipeline plan's node: sequences whose keys and values it keeps (the "
                                           "least recently used is forgotten first); the budget holds them."),
    max_context: int = typer.Option(4096, "--max-context", min=2, max=1 << 20,  # DEFAULT_MAX_CONTEXT
                                    help="A pipeline plan's node: the most tokens of one sequence it runs."),
) -> None:
    """Verify the manifest and the plan, check every planned file (a missing or bad one: refuse to join, exit 1),
    then serve this node's experts to the cluster's coordinator; every load verified, also after eviction."""
    from shardtool.cli._common import check_cache_policy, load_operator_key, load_trusted, parse_size, say
    from shardtool.cli._source import check_source

    budget = parse_size(memory_budget)
    if not address or len(address) > 300:
        raise UsageError("--address must be the Ray head's HOST:PORT")
    check_source(directory, manifest_file, remote_store, cache_dir, fetch_timeout)
    policy = check_cache_policy(cache_policy)
    if not plan_trust:
        raise UsageError("give --plan-trust OPERATOR.pub: the plan's signature is checked before it is used")
    if node_key is None:
        raise UsageError("give --node-key NAME.key: the node signs its info() with the key the plan names for it")
    trusted = load_trusted(trust)
    operators = load_trusted(plan_trust)
    key = load_operator_key(node_key, node_passphrase_file, option="--node-passphrase-file")
    from shardtool.runtime import (DEFAULT_CACHE_POLICY, NODE_CONFIG, leave_cluster, load_signed_plan, node_alive,
                                   open_source, prepare_node, serve_node)

    # With --remote only config.json is fetched now; the node's actor fetches each planned expert when first asked.
    source = open_source(directory, trusted, threshold=threshold, manifest_file=manifest_file, remote=remote_store,
                         cache_dir=cache_dir, fetch_timeout=fetch_timeout, state_dir=state_dir, model_id=expect_model,
                         eager=lambda e: e.path == NODE_CONFIG, lazy=False)
    directory, verified = source.directory, source.manifest
    plan = load_signed_plan(plan_file, verified, operators)

    setup = prepare_node(directory, verified, plan, name, budget=budget, key=key, readers=readers,
                         remote=source.spec, cache_policy=policy or DEFAULT_CACHE_POLICY,
                         max_sequences=max_sequences, max_context=max_context)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    actor = None
    try:
        actor, info = serve_node(setup, address, timeout=join_timeout, insecure=insecure_cluster)
        say(f"node {name} ready: {len(info['experts'])} experts of {verified.head.model_id} "
            f"v{verified.head.version} (root {info['root'][:16]}...) in the Ray cluster at {address}; shard cache "
            f"policy {setup.cache_policy}")
        while not stop.wait(HEALTH_SECONDS):
            if not node_alive(actor, HEALTH_SECONDS * 6):
                raise UnavailableError(f"node {name}'s actor stopped answering; the node leaves the cluster")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if actor is not None:
            leave_cluster(actor)
    say(f"node {name}: stopped")
