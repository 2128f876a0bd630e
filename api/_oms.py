"""OpenSSF Model Signing from Python: `export_oms` (a publisher's OMS signature over a shardtool manifest's files,
what `shardtool export-oms` does) and `audit_oms` (a directory checked against an OMS signature and trusted EC
keys, what `shardtool audit --oms-signature` does)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from shardtool.layout import model_dir


@dataclass(frozen=True)
class OmsAudit:
    """A directory compared with a verified OMS statement: `report.ok`, `report.findings`; `statement` says what was
    signed (its `statement_sha256` names it)."""

    signature: Path
    statement: object  # OmsStatement
    report: object  # AuditReport

    def __bool__(self) -> bool:
        return self.report.ok


@dataclass(frozen=True)
class OmsExport:
    signature: Path
    keyid: str
    files: int
    statement_sha256: str
    note: str | None


def _inside(directory: Path, path: Path) -> list[str]:
    from shardtool.manifest import manifest_relpath

    rel = manifest_relpath(directory, path)
    return [rel] if rel is not None else []


def trusted_oms(signature: str | Path, trust: Sequence):
    """The statement of the OMS signature file `signature`, verified against the EC keys `trust`; raises."""
    from shardtool.keys import trusted_ec_keys
    from shardtool.manifest import open_oms_bundle, read_oms_bundle

    keys = trusted_ec_keys(trust)
    return open_oms_bundle(read_oms_bundle(Path(signature)), keys, where=str(signature))


def audit_oms(directory: str | Path, signature: str | Path, trust: Sequence, *, workers: int | None = None,
              progress: Callable[[int], None] | None = None) -> OmsAudit:
    """The OMS signature verified (raises if no trusted key signed it or it is malformed), then every file of
    `directory` compared with its statement: the findings are reported, not raised."""
    from shardtool.manifest import audit_oms as audit_directory

    directory = model_dir(Path(directory))
    statement = trusted_oms(signature, trust)
    report = audit_directory(directory, statement, skip=_inside(directory, Path(signature)), workers=workers,
                             progress=progress)
    return OmsAudit(Path(signature), statement, report)


def export_oms(directory: str | Path, key: str | Path, *, passphrase=None, manifest: str | Path | None = None,
               signature: str | Path | None = None, workers: int | None = None,
               progress: Callable[[int], None] | None = None) -> OmsExport:
    """Write an OMS signature (default DIR/model.sig) over the files of DIR's manifest, signed by the EC private key
    file `key`: every file is checked against the manifest (size, BLAKE3) as its SHA-256 is computed."""
    from shardtool.keys import load_ec_private_key
    from shardtool.manifest import SIGNATURE_NAME, default_manifest_path, export_oms as export, load_manifest

    directory = model_dir(Path(directory))
    path = Path(manifest) if manifest is not None else default_manifest_path(directory)
    out = Path(signature) if signature is not None else directory / SIGNATURE_NAME
    private = load_ec_private_key(key, passphrase)
    current = load_manifest(path)
    statement = export(directory, current, private, out, skip=_inside(directory, out) + _inside(directory, path),
                       workers=workers, progress=progress)
    return OmsExport(out, private.public.keyid, len(statement.resources), statement.statement_sha256.hex(),
                     private.protection_note or None)
