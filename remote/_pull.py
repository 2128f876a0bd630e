"""`shardtool pull`: a verified copy of a split model (or the part of it a caller selects) from untrusted mirrors.

1. The manifest is fetched (capped at MAX_MANIFEST_BYTES) and verified completely, as `load_trusted_manifest`
   would verify it from disk, before any other file is asked for (`fetch_trusted_manifest`).
2. Only files that manifest lists are fetched, only those selected, each to its listed path below DEST through
   descriptors that never follow a link (`OutDir`); every file takes the bounded, verified path of `_fetch`.
3. A stale manifest in DEST is removed before the first file is touched, and the verified manifest's bytes are
   written last, after one flush of DEST's filesystem: DEST never looks complete before it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from shardtool.atomic import atomic_writer_at, sync_filesystem
from shardtool.errors import StorageError, UsageError
from shardtool.keys import PublicKey
from shardtool.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Entry, VerifiedManifest, trust_manifest_bytes
from shardtool.outdir import OutDir
from shardtool.text import format_rate, format_size, printable
from shardtool.remote._fetch import Fault, FetchFailed, Outcome, fetch_bytes, fetch_entry
from shardtool.remote._mirror import Mirror


@dataclass(frozen=True)
class TrustedRemote:
    """A manifest fetched from a mirror and verified: the checked document and its exact bytes."""

    manifest: VerifiedManifest
    data: bytes
    mirror: str  # which mirror's copy was accepted
    faults: tuple[Fault, ...] = ()  # the mirrors asked before it, and why their copies were refused


def fetch_trusted_manifest(mirrors: Sequence[Mirror], trusted: Sequence[PublicKey], threshold: int,
                           state_dir: Path | None, *, model_id: str | None = None,
                           now: int | None = None) -> TrustedRemote:
    """The first mirror's manifest that passes every check (signatures, threshold, head, entries, freshness,
    the model ID when pinned, then the rollback floor); a mirror whose copy fails is reported and the next is
    asked. Nothing else is requested from any mirror before this returns."""
    def accept(data: bytes, mirror: Mirror) -> VerifiedManifest:
        return trust_manifest_bytes(data, f"{mirror.label.rstrip('/')}/{MANIFEST_NAME}", trusted, threshold,
                                    state_dir, now, model_id=model_id)

    verified, mirror, faults = fetch_bytes(mirrors, MANIFEST_NAME, MAX_MANIFEST_BYTES, _keep_bytes(accept))
    manifest, data = verified
    return TrustedRemote(manifest, data, mirror.label, tuple(faults))


def _keep_bytes(accept: Callable[[bytes, Mirror], VerifiedManifest]) -> Callable:
    return lambda data, mirror: (accept(data, mirror), data)


def select_entries(manifest: VerifiedManifest, *, layers: tuple[int, int] | None = None,
                   paths: Iterable[str] | None = None) -> list[Entry]:
    """All listed files; with `layers` (first, last) only files of those layers plus files of no layer
    (config, tokenizer, embeddings); with `paths` only those (each must be listed)."""
    entries = list(manifest.entries)
    if layers is not None:
        first, last = layers
        entries = [e for e in entries if e.layer is None or first <= e.layer <= last]
    if paths is not None:
        wanted = set(paths)
        listed = manifest.by_path()
        unknown = sorted(wanted - set(listed))
        if unknown:
            raise UsageError(f"{len(unknown)} selected files are not in the signed manifest (first: {unknown[0]!r})")
        entries = [e for e in entries if e.path in wanted]
    return entries


@dataclass
class PullReport:
    remote: TrustedRemote
    dest: str
    selected: list[Entry]
    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[FetchFailed] = field(default_factory=list)
    seconds: float = 0.0
    manifest_written: bool = False

    @property
    def manifest(self) -> VerifiedManifest:
        return self.remote.manifest

    @property
    def complete(self) -> bool:
        return not self.failures and len(self.outcomes) == len(self.selected)

    def to_dict(self) -> dict:
        head = self.manifest.head
        count = {s: sum(1 for o in self.outcomes if o.status == s) for s in ("kept", "downloaded", "resumed")}
        mirrors: dict[str, dict] = {}
        for o in self.outcomes:
            if o.mirror is not None:
                m = mirrors.setdefault(o.mirror, {"files_served": 0, "faults": []})
                m["files_served"] += 1
        for fault in [*self.remote.faults, *(x for o in [*self.outcomes, *self.failures] for x in o.faults)]:
            mirrors.setdefault(fault.mirror, {"files_served": 0, "faults": []})["faults"].append(
                {"path": fault.path, "reason": fault.reason})
        downloaded = sum(o.downloaded for o in self.outcomes)
        return {
            "model_id": head.model_id, "manifest_version": head.version, "merkle_root": head.merkle_root.hex(),
            "dest": self.dest, "complete": self.complete, "manifest_written": self.manifest_written,
            "manifest_mirror": self.remote.mirror,
            "files": {"selected": len(self.selected), **count, "failed": len(self.failures)},
            "bytes": {"selected": sum(e.size for e in self.selected), "downloaded": downloaded},
            "seconds": round(self.seconds, 3),
            "bytes_per_second": round(downloaded / self.seconds) if self.seconds > 0 else None,
            "mirrors": mirrors,
            "failures": [{"path": f.entry.path, "faults": [{"mirror": x.mirror, "reason": x.reason} for x in f.faults]}
                         for f in self.failures],
        }


def pull(mirrors: Sequence[Mirror], dest: Path, remote: TrustedRemote, entries: Sequence[Entry], *, jobs: int = 4,
         progress: Callable[[int], None] | None = None, on_file: Callable[[Outcome], None] | None = None,
         write_manifest: bool = True, fsync: bool = True) -> PullReport:
    """Fetch `entries` into `dest`; write the manifest last when every one of them is in place and verified.
    A file no mirror serves right is a failure in the report (the others still complete); local I/O trouble
    (disk full) stops the pull with a StorageError."""
    dest = Path(dest)
    report = PullReport(remote, str(dest), list(entries))
    start = time.monotonic()
    with OutDir(dest) as od, _locked(od):
        _drop_stale_manifest(od)
        stop = threading.Event()
        lock = threading.Lock()

        def one(entry: Entry) -> None:
            if stop.is_set():
                return
            try:
                outcome = fetch_entry(od, entry, mirrors, progress=progress)
            except FetchFailed as failed:
                with lock:
                    report.failures.append(failed)
                return
            except BaseException:
                stop.set()
                raise
            with lock:
                report.outcomes.append(outcome)
            if on_file:
                on_file(outcome)

        with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="pull") as pool:
            futures = [pool.submit(one, e) for e in sorted(entries, key=lambda e: -e.size)]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        report.failures.sort(key=lambda f: f.entry.path)
        report.outcomes.sort(key=lambda o: o.entry.path)
        if report.complete and write_manifest:
            if fsync:
                sync_filesystem(od.fd, str(dest))  # the files reach the disk before the manifest vouches for them
            with atomic_writer_at(od.fd, MANIFEST_NAME, where=str(dest / MANIFEST_NAME), fsync=fsync) as fh:
                fh.write(remote.data)
            report.manifest_written = True
    report.seconds = time.monotonic() - start
    return report


@contextlib.contextmanager
def _locked(od: OutDir):
    """One pull per DEST at a time (two would write the same partial files): a second one is refused at once.
    The lock is on DEST's own descriptor and ends with it."""
    try:
        fcntl.flock(od.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StorageError("another shardtool process is writing this directory", path=str(od.path)) from None
    yield


def _drop_stale_manifest(od: OutDir) -> None:
    """A manifest in DEST (of this version or another) would vouch for files while we change them: it goes first
    and the verified one is written again at the end."""
    try:
        os.unlink(MANIFEST_NAME, dir_fd=od.fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StorageError(f"cannot remove the old manifest: {e.strerror}", path=str(od.path / MANIFEST_NAME)) from e


def describe(report: PullReport) -> str:
    """One line for stderr."""
    d = report.to_dict()
    f, b = d["files"], d["bytes"]
    state = "complete" if report.complete else f"INCOMPLETE ({f['failed']} files failed; no manifest written)"
    rate = f", {format_rate(d['bytes_per_second'])}" if d["bytes_per_second"] else ""
    head = report.manifest.head
    return (f"pull: {printable(head.model_id)} v{head.version}: {state}: {f['selected']} files "
            f"({format_size(b['selected'])}): {f['downloaded']} downloaded, {f['resumed']} resumed, {f['kept']} "
            f"already verified; {format_size(b['downloaded'])} received in {report.seconds:.1f}s{rate}")


