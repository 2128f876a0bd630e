"""Where a running command's model comes from: a local split directory, or (`--remote URL --cache-dir D`) an
untrusted store whose files are fetched into D through the verified download, the small files at start and the
expert shards when first used. Shared by verify-and-run, serve and node; `pull` checks its URLs here too."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from shardtool.errors import UsageError

MAX_MIRRORS = 16
MAX_URL = 2048
REMOTE_HELP = ("A store holding the signed split model (https://…, s3://bucket/prefix, hf://…, a directory); repeat "
               "for mirrors, tried in order. Needs --cache-dir; replaces DIR.")
CACHE_HELP = "With --remote: where fetched files are kept (created if absent); shards missing here are fetched."
FETCH_TIMEOUT_HELP = "With --remote: seconds a store has to answer one request before the next mirror is asked."


def check_urls(urls: Sequence[str]) -> list[str]:
    """Store URLs as given: non-empty, bounded, no control characters, at most MAX_MIRRORS."""
    if len(urls) > MAX_MIRRORS:
        raise UsageError(f"at most {MAX_MIRRORS} stores, got {len(urls)}")
    from shardtool.remote import check_url

    for url in urls:
        if not url or len(url) > MAX_URL or any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
            raise UsageError(f"{url[:60]!r} is not a store URL (1 to {MAX_URL} printable characters)")
        check_url(url)
    return list(urls)


def check_timeout(timeout: float, flag: str) -> float:
    if not (math.isfinite(timeout) and 0.1 <= timeout <= 3600):
        raise UsageError(f"{flag} must be from 0.1 to 3600 seconds, got {timeout}")
    return timeout


def check_source(directory: Optional[Path], manifest_file: Optional[Path], remote: Sequence[str],
                 cache_dir: Optional[Path], fetch_timeout: float) -> None:
    """DIR, or --remote with --cache-dir: checked before anything is read."""
    if remote:
        if directory is not None:
            raise UsageError("give the model directory DIR or --remote URL --cache-dir D, not both")
        if cache_dir is None:
            raise UsageError("--remote needs --cache-dir D: where the fetched files are kept")
        if manifest_file is not None:
            raise UsageError("--manifest names a local file; with --remote the manifest comes from the store")
        check_urls(remote)
        check_timeout(fetch_timeout, "--fetch-timeout")
    else:
        if directory is None:
            raise UsageError("give the model directory DIR (or --remote URL --cache-dir D)")
        if cache_dir is not None:
            raise UsageError("--cache-dir goes with --remote")
        from shardtool.cli._common import model_dir
        model_dir(directory)  # an absent DIR is named before the keys are read


@dataclass
class ModelSource:
    """A verified manifest and the directory its files are read from; `fetcher` fills that directory on demand
    (None for a local DIR). Close it when done (it holds the cache directory's lock)."""

    directory: Path
    manifest: object  # VerifiedManifest
    fetcher: object | None = None  # RemoteFiles
    spec: object | None = None  # the RemoteSource behind it (a cluster node hands it to its actor)

    @property
    def fetch_missing(self) -> Callable | None:
        return self.fetcher.fetch if self.fetcher is not None else None

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None


def open_source(directory: Optional[Path], manifest_file: Optional[Path], remote: Sequence[str],
                cache_dir: Optional[Path], fetch_timeout: float, trusted: list, threshold: int,
                state_dir: Optional[Path], model_id: Optional[str], *, eager: Callable, lazy: bool = True) -> ModelSource:
    """The local DIR's manifest verified (`load_trusted_manifest`), or the store's (`fetch_trusted_manifest`: the
    same checks on the fetched bytes), then with --remote the files `eager(entry)` selects pulled into the cache
    directory before anything starts (a file no store serves right: exit 1). With `lazy`, the returned source's
    fetcher brings any other listed shard in when the store first needs it."""
    from shardtool.cli._common import manifest_path, model_dir
    from shardtool.manifest import load_trusted_manifest

    if not remote:
        directory = model_dir(directory)
        verified = load_trusted_manifest(manifest_path(directory, manifest_file), trusted, threshold, state_dir,
                                         model_id=model_id)
        return ModelSource(directory, verified)
    from shardtool.remote import RemoteFiles, RemoteSource, fetch_trusted_manifest, pull

    spec = RemoteSource(tuple(remote), fetch_timeout)
    mirrors = spec.open()
    try:
        fetched = fetch_trusted_manifest(mirrors, trusted, threshold, state_dir, model_id=model_id)
        report = pull(mirrors, cache_dir, fetched, [e for e in fetched.manifest.entries if eager(e)])
    finally:
        for m in mirrors:
            m.close()
    if report.failures:
        raise report.failures[0]
    return ModelSource(Path(cache_dir), fetched.manifest, RemoteFiles(Path(cache_dir), spec) if lazy else None, spec)
