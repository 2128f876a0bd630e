"""Running the app: uvicorn on a socket we bind ourselves (so `--port 0` can report the port it got), with
caps on headers and connections, a deadline on request headers, and SIGINT/SIGTERM as a clean stop.

uvicorn has no deadline for a request's headers: its keep-alive timer runs only between requests, and the
first byte of a request cancels it, so a client that sends one header byte now and then holds a connection
for ever (slowloris). `_DeadlineH11Protocol` closes a connection whose request headers are not complete
within `header_timeout` seconds, on the first request and on every keep-alive request after it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
from dataclasses import dataclass
from typing import Iterator

from shardtool.errors import StorageError, UsageError

MAX_HEADER_BYTES = 16 * 1024  # request line + headers; h11 answers 400 past it


class Stopped(Exception):
    """SIGINT or SIGTERM arrived: stop cleanly (exit 0)."""


@dataclass(frozen=True)
class ServerSettings:
    header_timeout: float = 10.0  # seconds for a request's line and headers to arrive
    keep_alive: int = 5  # seconds an idle keep-alive connection stays open
    limit_concurrency: int = 256  # connections + requests in flight; past it uvicorn answers 503 itself
    graceful_seconds: int = 5  # on a stop signal, how long requests in flight may take to finish
    ssl_certfile: str | None = None  # with ssl_keyfile: HTTPS (uvicorn's TLS)
    ssl_keyfile: str | None = None

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise Stopped here. While uvicorn runs, its own handlers take over (a graceful
    shutdown); afterwards it re-raises the signal it caught, which lands here as Stopped too."""
    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port; read it with `sock.getsockname()`)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StorageError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise StorageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{scheme}://{host}:{port}"


def check_tls_files(certfile: str | None, keyfile: str | None) -> None:
    """Both or neither, and a certificate chain and its private key that load: a bad file is a usage error at
    start, not a failure at the first connection."""
    import ssl

    if (certfile is None) != (keyfile is None):
        raise UsageError("--ssl-certfile and --ssl-keyfile go together: give both, or neither")
    if certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except FileNotFoundError as e:
        raise StorageError(f"cannot read {e.filename}: no such file") from None
    except (ssl.SSLError, OSError) as e:
        raise UsageError(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile} is not a PEM certificate chain "
                         f"and its unencrypted private key: {e.strerror or e}") from None


def run(app, sock: socket.socket, settings: ServerSettings = ServerSettings()) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM (inside `stop_on_signals`, Stopped is then raised, after
    the requests in flight finished or `graceful_seconds` passed)."""
    uvicorn_server(app, settings).run(sockets=[sock])


def uvicorn_server(app, settings: ServerSettings):
    """The configured uvicorn.Server (`.run(sockets=[...])`; `.should_exit = True` stops it)."""
    import uvicorn

    config = uvicorn.Config(
        app, http=_deadline_protocol(settings.header_timeout), ws="none", lifespan="off", interface="asgi3",
        log_level="warning", access_log=False, server_header=False, proxy_headers=False,
        timeout_keep_alive=settings.keep_alive, limit_concurrency=settings.limit_concurrency,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_graceful_shutdown=settings.graceful_seconds,
        ssl_certfile=settings.ssl_certfile, ssl_keyfile=settings.ssl_keyfile)
    return uvicorn.Server(config)


def _deadline_protocol(header_timeout: float):
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps({"error": {"message": f"the request headers did not arrive within {header_timeout:g} seconds",
                                 "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    timeout_response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class _DeadlineH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on this connection gets the same deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # No request is in progress (h11 has not seen complete headers), so no response was started:
                # answer 408 directly and close, as the connection cannot be used any further.
                self.transport.write(timeout_response)
                self.transport.close()

    return _DeadlineH11Protocol
