"""On-demand fetch for the runtime: a local cache directory filled from mirrors as shards are first needed.

`verify-and-run`, `serve` and `node` with `--remote URL --cache-dir D` read the model from D as from any split
directory; the verifying store calls `RemoteFiles.fetch` for a listed shard that D does not hold yet, which
brings it into D through the bounded, verified download (`fetch_entry`) and returns. The store then reads it
back through its own entry check, so the memory budget and the verify-before-use rule are unchanged: fetching
only decides what is on disk, never what is used.
"""

from __future__ import annotations

import fcntl
import threading
from dataclasses import dataclass
from pathlib import Path

from shardtool.errors import StorageError, UnavailableError
from shardtool.manifest import Entry
from shardtool.outdir import OutDir
from shardtool.remote._fetch import FetchFailed, PathLocks, fetch_entry
from shardtool.remote._mirror import DEFAULT_TIMEOUT, Mirror, open_mirror


@dataclass(frozen=True)
class RemoteSource:
    """Where missing files come from: mirror URLs in the order they are tried, and the per-request time-out.
    Plain data, so a cluster node can hand it to its actor."""

    urls: tuple[str, ...]
    timeout: float = DEFAULT_TIMEOUT

    def open(self) -> list[Mirror]:
        return [open_mirror(url, timeout=self.timeout) for url in self.urls]


@dataclass
class FetchStats:
    files: int = 0
    bytes: int = 0
    faults: int = 0


class RemoteFiles:
    """Cache directory D plus its mirrors; holds D's lock (one writer) until closed. Thread-safe: readers of the
    shard store call `fetch` concurrently, each path is fetched once."""

    def __init__(self, cache_dir: Path, source: RemoteSource):
        self.dir = OutDir(Path(cache_dir))
        try:
            fcntl.flock(self.dir.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.dir.close()
            raise StorageError("another shardtool process is writing this cache directory",
                               path=str(cache_dir)) from None
        self.mirrors = source.open()
        self.stats = FetchStats()
        self._locks = PathLocks()
        self._lock = threading.Lock()

    def fetch(self, entry: Entry) -> None:
        """Make D hold `entry`'s verified bytes. No store serving them is an UnavailableError (the requests that
        need the shard fail: HTTP 503, exit 3, like a cluster with no replica left; a later request tries again);
        trouble with D itself a StorageError."""
        with self._locks.hold(entry.path):
            try:
                outcome = fetch_entry(self.dir, entry, self.mirrors)
            except FetchFailed as e:
                with self._lock:
                    self.stats.faults += len(e.faults)
                raise UnavailableError(e.message, path=e.path) from None
        with self._lock:
            self.stats.files += outcome.status != "kept"
            self.stats.bytes += outcome.downloaded
            self.stats.faults += len(outcome.faults)

    def close(self) -> None:
        for mirror in self.mirrors:
            mirror.close()
        self.dir.close()  # releases the lock
