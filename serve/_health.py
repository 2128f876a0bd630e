"""What GET /health says about the weights: the files found bad by requests since the server started (every listed
file is checked before the socket opens with `serve --verify-all-first`: the runtime's `verify_all`).

A shard that fails its check fails each request that needs it (HTTP 500) and stays bad: the bytes on disk do not
heal, so the server reports itself degraded until it is restarted on a good copy.
"""

from __future__ import annotations

import threading

from shardtool.errors import VerificationError

MAX_NAMES = 64  # bad files named in /health's body (the count is always exact)


class ShardHealth:
    """The files whose verification failed a request since start (thread-safe; `note` takes any error)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bad: dict[str, str] = {}  # file -> the first failure's one line

    def note(self, error: BaseException) -> None:
        if isinstance(error, VerificationError):
            with self._lock:
                self._bad.setdefault(error.path or "(the model)", error.one_line())

    def document(self) -> tuple[int, dict]:
        """(HTTP status, body) of GET /health. Degraded is 503: a load balancer then stops sending requests here,
        which would mostly fail (with top-k routing, most prompts reach a bad expert before long)."""
        with self._lock:
            bad = sorted(self._bad)
        if not bad:
            return 200, {"status": "ok"}
        return 503, {"status": "degraded", "bad_files": len(bad), "files": bad[:MAX_NAMES],
                     "message": f"{len(bad)} signed file(s) failed verification since start; requests that need "
                                f"them fail: restart on a good copy (shardtool audit names every bad file)"}
