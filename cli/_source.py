"""The options that say where a running command's model comes from: a local split directory DIR, or (`--remote URL
--cache-dir D`) an untrusted store whose files are fetched into D; checked before anything is read. The opening
itself is the runtime's (`open_source`, `open_model`). Shared by verify-and-run, serve and node; `pull` checks its
URLs here too."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

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
