"""`shardtool split | join | inspect`: Hugging Face checkpoints in and out of the split layout, and what they cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Mapping, Optional

import typer

from shardtool import formats
from shardtool.text import format_rate, format_size, printable
from shardtool.cli._common import DISK_GBPS_HELP, disk_rate, emit_json, producer, say
from shardtool.errors import UsageError


# `--quantize` choices: the formats split writes (shardtool.formats), each with its bits per weight
_QUANTIZE = "|".join(formats.SPLIT_METHODS)
_QUANTIZE_BITS = ", ".join(f"{m}: {formats.BY_NAME[m].bits_per_weight():g}" for m in formats.SPLIT_METHODS)
_QUANTIZE_BLOCK = formats.BY_NAME[formats.SPLIT_METHODS[0]].block[1]


def register(app: typer.Typer) -> None:
    app.command("split")(producer(split))
    app.command("join")(join)
    app.command("inspect")(producer(inspect))


def split(
    checkpoint: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json + safetensors)."),
    out: Path = typer.Argument(..., help="Output directory for the split layout (created; reruns reuse shards)."),
    model_id: Optional[str] = typer.Option(
        None, "--model-id", help="Model identifier (default: the checkpoint's: config.json's _name_or_path, a "
                                 "Hugging Face cache repository, or the checkpoint directory's name; never OUT's)."),
    version: int = typer.Option(1, "--version", min=1, help="Manifest version; raise it for every release."),
    expires_in: int = typer.Option(365, "--expires-in", min=1, max=36500, help="Days until the manifest expires."),
    expert_pattern: Optional[str] = typer.Option(
        None, "--expert-pattern", metavar="REGEX",
        help="Regex with named groups 'layer' and 'expert' (optionally 'name') matching routed-expert tensor "
             "names, for a layout no built-in family knows."),
    fsync: bool = typer.Option(True, "--fsync/--no-fsync",
                               help="Flush all shards to disk (one syncfs) before writing the manifest, so a "
                                    "manifest on disk implies its shards are (--no-fsync: faster, not power-safe)."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", metavar=_QUANTIZE,
        help=f"Write every float routed-expert projection block-quantized (bits per weight: {_QUANTIZE_BITS}; "
             f"a float16 scale per {_QUANTIZE_BLOCK} weights; docs/shard-layout.md). Trunk, routers and shared "
             "experts are kept as stored, and so are experts already stored FP8 or MXFP4. Such a split cannot be "
             "joined back."),
    quantize_trunk: bool = typer.Option(
        False, "--quantize-trunk",
        help=f"With --quantize {' or '.join(formats.TRUNK_METHODS)}: the trunk's linear weights too (attention, "
             "shared and dense MLPs, lm_head), as llama.cpp's Q8_0 does; routers, norms and the embedding stay as "
             "stored."),
    force: bool = typer.Option(False, "--force", help="Replace a signed manifest already in OUT (its signatures "
                                                      "are lost: sign the new one again)."),
    json_out: bool = typer.Option(False, "--json", help="Print one summary document on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    oms_signature: Optional[Path] = typer.Option(
        None, "--oms-signature", help="Split only a checkpoint this OpenSSF Model Signing signature verifies "
        "(with --trust), and record its statement's digest in OUT/source.oms.json, a signed file of the split."),
    oms_trust: List[Path] = typer.Option([], "--trust", help="With --oms-signature: the OMS signer's EC public key "
                                         "(repeatable)."),
) -> None:
    """Split a MoE checkpoint into per-expert and trunk shards and write its unsigned manifest."""
    from shardtool.checkpoint import default_model_id, prepare_split, run_split
    from shardtool.cli._progress import Progress

    if not force:
        _refuse_signed_manifest(out)

    # Refusals (links out of the checkpoint or into OUT, layer numbers beyond the format, bad options) all
    # happen before the first byte is written; names from disk are escaped before they reach the terminal.
    if oms_trust and oms_signature is None:
        raise UsageError("--trust is for --oms-signature; split checks no other signature")
    statement = _oms_statement(oms_signature, oms_trust) if oms_signature is not None else None
    job = prepare_split(checkpoint, expert_pattern=expert_pattern, quantize=quantize, quantize_trunk=quantize_trunk,
                        oms=statement)
    model_id = model_id or default_model_id(job.checkpoint.root, job.checkpoint.config)
    with Progress(job.total_bytes, "split", enabled=not quiet) as progress:
        result = run_split(job, out, model_id=model_id, version=version,
                           expires_in_days=expires_in, on_bytes=progress.advance, fsync=fsync)
    if json_out:
        emit_json(result.summary())
    for name in result.skipped:
        say(f"note: not copied: {printable(name)} ({result.why_skipped[name]})")
    if result.stale:
        say(f"note: {len(result.stale)} file(s) under {printable(str(out))} are not part of this split (not in the "
            f"manifest), e.g. {printable(result.stale[0])}")
    if statement is not None:
        say(f"every file split read matched the OMS statement {statement.statement_sha256.hex()} signed by EC key "
            f"{statement.signer.keyid} (recorded in {printable(str(out / 'source.oms.json'))})")
    for line in result.quantized.lines() if result.quantized is not None else []:
        say(line)
    rate = result.bytes_total / result.seconds if result.seconds else 0.0
    say(f"split {result.family} checkpoint into {printable(str(out))}: {result.files_written} file(s) written, "
        f"{result.files_reused} reused, {format_size(result.bytes_total)} in {result.seconds:.1f} s "
        f"({format_rate(rate)}); unsigned manifest {printable(str(out / 'manifest.msgpack'))} for model "
        f"{result.model_id} version {result.version}")


def _oms_statement(signature: Path, trust: List[Path]):
    """The OMS statement, its signature verified against the trusted EC keys (raises). The checkpoint is not hashed
    here: split checks each file's signed digest on the very bytes it parses or copies (`prepare_split(oms=)`), so
    a file swapped or rewritten after a separate check could not slip through."""
    from shardtool.api import trusted_oms

    return trusted_oms(signature, trust)


def _refuse_signed_manifest(out: Path) -> None:
    """A split writes a new, unsigned manifest: over a signed one it would drop the publishers' signatures
    without a word. OUT itself a link is left to split's own refusal."""
    from shardtool.errors import VerificationError
    from shardtool.manifest import default_manifest_path, load_manifest

    path = default_manifest_path(out)
    if not out.is_dir() or out.is_symlink() or not path.is_file() or path.is_symlink():
        return
    try:
        signatures = len(load_manifest(path).envelope.signatures)
    except VerificationError:  # not a manifest this version reads: nothing signed to lose
        return
    if signatures:
        raise UsageError(f"holds a signed manifest ({signatures} signature(s)); split would replace it with an "
                         "unsigned one", path=str(path),
                         hint="pass --force to replace it and sign again, or split into another directory")


def join(
    out: Path = typer.Argument(..., help="Split directory (with manifest.msgpack)."),
    rebuilt: Path = typer.Argument(..., help="Where to rebuild the Hugging Face checkpoint (absent or empty)."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable); required unless "
                                                         "--insecure-no-verify."),
    threshold: int = typer.Option(1, "--threshold", min=1, help="Distinct trusted keys that must have signed."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a manifest signed for any other model (the publisher may sign several)."),
    insecure_no_verify: bool = typer.Option(
        False, "--insecure-no-verify",
        help="Do not check the manifest's signatures (a publisher's own unsigned split). Every file is still "
             "checked against the manifest's entries, which nothing vouches for."),
    json_out: bool = typer.Option(False, "--json", help="Print one summary document on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Verify the manifest (--trust) and every shard against it, and rebuild the original checkpoint,
    byte for byte per tensor."""
    from shardtool.checkpoint import join_checkpoint
    from shardtool.cli._progress import Progress
    from shardtool.cli._common import load_trusted, model_dir
    from shardtool.errors import VerificationError
    from shardtool.manifest import default_manifest_path, load_manifest, load_trusted_manifest

    out = model_dir(out)
    manifest_path = default_manifest_path(out)
    if insecure_no_verify:
        given = [flag for flag, used in (("--trust", bool(trust)), ("--threshold", threshold != 1),
                                         ("--state-dir", state_dir is not None),
                                         ("--model-id", expect_model is not None)) if used]
        if given:
            raise UsageError(f"{', '.join(given)} cannot be combined with --insecure-no-verify")
        try:
            manifest = load_manifest(manifest_path)
        except VerificationError as e:
            raise UsageError(e.message, path=e.path or str(manifest_path), hint=e.hint) from e
    else:
        if not trust:
            raise UsageError("join rebuilds from verified shards only: pass --trust KEY.pub",
                             hint="or --insecure-no-verify for your own unsigned split")
        manifest = load_trusted_manifest(manifest_path, load_trusted(trust), threshold, state_dir,
                                         model_id=expect_model)
    with Progress(sum(e.size for e in manifest.entries), "join", enabled=not quiet) as progress:
        result = join_checkpoint(out, rebuilt, manifest, on_bytes=progress.advance)
    if json_out:
        emit_json({**result.summary(), "verified_signatures": not insecure_no_verify,
                   "model_id": manifest.head.model_id, "version": manifest.head.version})
    say(f"rebuilt {result.files} file(s), {result.tensors} tensor(s) in {rebuilt} ({result.seconds:.1f} s)"
        + ("; WARNING: --insecure-no-verify: nobody's signature vouches for these files, they match only the "
           "manifest's unsigned entries" if insecure_no_verify else
           f"; every file verified against {manifest.head.model_id} version {manifest.head.version}"))


def inspect(
    out: Optional[Path] = typer.Argument(None, help="Split directory whose manifest carries the contract."),
    config: Optional[Path] = typer.Option(None, "--config", help="config.json alone (no weights needed)."),
    bits_per_weight: Optional[float] = typer.Option(None, "--bits-per-weight", min=0.001, max=64.0,
                                                    help="With --config: storage bits per weight (16 = BF16)."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", metavar=_QUANTIZE,
        help=f"With --config: routed experts as `split --quantize` writes them (bits per weight: {_QUANTIZE_BITS})."),
    disk_gbps: float = typer.Option(2.0, "--disk-gbps", min=0.001, max=1e6, help=DISK_GBPS_HELP),
    context: Optional[int] = typer.Option(None, "--context", min=0, max=1 << 40,
                                          help="Context length for the memory floor."),
    json_out: bool = typer.Option(False, "--json", help="Print one document on stdout."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw seconds per token against memory budget "
                                        "(cold, expected hit rate, the floor) as an SVG file here."),
    report: List[Path] = typer.Option([], "--report", help="With --plot: a verify-and-run --json-report, drawn as "
                                      "a measured point (repeatable)."),
) -> None:
    """Print the resource contract (bytes, experts, KV cache, memory floor) and seconds per token."""
    from shardtool.checkpoint import DEFAULT_CONTEXT_TOKENS, contract_from_config, estimate
    from shardtool.checkpoint import load_json

    if (out is None) == (config is None):
        raise UsageError("give either a split directory or --config config.json")
    if config is not None:
        if bits_per_weight is None:
            raise UsageError("--config needs --bits-per-weight")
        cfg = load_json(config)
        if not isinstance(cfg, dict):
            raise UsageError("config must be a JSON object", path=str(config))
        if quantize not in (None, *formats.SPLIT_METHODS):
            raise UsageError(f"--quantize must be {' or '.join(formats.SPLIT_METHODS)}, got {quantize!r:.40}")
        contract = contract_from_config(cfg, bits_per_weight, context_tokens=context or DEFAULT_CONTEXT_TOKENS,
                                        expert_quantize=quantize)
        source: dict[str, Any] = {"config": str(config), "bits_per_weight": bits_per_weight,
                                  "quantize": quantize}
    else:
        if bits_per_weight is not None:
            raise UsageError("--bits-per-weight applies to --config only; a split has measured sizes")
        if quantize is not None:
            raise UsageError("--quantize applies to --config only; a split's shards say what they hold")
        contract, source = _contract_of(out)
    if report and plot is None:
        raise UsageError("--report is drawn on the --plot picture: give --plot FILE.svg too")
    est = estimate(contract, disk_gbps=disk_gbps, context_tokens=context)
    if plot is not None:
        _plot(plot, report, contract, source, disk_gbps, context)
    if json_out:
        emit_json({**source, "contract": dict(contract), "disk_gbps": disk_gbps,
                   "seconds_per_token_cold": est.seconds_per_token_cold,
                   "tokens_per_second_cold": est.tokens_per_second_cold,
                   "seconds_to_load_trunk": est.seconds_to_load_trunk,
                   "min_memory_bytes": est.min_memory_bytes,
                   "context_tokens": context if context is not None else contract.get("context_tokens")})
    else:
        say(_render(contract, est, disk_gbps, context))


def _plot(plot: Path, reports: list[Path], contract: Mapping[str, int], source: dict[str, Any], disk_gbps: float,
          context: Optional[int]) -> None:
    """Every report is read and checked before the picture is written (atomically): a bad one writes nothing."""
    from shardtool.atomic import atomic_write_bytes
    from shardtool.checkpoint import contract_svg, load_json, measured_point
    from shardtool.errors import CheckpointFormatError

    points = []
    for path in reports:
        document = load_json(path)
        point = measured_point(document, str(path))
        ran = document.get("model_id")
        if "model_id" in source and ran != source["model_id"]:
            raise CheckpointFormatError(f"this run report is of model {printable(repr(ran)[:80])}, not "
                                        f"{source['model_id']!r}", path=str(path))
        points.append(point)
    title = (f"{source['model_id']} version {source['version']}" if "model_id" in source
             else f"{source['config']} at {source['bits_per_weight']:g} bits per weight")
    atomic_write_bytes(plot, contract_svg(contract, disk_gbps=disk_gbps, points=points, title=title,
                                          context_tokens=context))
    say(f"wrote {plot} ({len(points)} measured point(s))")


def _contract_of(out: Path) -> tuple[Mapping[str, int], dict[str, Any]]:
    from shardtool.checkpoint import check_contract_keys
    from shardtool.errors import CheckpointFormatError
    from shardtool.manifest import load_manifest

    path = out / "manifest.msgpack" if out.is_dir() else out
    if not path.is_file():
        raise UsageError("no manifest.msgpack found", path=str(out))
    manifest = load_manifest(path)  # a bad manifest: exit 2 for a producer (`producer`)
    if manifest.head.contract is None:
        raise UsageError("this manifest carries no resource contract (not made by `shardtool split`)", path=str(path))
    try:
        check_contract_keys(manifest.head.contract)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(e.message, path=str(path)) from None
    return manifest.head.contract, {"manifest": str(path), "model_id": manifest.head.model_id,
                                    "version": manifest.head.version}


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"


def _render(c: Mapping[str, int], est: Any, disk_gbps: float, context: Optional[int]) -> str:
    ctx = context if context is not None else c.get("context_tokens", 0)
    rate = disk_rate(disk_gbps)
    rows = [
        ("parameters (total / active per token)", f"{_count(c['params_total'])} / {_count(c['params_active'])}"),
        ("total bytes", format_size(c["total_bytes"])),
        ("trunk bytes (resident)", f"{format_size(c['trunk_bytes'])} ({format_size(c['resident_trunk_bytes'])} resident)"),
        ("expert bytes (all / one expert)", f"{format_size(c['expert_bytes_total'])} / {format_size(c['bytes_per_expert'])}"),
        ("layers (MoE / MTP)", f"{c['num_layers']} ({c['moe_layers']} MoE, {c['mtp_layers']} MTP)"),
        ("experts per layer / per token / shared", f"{c['experts_per_layer']} / {c['experts_per_token']} / "
                                                   f"{c['shared_experts']}"),
        ("expert bytes streamed per token (cold)", format_size(c["expert_bytes_per_token_cold"])),
        ("KV cache per token of context", f"{c['kv_cache_bytes_per_token']:,} bytes"),
        (f"minimum memory at {ctx:,} tokens of context", format_size(est.min_memory_bytes)),
        (f"seconds per token, cold, at {rate}", f"{est.seconds_per_token_cold:,.3f} s "
                                                            + (f"({est.tokens_per_second_cold:,.2f} tokens/s)"
                                                               if est.tokens_per_second_cold is not None else
                                                               "(no expert bytes stream per token)")),
        (f"seconds to load the trunk at {rate}", f"{est.seconds_to_load_trunk:,.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
