"""`shardtool pull` and `shardtool push`: a split model between a local directory and an untrusted store."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

import typer

from shardtool.cli._common import emit_json, producer, say
from shardtool.cli._source import check_timeout, check_urls
from shardtool.errors import UsageError

_LAYERS = re.compile(r"([0-9]{1,6})(?:-([0-9]{1,6}))?", re.ASCII)


def register(app: typer.Typer) -> None:
    app.command("pull")(pull)
    app.command("push")(producer(push))


def parse_layers(text: str) -> tuple[int, int]:
    m = _LAYERS.fullmatch(text.strip()) if len(text) <= 20 else None
    if not m:
        raise UsageError(f"--layers {text[:30]!r} is not a layer or a range of layers (examples: 3, 0-7)")
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) is not None else first
    if last < first:
        raise UsageError(f"--layers {text!r}: the range ends before it starts")
    return first, last


def pull(
    url: str = typer.Argument(..., help="The store holding the split model: https://…, s3://bucket/prefix, hf://…, "
                                        "a directory."),
    dest: Path = typer.Argument(..., help="Local directory to fill (created if absent)."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold", help="Distinct trusted keys that must have signed."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a manifest signed for any other model (the publisher may sign several)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    mirror: List[str] = typer.Option([], "--mirror", help="Another store with the same files, tried in order when "
                                                          "one serves wrong bytes, errors or stalls (repeatable)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Only these layers' files (A or A-B), plus the files "
                                                                "of no layer (config, tokenizer, embeddings)."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="A cluster plan (shardtool plan): with --node, only "
                                                                  "that node's share."),
    node_name: Optional[str] = typer.Option(None, "--node", help="The node of --plan whose share to pull."),
    jobs: int = typer.Option(16, "--jobs", min=1, max=64, help="Files fetched at once (many small files need many "
                                                               "in flight: each waits a round trip)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds a store has to answer one request (a stall "
                                                          "past it moves on to the next mirror)."),
    json_out: bool = typer.Option(False, "--json", help="Print a summary document on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary on stderr."),
) -> None:
    """Fetch a signed split model from untrusted stores: the manifest first, verified completely; then only the
    files it lists (and you select), each cut off at its signed size and renamed into place only when its BLAKE3
    matches; the manifest last. Rerun to resume."""
    from shardtool.cli._common import load_trusted, unpinned_warning
    from shardtool.cli._progress import Progress

    urls = check_urls([url, *mirror])
    check_timeout(timeout, "--timeout")
    span = parse_layers(layers) if layers is not None else None
    if (plan_file is None) != (node_name is None):
        raise UsageError("--plan and --node go together")
    trusted = load_trusted(trust)
    from shardtool.remote import RemoteSource, describe, fetch_trusted_manifest, pull as pull_files, select_entries

    mirrors = RemoteSource(tuple(urls), timeout).open()
    try:
        remote = fetch_trusted_manifest(mirrors, trusted, threshold, state_dir, model_id=expect_model)
        paths = None
        if plan_file is not None:
            from shardtool.runtime import load_plan, node_files
            paths = node_files(load_plan(plan_file, remote.manifest), node_name)
        entries = select_entries(remote.manifest, layers=span, paths=paths)
        total = sum(e.size for e in entries)
        with Progress(total, "pull", enabled=not quiet, files=len(entries)) as progress:
            report = pull_files(mirrors, dest, remote, entries, jobs=jobs, progress=progress.advance,
                                on_file=lambda outcome: progress.file_done(outcome.entry.size, outcome.downloaded))
    finally:
        for m in mirrors:
            m.close()
    if json_out:
        emit_json(report.to_dict())
    if not quiet:
        say(describe(report))
        for path, faults in _faulted(report):
            for fault in faults:
                say(f"  mirror fault: {path}: {fault.line()}")
    if report.failures:
        raise report.failures[0]
    if expect_model is None and not quiet:
        say(unpinned_warning(remote.manifest.head.model_id))


def _faulted(report):
    """(path, faults) of every file some mirror served wrong, served or not in the end (at most 20 lines)."""
    from shardtool.text import printable

    from shardtool.manifest import MANIFEST_NAME

    out = [(MANIFEST_NAME, list(report.remote.faults))] if report.remote.faults else []
    out += [(printable(o.entry.path), o.faults) for o in report.outcomes if o.faults]
    return out[:20]


def push(
    out: Path = typer.Argument(..., help="A signed split directory (shardtool split + sign)."),
    url: str = typer.Argument(..., help="Where to upload it: s3://bucket/prefix, or a directory."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help="Manifest (default OUT/manifest.msgpack)."),
    jobs: int = typer.Option(4, "--jobs", min=1, max=64, help="Files uploaded at once."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds the store has to answer one request."),
    json_out: bool = typer.Option(False, "--json", help="Print a summary document on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary on stderr."),
) -> None:
    """Upload the shards, then the signed manifest last (a reader never sees a manifest whose shards are not there
    yet); files the store already holds with the right size and BLAKE3 are skipped."""
    from shardtool.cli._common import manifest_path, model_dir
    from shardtool.cli._progress import Progress
    from shardtool.manifest import decode_manifest, read_manifest_bytes
    from shardtool.remote import push as push_files

    check_urls([url])
    check_timeout(timeout, "--timeout")
    out = model_dir(out)
    data = read_manifest_bytes(manifest_path(out, manifest_file))
    total = sum(e.size for e in decode_manifest(data).entries)
    with Progress(total, "push", enabled=not quiet) as progress:
        report = push_files(out, data, url, jobs=jobs, timeout=timeout, progress=progress.advance)
    if json_out:
        emit_json(report.to_dict())
    if not quiet:
        d = report.to_dict()
        from shardtool.text import format_size

        say(f"push: {d['files']['uploaded']} files uploaded ({format_size(report.bytes_uploaded)}), "
            f"{d['files']['already_present']} already present, manifest last, to {report.url} in {report.seconds:.1f}s")
