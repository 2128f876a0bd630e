"""Where a running model comes from: a local split directory, or an untrusted store whose files are fetched into a
cache directory through the verified download (the small files at start, the expert shards when first used); and
the check of every listed file before the first token (`--verify-all-first`). `open_model`, `node` and the receipt
replayer open their model here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from shardtool.errors import DigestMismatchError, MissingFileError
from shardtool.layout import model_dir
from shardtool.manifest import VerifiedManifest


@dataclass
class ModelSource:
    """A verified manifest and the directory its files are read from; `fetcher` fills that directory on demand
    (None for a local directory). Close it when done (it holds the cache directory's lock)."""

    directory: Path
    manifest: VerifiedManifest
    fetcher: object | None = None  # RemoteFiles
    spec: object | None = None  # the RemoteSource behind it (a cluster node hands it to its actor)

    @property
    def fetch_missing(self) -> Callable | None:
        return self.fetcher.fetch if self.fetcher is not None else None

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None


def open_source(directory: Path | None, trusted: Sequence, *, threshold: int = 1, manifest_file: Path | None = None,
                remote: Sequence[str] = (), cache_dir: Path | None = None, fetch_timeout: float = 60.0,
                state_dir: Path | None = None, model_id: str | None = None,
                eager: Callable = lambda entry: entry.kind != "expert", lazy: bool = True) -> ModelSource:
    """The local directory's manifest verified (`load_trusted_manifest`), or the store's (`fetch_trusted_manifest`:
    the same checks on the fetched bytes), then with `remote` the files `eager(entry)` selects pulled into
    `cache_dir` before anything starts (a file no store serves right raises). With `lazy`, the returned source's
    fetcher brings any other listed shard in when the store first needs it."""
    from shardtool.manifest import default_manifest_path, load_trusted_manifest

    if not remote:
        directory = model_dir(Path(directory))
        path = manifest_file if manifest_file is not None else default_manifest_path(directory)
        return ModelSource(directory, load_trusted_manifest(path, list(trusted), threshold, state_dir,
                                                            model_id=model_id))
    from shardtool.remote import RemoteFiles, RemoteSource, fetch_trusted_manifest, pull

    spec = RemoteSource(tuple(remote), fetch_timeout)
    mirrors = spec.open()
    try:
        fetched = fetch_trusted_manifest(mirrors, list(trusted), threshold, state_dir, model_id=model_id)
        report = pull(mirrors, cache_dir, fetched, [e for e in fetched.manifest.entries if eager(e)])
    finally:
        for m in mirrors:
            m.close()
    if report.failures:
        raise report.failures[0]
    return ModelSource(Path(cache_dir), fetched.manifest, RemoteFiles(Path(cache_dir), spec) if lazy else None, spec)


def verify_all(root: Path, manifest: VerifiedManifest, *, cluster: bool, fetch_missing: Callable | None) -> int:
    """Every listed file a run would read, checked (size, then BLAKE3) before the first token; raises the first
    failure, as a verified read would. The bytes are not used (shards are read and verified again when needed), so
    they are streamed, as audit does, rather than held whole. With a `cluster` the experts are the nodes' own: each
    node checked its own before it joined. Returns the bytes checked."""
    from shardtool.manifest import verify_entry

    entries = [e for e in manifest.entries if not cluster or e.kind != "expert"]
    for entry in entries:
        try:
            verify_entry(root, entry)
        except (MissingFileError, DigestMismatchError):
            if fetch_missing is None:
                raise
            fetch_missing(entry)  # from a store: fetched (and verified) into the cache, then checked where it landed
            verify_entry(root, entry)
    return sum(entry.size for entry in entries)
