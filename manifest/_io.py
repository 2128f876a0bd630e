"""The thin I/O layer around the pure manifest code: read/write manifest files, hash a directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from shardtool.atomic import atomic_write_bytes
from shardtool.safeio import open_beneath, read_regular
from shardtool.errors import (ManifestFormatError, MissingFileError, NotARegularFileError, StorageError,
                              UsageError, VerificationError)
from shardtool.keys import PublicKey
from shardtool.manifest._document import (MAX_MANIFEST_BYTES, Manifest, VerifiedManifest, check_model_id,
                                          decode_manifest, verify_manifest)
from shardtool.manifest._files import digest_fd
from shardtool.manifest._paths import MAX_SEGMENTS, check_relpath
from shardtool.manifest._proof import MAX_PROOF_BYTES, ProvenEntry, verify_proof
from shardtool.manifest._records import Entry
from shardtool.layout import classify
from shardtool.manifest._scan import implied_directories, walk

MANIFEST_NAME = "manifest.msgpack"
# An OpenSSF Model Signing signature's name beside the model, as `model_signing sign` writes it by default.
SIGNATURE_NAME = "model.sig"


def default_manifest_path(model_dir: Path) -> Path:
    return Path(model_dir) / MANIFEST_NAME


def read_manifest_bytes(path: Path) -> bytes:
    """The manifest file's bytes, capped; a missing manifest is a verification failure, not an I/O error."""
    try:
        # The manifest usually sits in the model directory, which others may write: no link at its name.
        return read_regular(path, MAX_MANIFEST_BYTES, what="manifest", too_large=ManifestFormatError,
                            follow_link=False)
    except MissingFileError:
        raise VerificationError("no manifest here", path=str(path),
                                hint="run `shardtool manifest` or `shardtool split`, then `shardtool sign`") from None
    except NotARegularFileError as e:
        if e.found == "directory":
            raise VerificationError("manifest path is a directory", path=str(path)) from None
        raise VerificationError(f"manifest is not a regular file ({e.message})", path=str(path)) from None


def manifest_relpath(directory: Path, manifest: Path) -> str | None:
    """Where the manifest file sits inside `directory` ('/'-separated), or None when outside it. Worked out
    from the two paths as written, never by resolving links: a link swapped in after the manifest was read
    must not make audit skip some other file."""
    rel = os.path.relpath(os.path.abspath(manifest), os.path.abspath(directory))
    if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    return rel.replace(os.sep, "/")


def _with_path(err: Exception, path: Path) -> Exception:
    if getattr(err, "path", None) is None:
        err.path = str(path)
        err.args = (err.one_line(),)
    return err


def load_manifest(path: Path) -> Manifest:
    """Decode without checking signatures (publishers, inspection). Never use this to decide trust."""
    data = read_manifest_bytes(Path(path))
    try:
        return decode_manifest(data)
    except VerificationError as e:
        raise _with_path(e, path)


def load_verified_manifest(path: Path, trusted: Sequence[PublicKey], threshold: int,
                           now: int | None = None) -> VerifiedManifest:
    data = read_manifest_bytes(Path(path))
    try:
        return verify_manifest(data, trusted, threshold, now=now)
    except VerificationError as e:
        raise _with_path(e, path)


def load_trusted_manifest(path: Path, trusted: Sequence[PublicKey], threshold: int, state_dir: Path | None,
                          now: int | None = None, *, model_id: str | None = None) -> VerifiedManifest:
    """Everything audit, join and the runtime check before touching a model file: signatures, threshold,
    format, entries vs root, expiry, the model ID when pinned, and only then the rollback floor (which
    this call raises on success: nothing refused ever moves it)."""
    return trust_manifest_bytes(read_manifest_bytes(Path(path)), str(path), trusted, threshold, state_dir, now,
                                model_id=model_id)


def trust_manifest_bytes(data: bytes, where: str, trusted: Sequence[PublicKey], threshold: int,
                         state_dir: Path | None, now: int | None = None, *,
                         model_id: str | None = None) -> VerifiedManifest:
    """`load_trusted_manifest` over manifest bytes already in memory (`shardtool pull` fetched them, capped at
    MAX_MANIFEST_BYTES, from a mirror that `where` names): the same checks in the same order."""
    from shardtool.manifest._state import check_and_record, default_state_dir

    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestFormatError(f"manifest is {len(data)} bytes, more than the cap of {MAX_MANIFEST_BYTES}",
                                  path=where)
    try:
        verified = verify_manifest(data, trusted, threshold, now=now)
        check_model_id(verified.head, model_id)
    except VerificationError as e:
        raise _with_path(e, where)
    check_and_record(state_dir or default_state_dir(), verified.head, trusted)
    return verified


def load_trusted_proof(path: Path, trusted: Sequence[PublicKey], threshold: int, state_dir: Path | None,
                       now: int | None = None, *, model_id: str | None = None,
                       entry_path: str | None = None) -> ProvenEntry:
    """A proof file (from `shardtool prove`, received from a peer) checked like a manifest: signatures,
    threshold, inclusion under the signed root, freshness, the model ID and the entry asked for when
    pinned, and only then the rollback floor."""
    from shardtool.manifest._state import check_and_record, default_state_dir

    data = read_regular(path, MAX_PROOF_BYTES, what="proof", too_large=ManifestFormatError)
    try:
        proven = verify_proof(data, trusted, threshold, now=now)
        check_model_id(proven.head, model_id)
        if entry_path is not None and proven.entry.path != entry_path:
            # A genuine shard with its genuine proof, sent in place of the one asked for (substitution).
            raise VerificationError(f"the proof proves entry {proven.entry.path!r}, expected {entry_path!r}")
    except VerificationError as e:
        raise _with_path(e, path)
    check_and_record(state_dir or default_state_dir(), proven.head, trusted)
    return proven


def save_manifest(path: Path, manifest: Manifest) -> None:
    atomic_write_bytes(Path(path), manifest.to_bytes(), mode=0o644)


def hash_directory(root: Path, *, exclude: Sequence[str] = ()) -> list[Entry]:
    """Entries for every regular file below `root`; links, special files, unreadable directories and bad
    names are refused (this is a producer: the publisher's own directory, exit 2 on anything odd)."""
    root = Path(root)
    excluded = set(exclude)
    entries = []
    directories = []
    for item in walk(root, max_depth=MAX_SEGMENTS):
        if item.relpath in excluded:
            continue
        if item.kind == "directory":
            directories.append(item.relpath)
            continue
        where = str(root / item.relpath)
        if item.kind in ("unreadable", "too-deep"):
            raise UsageError(item.detail, path=where)
        if item.kind != "file":
            raise UsageError(f"is a {item.kind}; a manifest lists regular files only", path=where)
        try:
            check_relpath(item.relpath)
        except ManifestFormatError as e:
            raise UsageError(f"file name cannot go into a manifest: {e.message}", path=where) from e
        kind, layer, expert = classify(item.relpath)
        try:
            fd = open_beneath(root, item.relpath)
        except VerificationError as e:
            raise UsageError(e.message, path=where) from e
        try:
            result = digest_fd(fd)
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror}", path=where) from e
        finally:
            os.close(fd)
        if result.changed:
            raise StorageError("file changed while it was being hashed", path=where)
        entries.append(Entry(path=item.relpath, kind=kind, size=result.size, digest=result.digest, layer=layer,
                             expert=expert))
    implied = implied_directories([e.path for e in entries] + list(excluded))
    for reldir in directories:
        if reldir not in implied:  # audit would report it: a clean tree holds only directories files lie in
            raise UsageError("is an empty directory: a manifest lists files, and audit reports any directory "
                             "no listed file lies in; remove it", path=str(root / reldir))
    return entries
