"""The I/O around OMS signatures (`_oms`): a model directory checked against a verified OMS statement (audit's
findings, each listed file read once through the safe-open), and the OMS signature a publisher exports over the
files of a shardtool manifest (each file read once: its size and BLAKE3 checked against the manifest entry while
its SHA-256 is computed for the statement).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Sequence

import blake3

from shardtool.atomic import atomic_write_bytes
from shardtool.errors import DigestMismatchError, ShardtoolError, StorageError, UsageError, VerificationError
from shardtool.keys import EcPrivateKey
from shardtool.manifest._document import Manifest
from shardtool.manifest._files import FileDigest, check_entry, check_listed_digest, check_size
from shardtool.manifest._oms import GIT_PATHS, OmsResource, OmsStatement, make_oms_bundle, open_oms_bundle
from shardtool.manifest._paths import MAX_SEGMENTS
from shardtool.manifest._records import Entry
from shardtool.manifest._scan import walk
from shardtool.manifest.audit import AuditReport, Finding, open_finding
from shardtool.safeio import open_beneath

CHUNK = 4 * 1024 * 1024
_HASHERS: dict[str, Callable] = {"sha256": hashlib.sha256, "blake3": blake3.blake3}


class _Changed(Exception):
    """The file changed while it was read: its digest describes no single version of it."""


def _hash_fd(fd: int, hashers: Sequence, progress: Callable[[int], None] | None) -> int:
    """Read an open file to its end once, feeding every hasher; the bytes read. Raises _Changed when its size or
    modification time moved while it was read."""
    before = os.fstat(fd)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    while True:
        n = os.readv(fd, [buf])
        if n == 0:
            break
        for h in hashers:
            h.update(view[:n])
        total += n
        if progress is not None:
            progress(n)
    after = os.fstat(fd)
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or total != after.st_size:
        raise _Changed()
    return total


def _workers(workers: int | None) -> int:
    return workers or min(4, os.cpu_count() or 1)


# -- audit: a directory against a verified OMS statement -------------------------------------------------------

def _check_resource(root: Path, resource: OmsResource, hash_type: str,
                    progress: Callable[[int], None] | None) -> tuple[Finding | None, int]:
    """(the resource's finding or None, bytes hashed)."""
    expected = resource.digest.hex()
    try:
        fd = open_beneath(root, resource.name)
    except ShardtoolError as e:
        return Finding(resource.name, *open_finding(e, "the OMS statement"), expected_digest=expected), 0
    hasher = _HASHERS[hash_type]()
    try:
        size = _hash_fd(fd, [hasher], progress)
    except _Changed:
        return Finding(resource.name, "unreadable", "changed while it was hashed", expected_digest=expected), 0
    except OSError as e:
        return Finding(resource.name, "unreadable", f"read failed: {e.strerror}", expected_digest=expected), 0
    finally:
        os.close(fd)
    found = hasher.digest()
    try:
        check_listed_digest(resource.name, hash_type, resource.digest, found)
    except DigestMismatchError as e:
        return Finding(resource.name, e.finding, e.message, expected_digest=expected, found_size=size,
                       found_digest=found.hex()), size
    return None, size


_KIND_FINDINGS = {"symlink": "symlink", "special": "not-a-regular-file", "unreadable": "unreadable",
                  "too-deep": "unreadable"}


def _unlisted(root: Path, statement: OmsStatement, skip: Iterable[str]) -> list[Finding]:
    """Whatever lies in the directory that the statement neither lists nor ignores (OMS's verifier refuses a model
    with an extra file)."""
    listed = {r.name for r in statement.resources}
    skipped = set(skip)
    out = []
    for item in walk(root, max_depth=MAX_SEGMENTS):
        if item.kind == "directory" or item.relpath in listed or item.relpath in skipped:
            continue
        if statement.is_ignored(item.relpath):
            continue
        if item.kind == "file":
            out.append(Finding(item.relpath, "unlisted", "on disk, not in the OMS statement"))
        else:
            detail = item.detail or f"a {item.kind} the OMS statement does not list"
            out.append(Finding(item.relpath, _KIND_FINDINGS.get(item.kind, "not-a-regular-file"), detail))
    return out


def audit_oms(root: Path, statement: OmsStatement, *, skip: Iterable[str] = (), workers: int | None = None,
              progress: Callable[[int], None] | None = None) -> AuditReport:
    """Every file the verified statement lists read once and compared, and every file it does not list (nor
    ignores, nor `skip`s: the signature file itself) reported. Findings are data; trouble on our side raises."""
    report = AuditReport()
    with ThreadPoolExecutor(_workers(workers)) as pool:
        results = list(pool.map(lambda r: _check_resource(root, r, statement.hash_type, progress),
                                statement.resources))
    for finding, size in results:
        report.files_checked += 1
        report.bytes_hashed += size
        if finding is not None:
            report.findings.append(finding)
    report.findings.extend(_unlisted(root, statement, skip))
    report.findings.sort(key=lambda f: f.path)
    return report


# -- export: an OMS signature over a shardtool manifest's files -------------------------------------------------

def _entry_sha256(root: Path, entry: Entry, progress: Callable[[int], None] | None) -> OmsResource:
    """The entry's file read once: its size (before a byte is read) and BLAKE3 checked against the manifest, its
    SHA-256 returned. The manifest is the publisher's own: a file that does not match it raises."""
    fd = open_beneath(root, entry.path)
    try:
        check_size(entry, os.fstat(fd).st_size)
        sha, b3 = hashlib.sha256(), blake3.blake3()
        try:
            size = _hash_fd(fd, [sha, b3], progress)
        except _Changed:
            raise StorageError("file changed while it was being hashed", path=entry.path) from None
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror}", path=entry.path) from e
    finally:
        os.close(fd)
    check_entry(entry, FileDigest(size, b3.digest()))
    return OmsResource(entry.path, sha.digest())


def _check_tree(root: Path, manifest: Manifest, skip: Sequence[str]) -> None:
    """The directory holds exactly the manifest's files (besides `skip` and git's files): OMS's verifier hashes
    every file it finds, so a file the manifest does not list would make the export unverifiable."""
    listed = {e.path for e in manifest.entries}
    for item in walk(root, max_depth=MAX_SEGMENTS):
        rel = item.relpath
        if item.kind == "directory" or rel in listed or rel in skip:
            continue
        if any(rel == g or rel.startswith(g + "/") for g in GIT_PATHS):
            continue
        raise UsageError(f"is a {item.kind} the manifest does not list; an OMS verifier hashes every file of the "
                         "model, so it would refuse the export", path=str(root / rel),
                         hint="remove it, or rebuild the manifest with `shardtool manifest`")


def export_oms(root: Path, manifest: Manifest, key: EcPrivateKey, signature: Path, *, skip: Sequence[str],
               workers: int | None = None, progress: Callable[[int], None] | None = None) -> OmsStatement:
    """Write the OMS signature file `signature` over the manifest's files, atomically; the statement it signs.
    `skip`: the paths in `root` OMS verifiers must leave out (the signature file and the manifest, when in `root`)."""
    _check_tree(root, manifest, skip)
    try:
        with ThreadPoolExecutor(_workers(workers)) as pool:
            resources = list(pool.map(lambda e: _entry_sha256(root, e, progress), manifest.entries))
    except VerificationError as e:
        raise type(e)(f"does not match the manifest: {e.message}", path=e.path) from None
    bundle = make_oms_bundle(manifest.head.model_id, resources, [*skip, *GIT_PATHS], key)
    # Never write a signature that does not open: the verifier that will read it checks it now.
    statement = open_oms_bundle(bundle, [key.public], where=str(signature))
    atomic_write_bytes(signature, bundle, mode=0o644)
    return statement


def read_oms_bundle(path: Path) -> bytes:
    """The OMS signature file's bytes, capped before a byte is read; it may sit in the model directory, which others
    may write, so no link is followed at its name. A missing one is a verdict (exit 1), as a missing manifest is."""
    from shardtool.errors import ManifestFormatError, MissingFileError
    from shardtool.manifest._oms import MAX_BUNDLE_BYTES
    from shardtool.safeio import read_regular

    try:
        return read_regular(path, MAX_BUNDLE_BYTES, what="OMS signature", too_large=ManifestFormatError,
                            follow_link=False)
    except MissingFileError:
        raise VerificationError("no OMS signature here", path=str(path)) from None
