"""Who may ask the server: the `Host` names requests may carry and the API key (pure; `_app._Guard` applies them
to each request). Kept apart from the app so that `serve` checks these options before it loads the runtime."""

from __future__ import annotations

from dataclasses import dataclass

from shardtool.errors import UsageError

MAX_API_KEY_CHARS = 4096
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "[::1]")


@dataclass(frozen=True)
class Access:
    """`allowed_hosts`: the `Host` names (NAME, or NAME:PORT) requests may carry; None: the address the server is
    bound to, localhost, 127.0.0.1 and [::1]. A NAME without a port allows it with the server's own port or
    none. `api_key`: every route but /health and / (the status page, a document without data) needs
    `Authorization: Bearer KEY`."""

    allowed_hosts: tuple[str, ...] | None = None
    api_key: str | None = None

    def __post_init__(self):
        for name in self.allowed_hosts or ():
            if not name or not name.isascii() or any(c.isspace() or c in "/@\\,?#" for c in name):
                raise UsageError(f"--allowed-hosts: {name[:80]!r} is not a host name, NAME:PORT or [IPv6]:PORT")
        key = self.api_key
        if key is not None and not (0 < len(key) <= MAX_API_KEY_CHARS and key.isascii() and key.isprintable()
                                    and " " not in key):
            raise UsageError(f"the API key must be 1 to {MAX_API_KEY_CHARS} printable ASCII characters without "
                             f"spaces (got {len(key)} characters)")

    def host_allowed(self, host: str, server: tuple | None) -> bool:
        """`host` (the header, lower case) is an allowed NAME or NAME:PORT, or NAME with this server's own port;
        `server`: the (address, port) the request came in on."""
        address, port = (server or ("", 0))[:2]
        names = self.allowed_hosts
        if names is None:  # the default: this server's own address, and the loopback names
            names = DEFAULT_HOSTS + ((f"[{address}]" if ":" in address else address),)
        allowed = {name.lower() for name in names}
        if host in allowed:
            return True
        name, sep, suffix = host.rpartition(":")  # "[::1]" alone has no port: its suffix is "1]"
        return bool(sep) and suffix == str(port) and name in allowed
