"""`shardtool plan`: place a verified model's experts, or with --pipeline its whole decoder layers, on the nodes of
a cluster (runtime/engine/_cluster_plan.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, List, Optional

import typer

from shardtool.cli._common import (DISK_GBPS_HELP, MANIFEST_HELP, disk_rate, emit_json, load_trusted, manifest_path,
                                   model_dir, parse_size, say, unpinned_warning)
from shardtool.errors import UsageError

MAX_NODE_TEXT = 100


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def parse_node(text: str) -> tuple[str, int, int | None, Path | None]:
    """'NAME=BUDGET[,disk=SIZE][,key=N.pub]' -> (name, memory budget, disk or None, key file or None); sizes as
    --memory-budget takes them."""
    from shardtool.runtime import NODE_NAME_PATTERN as NAME_PATTERN

    head, sep, rest = text[:MAX_NODE_TEXT + 1].partition("=")
    if len(text) > MAX_NODE_TEXT or not sep or not re.fullmatch(NAME_PATTERN, head, re.ASCII):
        raise UsageError(f"--node {text[:40]!r} is not NAME=BUDGET[,disk=SIZE][,key=N.pub] with NAME matching "
                         f"{NAME_PATTERN} (example: --node a=64GiB,disk=2TB,key=a.pub)")
    budget, *options = rest.split(",")
    disk = key_file = None
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key.strip() not in ("disk", "key") or (disk, key_file)[key.strip() == "key"] is not None:
            raise UsageError(f"--node {head}: {option[:40]!r} is not disk=SIZE or key=FILE (each given once)")
        if key.strip() == "disk":
            disk = parse_size(value, f"--node {head} disk")
        else:
            key_file = Path(value)
    return head, parse_size(budget, f"--node {head}"), disk, key_file


def plan(
    directory: Path = typer.Argument(..., help="Split model directory (only its manifest is read)."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold", help="Distinct trusted keys that must have signed."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help=MANIFEST_HELP),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a manifest signed for any other model (the publisher may sign several)."),
    node: List[str] = typer.Option([], "--node", help="NAME=BUDGET[,disk=SIZE][,key=N.pub] (repeatable, in plan "
                                                      "order): memory budget, disk and public key of one node."),
    replicas: int = typer.Option(1, "--replicas", min=1, max=16, help="Copies of each expert, on distinct nodes."),
    pipeline: bool = typer.Option(False, "--pipeline", help="place whole layers (trunk and experts) on nodes, in "
                                                            "order: one round per node per token instead of one per "
                                                            "MoE layer; replicas 1"),
    disk_gbps: float = typer.Option(2.0, "--disk-gbps", min=0.001, max=1e6, help=DISK_GBPS_HELP),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the plan here (atomically)."),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", help="Operator private key: sign the plan (PLAN.sig "
                                                                     "beside --out; a cluster uses only a signed plan "
                                                                     "whose nodes all have key=)."),
    passphrase_file: Optional[Path] = typer.Option(None, "--passphrase-file", help="Passphrase of --sign-key."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON document on stdout."),
) -> None:
    """Verify DIR's manifest, then place R copies of every expert on the nodes in proportion to their budgets (with
    --pipeline: consecutive spans of whole layers, one per node in the order given)."""
    from shardtool.atomic import atomic_write_bytes
    from shardtool.manifest import load_trusted_manifest
    from shardtool.keys import load_public_key
    from shardtool.runtime import encode_plan, make_plan, sign_plan, signature_path, summarize

    # Every option is checked before anything is read.
    if not node:
        raise UsageError("give at least one --node NAME=BUDGET[,disk=SIZE][,key=N.pub]")
    parsed = [parse_node(n) for n in node]
    nodes = [(name, budget, disk) for name, budget, disk, _ in parsed]
    if sign_key is not None and out is None:
        raise UsageError("--sign-key needs --out (the signature is written beside the plan)")
    if sign_key is None and passphrase_file is not None:
        raise UsageError("--passphrase-file needs --sign-key")
    if sign_key is not None and any(key is None for *_, key in parsed):
        name = next(n for n, *_, key in parsed if key is None)
        raise UsageError(f"--node {name} has no key=N.pub: a signed plan names every node's key")
    if not math.isfinite(disk_gbps):
        raise UsageError(f"--disk-gbps must be a finite number > 0, got {disk_gbps}")
    directory = model_dir(directory)
    trusted = load_trusted(trust)
    keys = {name: load_public_key(key) for name, _, _, key in parsed if key is not None}
    operator = None
    if sign_key is not None:  # before any work: a wrong key or passphrase fails here
        from shardtool.cli._common import load_operator_key
        operator = load_operator_key(sign_key, passphrase_file, option="--passphrase-file")
    verified = load_trusted_manifest(manifest_path(directory, manifest_file), trusted, threshold, state_dir,
                                     model_id=expect_model)
    made = make_plan(verified, nodes, replicas, keys, pipeline=pipeline)
    summary = summarize(made, verified, disk_gbps)
    if out is not None:
        data = encode_plan(made)
        if operator is not None:
            atomic_write_bytes(signature_path(out), sign_plan(data, operator))
            summary["signature"] = str(signature_path(out))
        atomic_write_bytes(out, data)
        summary["plan"] = str(out)
    if json_out:
        emit_json(summary)
    else:
        say(render(summary))
    if out is not None:
        say(f"wrote the plan for {len(made.nodes)} node(s) to {out}")
    if expect_model is None:
        say(unpinned_warning(verified.head.model_id))


def _size(n: int | None) -> str:
    from shardtool.text import format_size

    return "-" if n is None else format_size(n)


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def render(s: dict[str, Any]) -> str:
    """The summary as a table: one row per node (with its layers in a pipeline plan), then the coordinator, the
    cluster and one machine."""
    rate = disk_rate(s["disk_gbps"])
    pipeline = s["placement"] == "pipeline"
    head = ("node", *(("layers",) if pipeline else ()), "memory", "disk", "files", "on disk", "expert bytes/token",
            f"s/token at {rate}")
    rows = [(n["name"], *((_span(n["layers"]),) if pipeline else ()), _size(n["memory_budget"]), _size(n["disk"]),
             str(n["files"]), _size(n["bytes_on_disk"]), _size(n["expert_bytes_per_token"]),
             f"{n['seconds_per_token']:.3g}") for n in s["nodes"]]
    rows.append(("(coordinator)", *(("",) if pipeline else ()), "", "", str(s["coordinator"]["files"]),
                 _size(s["coordinator"]["bytes_on_disk"]), "embed, head" if pipeline else "trunk", ""))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    placement = "whole layers per node (pipeline)" if pipeline else f"{s['replicas']} replica(s)"
    lines = [f"plan for {s['model_id']} version {s['manifest_version']} (root {s['root'][:16]}...), "
             f"{placement}, {s['experts_per_token']} experts per token"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in [head, *rows]]
    c, one = s["cluster"], s["single_machine"]
    lines.append(f"cluster: {_size(c['expert_bytes_per_token'])} of experts per token on the busiest nodes, "
                 f"{c['seconds_per_token']:.3g} s/token; one machine: {_size(one['expert_bytes_per_token'])}, "
                 f"{one['seconds_per_token']:.3g} s/token (cold cache, disk only)")
    return "\n".join(lines)
