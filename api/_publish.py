"""A publisher's and an auditor's calls: sign a split model's manifest with a key file; check a directory against
trusted keys (the manifest's signatures, threshold, expiry and rollback floor, then every file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from shardtool.errors import VerificationError
from shardtool.layout import model_dir


@dataclass(frozen=True)
class Signed:
    """The manifest signed: where it is, the key that signed it, the signatures it now has, and a note on how the
    key file was protected (None when it was encrypted)."""

    manifest: Path
    keyid: str
    signatures: int
    note: str | None


@dataclass(frozen=True)
class Audit:
    """A directory compared with its verified manifest: `report.ok`, `report.findings` (each bad file named)."""

    manifest_path: Path
    manifest: object  # VerifiedManifest
    report: object  # AuditReport

    def __bool__(self) -> bool:
        return self.report.ok


def _manifest_path(directory: Path, manifest: str | Path | None) -> Path:
    from shardtool.manifest import default_manifest_path

    return Path(manifest) if manifest is not None else default_manifest_path(directory)


def sign(directory: str | Path, key: str | Path, *, passphrase: bytes | Callable[[], bytes] | None = None,
         manifest: str | Path | None = None) -> Signed:
    """Add a signature by the private key file `key` over the manifest's head (several publishers can sign one
    manifest). `passphrase`: for an encrypted key, or a function asked only when the key file is encrypted."""
    from shardtool.atomic import locked_directory
    from shardtool.keys import load_private_key
    from shardtool.manifest import load_manifest, save_manifest

    path = _manifest_path(model_dir(Path(directory)), manifest)
    private = load_private_key(key, passphrase)  # read once; the passphrase asked for only if it is encrypted
    # Read, add, write under a lock: two publishers signing at once must not lose one signature.
    with locked_directory(path.parent if str(path.parent) else Path(".")):
        current = load_manifest(path)
        signed = current.with_envelope(current.envelope.signed_by(private))
        save_manifest(path, signed)
    return Signed(path, private.public.keyid, len(signed.envelope.signatures), private.protection_note or None)


def trusted_manifest(directory: str | Path, trust: Sequence, *, threshold: int = 1, manifest: str | Path | None = None,
                     state_dir: str | Path | None = None, model_id: str | None = None):
    """The directory's manifest verified against `trust` (signatures, threshold, expiry, model pin, rollback
    floor): (its path, the VerifiedManifest); raises if it is not trustworthy."""
    from shardtool.keys import trusted_keys
    from shardtool.manifest import load_trusted_manifest

    path = _manifest_path(model_dir(Path(directory)), manifest)
    return path, load_trusted_manifest(path, trusted_keys(trust), threshold, Path(state_dir) if state_dir else None,
                                       model_id=model_id)


def audit_files(directory: str | Path, path: Path, verified, *, present_only: bool = False,
                follow_symlinks: bool = False, workers: int | None = None,
                progress: Callable[[int], None] | None = None) -> Audit:
    """Every file of `directory` compared with its verified manifest (read from `path`, which is not a model file
    when it lives there); `progress(n)` as bytes are hashed."""
    from shardtool.manifest import manifest_relpath
    from shardtool.manifest.audit import audit_directory

    directory = Path(directory)
    own = manifest_relpath(directory, path)
    # The OMS signature beside the manifest (`export-oms`) is signature material like the manifest, not a model file
    # (unless this manifest lists a file of that name: then it is checked like any other).
    from shardtool.manifest import SIGNATURE_NAME

    ignore = [] if own is None else [own]
    if not any(e.path == SIGNATURE_NAME for e in verified.entries):
        ignore.append(SIGNATURE_NAME)
    report = audit_directory(directory, verified, ignore=ignore, present_only=present_only,
                             follow_symlinks=follow_symlinks, workers=workers, progress=progress)
    return Audit(path, verified, report)


def audit(directory: str | Path, trust: Sequence, *, threshold: int = 1, manifest: str | Path | None = None,
          state_dir: str | Path | None = None, model_id: str | None = None, **options) -> Audit:
    """The manifest verified against `trust` (raises if it is not trustworthy), then every file compared with it
    (`audit_files`' options): the findings are reported, not raised (`verify` raises them)."""
    path, verified = trusted_manifest(directory, trust, threshold=threshold, manifest=manifest, state_dir=state_dir,
                                      model_id=model_id)
    return audit_files(directory, path, verified, **options)


def verify(directory: str | Path, trust: Sequence, **options) -> Audit:
    """`audit`, raising a VerificationError naming the first bad file (and how many there are) when any file does
    not match the signed manifest; returns the audit of a directory that does."""
    result = audit(directory, trust, **options)
    if not result.report.ok:
        findings = result.report.findings
        raise VerificationError(f"{len(findings)} file(s) do not match the signed manifest; first: "
                                f"{findings[0].line()}", path=str(directory), hint="shardtool audit names every one")
    return result

