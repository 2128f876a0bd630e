"""`shardtool push`: upload a signed split model to a store, shards first and the manifest last.

Each file is read once, beneath OUT without following links, hashed as it is uploaded, and committed on the
store only when its size and BLAKE3 are the manifest's (fsspec's transactional write: an S3 multipart upload
completed or aborted, a local temp file renamed or removed); a file the store already holds with the right size
and digest is skipped (its bytes are read back and hashed: a store's own checksum is not BLAKE3). The manifest
goes up only after every shard is in place, so a reader never sees a manifest whose shards are not yet there.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import blake3

from shardtool.errors import DigestMismatchError, StorageError, UsageError
from shardtool.manifest import MANIFEST_NAME, Entry, FileDigest, Manifest, check_entry, check_size, decode_manifest
from shardtool.atomic import atomic_writer_at
from shardtool.outdir import OutDir
from shardtool.remote._mirror import READ_CHUNK, MirrorFault, _FsspecMirror, check_url, open_mirror
from shardtool.safeio import open_beneath


@dataclass
class PushReport:
    url: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"url": self.url, "files": {"uploaded": len(self.uploaded), "already_present": len(self.skipped)},
                "bytes_uploaded": self.bytes_uploaded, "seconds": round(self.seconds, 3),
                "manifest": MANIFEST_NAME}


class _Target:
    """A writable store below a base URL. Reads (is a file already there?) go through the same hardened readers as
    pull (`open_mirror`); writes to a directory go through link-free descriptors and an atomic rename beside the
    final name (`OutDir`, `atomic_writer_at`), writes to any other fsspec store through its transactional write."""

    def __init__(self, url: str, timeout: float):
        scheme = check_url(url)
        if scheme in ("http", "https"):
            raise UsageError(f"cannot push to {url!r}: HTTP stores are read-only here",
                             hint="push to an object store (s3://bucket/prefix) or a directory")
        self.reader = open_mirror(url, timeout=timeout)
        self.label = self.reader.label
        self.dir = None
        if scheme in ("", "file", "local"):
            self.dir = OutDir(Path(urlsplit(url).path if scheme else url))
        else:
            self.store = _FsspecMirror(url, timeout)
            self.fs = self.store.fs

    def close(self) -> None:
        self.reader.close()
        if self.dir is not None:
            self.dir.close()

    def check_held(self, entry: Entry) -> None:
        """The entry check over the store's copy of `entry`: raises MirrorFault when it cannot be read (absent, a
        declared size other than the signed one), DigestMismatchError unless it has the entry's size and BLAKE3
        (every byte read back and hashed)."""
        stream = self.reader.open(entry.path, 0, entry.size)
        hasher, total = blake3.blake3(), 0
        try:
            while True:
                data = stream.read(READ_CHUNK)
                if not data:
                    break
                hasher.update(data)
                total += len(data)
        finally:
            stream.close()
        check_entry(entry, FileDigest(total, hasher.digest()), f"{self.label.rstrip('/')}/{entry.path}")

    def upload(self, relpath: str, chunks, where: str, check: Callable[[int, bytes], None]) -> int:
        """Write `chunks` to relpath in one transaction; `check(size, digest)` decides before the commit."""
        if self.dir is not None:
            return self._upload_to_directory(relpath, chunks, check)
        path = self.store.path(relpath)
        try:
            parent = path.rpartition("/")[0]
            protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
            if parent and "file" in protocols:  # object stores have no directories to make
                self.fs.makedirs(parent, exist_ok=True)
            f = self.fs.open(path, "wb", autocommit=False)
        except Exception as e:  # noqa: BLE001 - the store's own errors, whatever the backend
            raise StorageError(f"cannot start the upload: {e}", path=f"{self.label}/{relpath}") from None
        hasher, total, committed = blake3.blake3(), 0, False
        try:
            for data in chunks:
                hasher.update(data)
                total += len(data)
                f.write(data)
            check(total, hasher.digest())
            f.commit()
            committed = True
        except (UsageError, DigestMismatchError):
            raise
        except OSError as e:
            raise StorageError(f"upload failed: {e}", path=f"{self.label}/{relpath}") from None
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"upload failed: {type(e).__name__}: {e}", path=f"{self.label}/{relpath}") from None
        finally:
            if not committed:
                try:
                    f.discard()
                except Exception:  # noqa: BLE001 - the upload already failed; that error is the one to report
                    pass
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass
        return total


    def _upload_to_directory(self, relpath: str, chunks, check: Callable[[int, bytes], None]) -> int:
        dir_fd, name = self.dir.locate(relpath)  # directories opened without following links
        hasher, total = blake3.blake3(), 0
        with atomic_writer_at(dir_fd, name, where=f"{self.label.rstrip('/')}/{relpath}") as fh:
            for data in chunks:
                hasher.update(data)
                total += len(data)
                fh.write(data)
            check(total, hasher.digest())  # raising here removes the temp file: nothing is renamed into place
        return total


def _file_chunks(root: Path, entry: Entry):
    """The listed file's bytes in chunks, its size checked before the first one, and at most one byte read past
    the signed size (a file growing while it is uploaded is refused by the check before the commit, not sent whole)."""
    fd = open_beneath(root, entry.path)
    try:
        check_size(entry, os.fstat(fd).st_size, str(root / entry.path))
        sent = 0
        while sent <= entry.size:
            data = os.read(fd, min(READ_CHUNK, entry.size + 1 - sent))
            if not data:
                return
            sent += len(data)
            yield data
    finally:
        os.close(fd)


def push(out: Path, manifest_bytes: bytes, url: str, *, jobs: int = 4, timeout: float = 60.0,
         progress: Callable[[int], None] | None = None) -> PushReport:
    """Upload OUT's listed files, then `manifest_bytes` (OUT's signed manifest) as URL/manifest.msgpack."""
    manifest: Manifest = decode_manifest(manifest_bytes)
    if not manifest.envelope.signatures:
        raise UsageError("the manifest is not signed; a store should only ever hold signed manifests",
                         hint="run `shardtool sign` first")
    target = _Target(url, timeout)
    try:
        report = PushReport(target.label)
        lock = threading.Lock()
        start = time.monotonic()

        def one(entry: Entry) -> None:
            where = str(Path(out) / entry.path)
            try:
                target.check_held(entry)
            except (MirrorFault, DigestMismatchError):
                pass  # not there, or not these bytes: uploaded below
            else:
                with lock:
                    report.skipped.append(entry.path)
                if progress:
                    progress(entry.size)
                return

            def check(size: int, digest: bytes) -> None:
                check_entry(entry, FileDigest(size, digest), where)

            sent = target.upload(entry.path, _file_chunks(Path(out), entry), where, check)
            with lock:
                report.uploaded.append(entry.path)
                report.bytes_uploaded += sent
            if progress:
                progress(entry.size)

        with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="push") as pool:
            futures = [pool.submit(one, e) for e in sorted(manifest.entries, key=lambda e: -e.size)]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        # Last: the manifest. A reader who finds it finds every shard it lists already in place.
        target.upload(MANIFEST_NAME, [manifest_bytes], MANIFEST_NAME, lambda size, digest: None)
        report.uploaded.append(MANIFEST_NAME)
        report.bytes_uploaded += len(manifest_bytes)
        report.seconds = time.monotonic() - start
    finally:
        target.close()
    return report
