"""Split models from untrusted remote stores, through fsspec: `shardtool pull` and `push`, and the runtime's
on-demand fetch (`--remote URL --cache-dir D`).

Where a fetched file is verified: `shardtool.remote._fetch.fetch_entry` (bounded by the signed size, renamed into
place only when its BLAKE3 matches). Where the manifest is: `fetch_trusted_manifest` (`_pull.py`), which runs the
same checks as `load_trusted_manifest` on the fetched bytes before anything else is requested.
"""

from shardtool.remote._cache import FetchStats, RemoteFiles, RemoteSource
from shardtool.remote._fetch import Fault, FetchFailed, Outcome, fetch_entry
from shardtool.remote._mirror import DEFAULT_TIMEOUT, Mirror, MirrorFault, check_url, display_url, open_mirror
from shardtool.remote._pull import PullReport, TrustedRemote, describe, fetch_trusted_manifest, pull, select_entries
from shardtool.remote._push import PushReport, push

__all__ = ["DEFAULT_TIMEOUT", "Fault", "FetchFailed", "FetchStats", "Mirror", "MirrorFault", "check_url", "Outcome",
           "PullReport", "PushReport", "RemoteFiles", "RemoteSource", "TrustedRemote", "describe", "display_url",
           "fetch_entry", "fetch_trusted_manifest", "open_mirror", "pull", "push", "select_entries"]
