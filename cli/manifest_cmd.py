"""`shardtool manifest | sign | audit | export-oms`: build, sign and check the signed manifest of a model directory;
export and check OpenSSF Model Signing (OMS) signatures."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from shardtool.text import printable
from shardtool.cli._common import (MANIFEST_HELP, emit_json, load_trusted, manifest_path, model_dir, producer,
                                   relative_inside, say, unpinned_warning)
from shardtool.cli._passphrase import FILE_HELP as PASSPHRASE_FILE_HELP
from shardtool.errors import ShardtoolError, UsageError

def register(app: typer.Typer) -> None:
    app.command("manifest")(producer(manifest))
    app.command("sign")(producer(sign))
    app.command("export-oms")(producer(export_oms))
    app.command("audit")(audit)
    app.command("prove")(producer(prove))
    app.command("verify-shard")(verify_shard)


def manifest(
    directory: Path = typer.Argument(..., help="Model directory to hash."),
    model_id: Optional[str] = typer.Option(
        None, "--model-id", help="Model identifier (default: as split takes it: config.json's _name_or_path, a "
        "Hugging Face cache snapshot's repository, else the directory's name)."),
    version: int = typer.Option(1, "--version", min=1, help="Manifest version; raise it for every release."),
    expires_in: int = typer.Option(365, "--expires-in", min=1, max=36500, help="Days until the manifest expires."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help=MANIFEST_HELP),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Hash every file of an existing model directory into an unsigned manifest."""
    from shardtool.manifest import build_manifest, describe_head, hash_directory, save_manifest

    directory = model_dir(directory)
    out = manifest_path(directory, manifest_file)
    started = time.monotonic()
    from shardtool.manifest import SIGNATURE_NAME

    # An OMS signature (`export-oms`) signs the manifest's files and is left out of them, as the manifest is.
    entries = hash_directory(directory, exclude=relative_inside(directory, out) + [SIGNATURE_NAME])
    if model_id is None:
        from shardtool.checkpoint import default_model_id

        model_id = default_model_id(directory)
    built = build_manifest(entries, model_id=model_id, version=version, expires_in_days=expires_in)
    save_manifest(out, built)
    summary = {"manifest": str(out), "signed": False, **describe_head(built.head),
               "bytes": sum(e.size for e in built.entries), "seconds": round(time.monotonic() - started, 3)}
    if json_out:
        emit_json(summary)
    say(f"wrote {out}: {len(built.entries)} files, {summary['bytes']} bytes, version {version}, unsigned")


def sign(
    directory: Path = typer.Argument(..., help="Model directory whose manifest to sign."),
    key: Path = typer.Option(..., "--key", help="Private key file (NAME.key from `shardtool keygen`)."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help=MANIFEST_HELP),
    passphrase_file: Optional[Path] = typer.Option(None, "--passphrase-file",
                                                   help="For an encrypted --key. " + PASSPHRASE_FILE_HELP),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Add a signature over the manifest's head. Several publishers can sign the same manifest.

    An encrypted key's passphrase: --passphrase-file, else SHARDTOOL_PASSPHRASE, else a terminal prompt.

    A key written with `keygen --no-passphrase` needs none."""
    from shardtool.api import sign as sign_manifest
    from shardtool.cli._passphrase import get_passphrase

    # The key file is read once; the passphrase is asked for only if that file is encrypted. A bad input manifest:
    # exit 2 for a producer (`producer`).
    signed = sign_manifest(directory, key, passphrase=lambda: get_passphrase(passphrase_file, new_key=False),
                           manifest=manifest_file)
    if signed.note:
        say(f"note: {signed.note}")
    if json_out:
        emit_json({"manifest": str(signed.manifest), "keyid": signed.keyid, "signatures": signed.signatures})
    say(f"signed {signed.manifest} with key {signed.keyid} ({signed.signatures} signature(s) now)")


def audit(
    directory: Path = typer.Argument(..., help="Model directory (or the subset a node holds)."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold", help="Distinct trusted keys that must have signed."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help=MANIFEST_HELP),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state (default: ~/.local/state/shardtool)."),
    present_only: bool = typer.Option(False, "--present-only", help="Absent shards are listed, not failures."),
    follow_symlinks: bool = typer.Option(False, "--follow-symlinks",
                                         help="Check listed links through their targets, if they stay inside DIR."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, max=64, help="Hashing threads."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a manifest signed for any other model (the publisher may sign several)."),
    json_out: bool = typer.Option(False, "--json", help="Print one report document on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar; the verdict and findings are still "
                                                            "printed on stderr; the exit code says it: 0 OK."),
    oms_signature: Optional[Path] = typer.Option(
        None, "--oms-signature", help="Check DIR against this OpenSSF Model Signing signature (model.sig) instead of "
        "a shardtool manifest; --trust then names the signer's EC public key(s)."),
) -> None:
    """Verify the manifest's signatures, threshold, expiry and rollback floor, then every file.

    With --oms-signature: the OMS signature's EC key signature, then every file against its statement."""
    if oms_signature is not None:
        _manifest_only(threshold=threshold != 1, manifest=manifest_file, state_dir=state_dir, present_only=present_only,
                       follow_symlinks=follow_symlinks, model_id=expect_model)
        return _audit_oms(directory, oms_signature, trust, workers=workers, json_out=json_out, quiet=quiet)
    from shardtool.api import audit_files, trusted_manifest
    from shardtool.manifest import describe_head

    directory = model_dir(directory)
    trusted = load_trusted(trust)
    path = manifest_path(directory, manifest_file)
    started = time.monotonic()
    try:
        path, verified = trusted_manifest(directory, trusted, threshold=threshold, manifest=path, state_dir=state_dir,
                                          model_id=expect_model)
    except ShardtoolError as e:
        if json_out:
            emit_json({"ok": False, "manifest": str(path), "error": {"class": type(e).__name__, "message": e.one_line()}})
        raise
    report = _with_progress(sum(e.size for e in verified.entries), quiet, lambda advance: audit_files(
        directory, path, verified, present_only=present_only, follow_symlinks=follow_symlinks, workers=workers,
        progress=advance).report)
    seconds = time.monotonic() - started
    if json_out:
        emit_json({"ok": report.ok, "manifest": str(path), "directory": str(directory), "head": describe_head(verified.head),
                   "signers": [k.keyid for k in verified.signers], "counts": report.counts(),
                   "files_checked": report.files_checked, "bytes_hashed": report.bytes_hashed,
                   "absent": report.absent, "seconds": round(seconds, 3),
                   "findings": [f.to_dict() for f in report.findings]})
    head = verified.head
    say(f"manifest {head.model_id} version {head.version}: signed by {len(verified.signers)} trusted key(s) "
        f"({', '.join(k.keyid for k in verified.signers)}), threshold {threshold}")
    if expect_model is None:
        say(unpinned_warning(head.model_id))
    say(f"checked {report.files_checked} files, {report.bytes_hashed} bytes in {seconds:.2f}s"
        + (f"; {len(report.absent)} listed shard(s) absent (--present-only)" if present_only else ""))
    _verdict(report, "the signed manifest")


def _manifest_only(**given) -> None:
    """Refuse audit's options for a shardtool manifest when --oms-signature is given: OMS has no threshold, rollback
    state, model pin or subsets, and silently ignoring one would pass a check the operator asked for."""
    named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value not in (None, False)]
    if named:
        raise UsageError(f"{', '.join(named)} cannot apply to --oms-signature (an OMS signature has no threshold, "
                         "version, model pin or subset)", hint="see docs/manifest-format.md §9.4")


def _with_progress(total: int, quiet: bool, run):
    from shardtool.cli._progress import Progress

    with Progress(total, "audit", enabled=not quiet and total > 0) as progress:
        return run(progress.advance)


def _verdict(report, what: str) -> None:
    """Audit's last lines: OK, or the findings (at most 20) and exit 1."""
    if report.ok:
        say(f"audit OK: every file matches {what}")
        return
    counts = ", ".join(f"{n} {c}" for c, n in report.counts().items() if n)
    say(f"audit FAILED: {len(report.findings)} finding(s): {counts}")
    for finding in report.findings[:20]:
        say("  " + finding.line())
    if len(report.findings) > 20:
        say(f"  ... and {len(report.findings) - 20} more (use --json for all)")
    raise typer.Exit(1)


def _audit_oms(directory: Path, signature: Path, trust: List[Path], *, workers: Optional[int], json_out: bool,
               quiet: bool) -> None:
    """`audit --oms-signature`: the bundle verified with the trusted EC keys, then every file (no byte total is
    known before the files are opened: the progress bar counts bytes only)."""
    from shardtool.api import audit_oms

    directory = model_dir(directory)
    started = time.monotonic()
    try:
        result = _with_progress(0, quiet, lambda advance: audit_oms(directory, signature, trust, workers=workers,
                                                                    progress=advance))
    except ShardtoolError as e:
        if json_out:
            emit_json({"ok": False, "oms_signature": str(signature),
                       "error": {"class": type(e).__name__, "message": e.one_line()}})
        raise
    report, statement = result.report, result.statement
    seconds = time.monotonic() - started
    if json_out:
        emit_json({"ok": report.ok, "oms_signature": str(signature), "directory": str(directory),
                   "model_name": statement.model_name, "statement_sha256": statement.statement_sha256.hex(),
                   "hash_type": statement.hash_type, "signer": statement.signer.keyid, "counts": report.counts(),
                   "files_checked": report.files_checked, "bytes_hashed": report.bytes_hashed,
                   "seconds": round(seconds, 3), "findings": [f.to_dict() for f in report.findings]})
    say(f"OMS signature over {printable(statement.model_name)} ({len(statement.resources)} files, "
        f"{statement.hash_type}): signed by trusted EC key {statement.signer.keyid}; statement sha256 "
        f"{statement.statement_sha256.hex()}")
    say(f"checked {report.files_checked} files, {report.bytes_hashed} bytes in {seconds:.2f}s")
    _verdict(report, "the OMS statement")


def export_oms(
    directory: Path = typer.Argument(..., help="Model directory whose manifest lists the files to sign."),
    key: Path = typer.Option(..., "--key", help="EC private key (`shardtool keygen --algorithm ecdsa-p256`)."),
    signature: Optional[Path] = typer.Option(None, "--signature", help="OMS signature file to write "
                                             "(default: DIR/model.sig, where `model_signing verify` looks)."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help=MANIFEST_HELP),
    passphrase_file: Optional[Path] = typer.Option(None, "--passphrase-file",
                                                   help="For an encrypted --key. " + PASSPHRASE_FILE_HELP),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, max=64, help="Hashing threads."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Write an OpenSSF Model Signing signature over the files of DIR's manifest, for `model_signing verify key`.

    Every file is read once: checked against the manifest (size, BLAKE3) while its SHA-256 is computed; DIR must
    hold no file the manifest does not list. Ed25519 signatures on the manifest are unaffected."""
    from shardtool.api import export_oms as export
    from shardtool.cli._passphrase import get_passphrase

    started = time.monotonic()
    done = export(directory, key, passphrase=lambda: get_passphrase(passphrase_file, new_key=False),
                  manifest=manifest_file, signature=signature, workers=workers)
    if done.note:
        say(f"note: {done.note}")
    if json_out:
        emit_json({"oms_signature": str(done.signature), "keyid": done.keyid, "files": done.files,
                   "statement_sha256": done.statement_sha256, "seconds": round(time.monotonic() - started, 3)})
    say(f"wrote {done.signature}: OMS signature over {done.files} files with EC key {done.keyid}")


def prove(
    directory: Path = typer.Argument(..., help="Model directory whose manifest holds the entry."),
    entry: str = typer.Option(..., "--entry", help="Relative path of the shard, as listed in the manifest."),
    out: Optional[Path] = typer.Option(None, "--out", help="Proof file (default: stdout)."),
    manifest_file: Optional[Path] = typer.Option(None, "--manifest", help=MANIFEST_HELP),
) -> None:
    """Write a self-contained proof for one shard: signed head, entry, Merkle inclusion path."""
    from shardtool.atomic import atomic_write_bytes
    from shardtool.errors import VerificationError
    from shardtool.manifest import build_proof, load_manifest

    directory = model_dir(directory)
    path = manifest_path(directory, manifest_file)
    current = load_manifest(path)
    try:
        data = build_proof(current, entry)
    except VerificationError as e:
        raise type(e)(e.message, path=e.path or str(path)) from e
    if out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        atomic_write_bytes(out, data)
        say(f"wrote proof for {entry} ({len(data)} bytes, {len(current.envelope.signatures)} signature(s)) to {out}")


def verify_shard(
    shard: Path = typer.Argument(..., help="The shard file to check."),
    proof: Path = typer.Option(..., "--proof", help="Proof file from `shardtool prove`."),
    trust: List[Path] = typer.Option([], "--trust", help="Trusted public key (repeatable)."),
    threshold: int = typer.Option(1, "--threshold"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Rollback state directory."),
    expect_entry: Optional[str] = typer.Option(
        None, "--entry", help="The manifest path this shard must be (refuses a genuine proof of another entry)."),
    expect_model: Optional[str] = typer.Option(
        None, "--model-id", help="Refuse a proof signed for any other model (the publisher may sign several)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Check one shard against a proof, without the full manifest."""
    from shardtool.errors import MissingFileError
    from shardtool.manifest import load_trusted_proof
    from shardtool.manifest import verify_file

    trusted = load_trusted(trust)
    try:
        proven = load_trusted_proof(proof, trusted, threshold, state_dir, model_id=expect_model,
                                    entry_path=expect_entry)
    except MissingFileError:
        raise UsageError("proof file not found", path=str(proof)) from None  # the operator named it
    entry = proven.entry
    try:
        verify_file(shard, entry)
    except MissingFileError as e:
        raise UsageError("shard file not found", path=e.path) from None  # the operator named a file that is not there
    if json_out:
        emit_json({"ok": True, "shard": str(shard), "entry": entry.path, "kind": entry.kind, "layer": entry.layer,
                   "expert": entry.expert, "size": entry.size, "model_id": proven.head.model_id,
                   "version": proven.head.version, "signers": [k.keyid for k in proven.signers]})
    say(f"{printable(str(shard))}: OK, matches {entry.describe()} of {proven.head.model_id} version "
        f"{proven.head.version}, signed by {len(proven.signers)} trusted key(s)")
