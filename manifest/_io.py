"""The thin I/O layer around the pure manifest code: read/write manifest files, hash a directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Sequence

from shardtool._atomic import atomic_write_bytes
from shardtool.errors import ManifestFormatError, StorageError, UsageError, VerificationError
from shardtool.keys import PublicKey
from shardtool.manifest._document import MAX_MANIFEST_BYTES, Manifest, VerifiedManifest, decode_manifest, verify_manifest
from shardtool.manifest._files import digest_fd
from shardtool.manifest._paths import check_relpath
from shardtool.manifest._records import Entry
from shardtool.manifest._scan import classify, walk

MANIFEST_NAME = "manifest.msgpack"


def default_manifest_path(model_dir: Path) -> Path:
    return Path(model_dir) / MANIFEST_NAME


def read_manifest_bytes(path: Path) -> bytes:
    """The manifest file's bytes, capped; a missing manifest is a verification failure, not an I/O error."""
    try:
        # O_NONBLOCK: a FIFO planted in place of the manifest must not hang the verifier in open().
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise VerificationError("no manifest here", path=str(path),
                                hint="run `shardtool manifest` or `shardtool split`, then `shardtool sign`") from None
    except OSError as e:
        raise StorageError(f"cannot read manifest: {e.strerror}", path=str(path)) from e
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise VerificationError("manifest path is a directory", path=str(path))
        if not stat.S_ISREG(mode):  # a FIFO, socket or device: could block or never end
            raise VerificationError("manifest is not a regular file", path=str(path))
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise StorageError(f"cannot read manifest: {e.strerror}", path=str(path)) from e
    finally:
        os.close(fd)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestFormatError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes", path=str(path))
    return data


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
                          now: int | None = None) -> VerifiedManifest:
    """Everything audit and the runtime check before touching a model file: signatures, threshold,
    format, entries vs root, expiry, then the rollback floor (which this call raises on success)."""
    from shardtool.manifest._state import check_and_record, default_state_dir

    verified = load_verified_manifest(path, trusted, threshold, now=now)
    check_and_record(state_dir or default_state_dir(), verified.head, trusted)
    return verified


def save_manifest(path: Path, manifest: Manifest) -> None:
    atomic_write_bytes(Path(path), manifest.to_bytes(), mode=0o644)


def hash_directory(root: Path, *, exclude: Sequence[str] = ()) -> list[Entry]:
    """Entries for every regular file below `root`; links, special files and bad names are refused."""
    root = Path(root)
    excluded = set(exclude)
    entries = []
    for item in walk(root):
        if item.relpath in excluded or item.kind == "directory":
            continue
        if item.kind != "file":
            raise UsageError(f"is a {item.kind}; a manifest lists regular files only", path=str(root / item.relpath))
        try:
            check_relpath(item.relpath)
        except ManifestFormatError as e:
            raise UsageError(f"file name cannot go into a manifest: {e.message}", path=str(root / item.relpath)) from e
        kind, layer, expert = classify(item.relpath)
        fd = os.open(root / item.relpath, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            result = digest_fd(fd)
        finally:
            os.close(fd)
        if result.changed:
            raise StorageError("file changed while it was being hashed", path=str(root / item.relpath))
        entries.append(Entry(path=item.relpath, kind=kind, size=result.size, digest=result.digest, layer=layer,
                             expert=expert))
    return entries
