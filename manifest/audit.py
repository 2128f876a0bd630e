"""Audit a model directory against a verified manifest: every listed file present, the right size and
BLAKE3 digest, and nothing present that is not listed. Findings are data, not exceptions.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from shardtool.errors import ShardtoolError, StorageError
from shardtool.manifest._document import VerifiedManifest
from shardtool.manifest._files import CHUNK, MissingFileError, NotARegularFileError, digest_fd, open_beneath
from shardtool.manifest._records import Entry
from shardtool.manifest._scan import walk

FINDING_CLASSES = ("missing", "size-mismatch", "digest-mismatch", "unlisted", "symlink", "not-a-regular-file",
                   "unreadable")


@dataclass(frozen=True)
class Finding:
    path: str
    finding: str
    detail: str
    kind: str | None = None
    layer: int | None = None
    expert: int | None = None
    expected_size: int | None = None
    expected_digest: str | None = None
    found_size: int | None = None
    found_digest: str | None = None

    def line(self) -> str:
        return f"{self.finding:<18} {self.path}: {self.detail}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AuditReport:
    findings: list[Finding] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # --present-only: listed, not held by this node
    files_checked: int = 0
    bytes_hashed: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

    def counts(self) -> dict[str, int]:
        out = {c: 0 for c in FINDING_CLASSES}
        for f in self.findings:
            out[f.finding] += 1
        return out


def _from_entry(entry: Entry, finding: str, detail: str, **found) -> Finding:
    return Finding(path=entry.path, finding=finding, detail=detail, kind=entry.kind, layer=entry.layer,
                   expert=entry.expert, expected_size=entry.size, expected_digest=entry.digest.hex(), **found)


def check_file(root: Path, entry: Entry, buffer: bytearray | None = None) -> Finding | None:
    """Hash one listed file and compare; return its finding or None when it matches."""
    try:
        fd = open_beneath(root, entry.path)
    except MissingFileError:
        return _from_entry(entry, "missing", "listed in the manifest, not on disk")
    except NotARegularFileError as e:
        return _from_entry(entry, e.finding, e.message)
    except StorageError as e:
        return _from_entry(entry, "unreadable", e.message)
    try:
        result = digest_fd(fd, buffer)
    except OSError as e:
        return _from_entry(entry, "unreadable", f"read failed: {e.strerror}")
    finally:
        os.close(fd)
    if result.changed:
        return _from_entry(entry, "unreadable", "file changed while it was being hashed", found_size=result.size)
    if result.size != entry.size:
        return _from_entry(entry, "size-mismatch", f"{result.size} bytes, manifest says {entry.size}",
                           found_size=result.size, found_digest=result.digest.hex())
    if result.digest != entry.digest:
        return _from_entry(entry, "digest-mismatch",
                           f"BLAKE3 {result.digest.hex()}, manifest says {entry.digest.hex()}",
                           found_size=result.size, found_digest=result.digest.hex())
    return None


def audit_directory(root: Path, manifest: VerifiedManifest, *, ignore: Iterable[str] = (),
                    present_only: bool = False, workers: int | None = None,
                    progress: Callable[[int], None] | None = None) -> AuditReport:
    """Compare `root` with `manifest`. `ignore`: relative paths that are not model files (the manifest
    itself when it lives in `root`). `progress(n)` is called with bytes hashed as they accrue."""
    listed = manifest.by_path()
    ignored = set(ignore)
    report = AuditReport()
    on_disk: dict[str, str] = {}
    for item in walk(root):
        if item.relpath in ignored:
            continue
        on_disk[item.relpath] = item.kind
        entry = listed.get(item.relpath)
        if item.kind == "directory":
            if entry is not None:
                report.findings.append(_from_entry(entry, "not-a-regular-file", "is a directory"))
            continue
        if entry is None:
            finding = {"file": "unlisted", "symlink": "symlink", "special": "not-a-regular-file"}[item.kind]
            detail = {"file": f"present ({item.size} bytes) but not listed in the manifest",
                      "symlink": "a symlink not listed in the manifest",
                      "special": "a special file not listed in the manifest"}[item.kind]
            report.findings.append(Finding(path=item.relpath, finding=finding, detail=detail, found_size=item.size))
        elif item.kind == "symlink":
            report.findings.append(_from_entry(entry, "symlink", "is a symlink; links are not followed"))
        elif item.kind == "special":
            report.findings.append(_from_entry(entry, "not-a-regular-file", "is a special file (FIFO, socket or device)"))
    to_hash = []
    for path, entry in listed.items():
        kind = on_disk.get(path)
        if kind is None:
            if present_only:
                report.absent.append(path)
            else:
                report.findings.append(_from_entry(entry, "missing", "listed in the manifest, not on disk"))
        elif kind == "file":
            to_hash.append(entry)
    report.findings.extend(_hash_all(root, to_hash, workers, progress, report))
    report.findings.sort(key=lambda f: (f.path, f.finding))
    return report


def _hash_all(root: Path, entries: list[Entry], workers: int | None, progress, report: AuditReport) -> list[Finding]:
    """Hash in a thread pool: BLAKE3 and reads release the GIL, so threads keep the disk busy."""
    workers = workers or min(8, (os.cpu_count() or 2) * 2)
    local = threading.local()
    lock = threading.Lock()

    def one(entry: Entry) -> Finding | None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(CHUNK)
        try:
            finding = check_file(root, entry, buf)
        except ShardtoolError as e:
            finding = _from_entry(entry, "unreadable", e.message)
        with lock:
            report.files_checked += 1
            report.bytes_hashed += entry.size
        if progress:
            progress(entry.size)
        return finding

    # Largest first, so one huge file does not start last and leave the other workers idle.
    ordered = sorted(entries, key=lambda e: -e.size)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [f for f in pool.map(one, ordered) if f is not None]
