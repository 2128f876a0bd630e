"""A mirror server the remote tests control: serves a model directory under several URL prefixes, each a mirror
with its own misbehaviour (http.server's ThreadingHTTPServer; started as a subprocess by the tests).

    python hostile_mirror.py --root DIR --config CONFIG.json --log LOG --port-file PORTFILE [--also-host 127.0.0.2]

CONFIG: {"NAME": {"fault": FAULT, "path": RELPATH or "*", "range": true, "rate": BYTES_PER_SECOND}, ...}.
`GET /NAME/RELPATH` serves ROOT/RELPATH; when RELPATH is the configured path (or path is "*") the fault applies:
  wrong_bytes   the file with one byte flipped (same length)
  endless       200, no Content-Length, bytes without end (the connection is closed when the client goes)
  short         Content-Length of the whole file, then one byte less and (a second later) the connection closed
  http500       HTTP 500 with a JSON body
  stall         headers and the first half of the body, then 30 seconds of silence
  redirect      302 to the same path on the `good` mirror of another host (--also-host, same port)
  huge          for the manifest: 1 GiB streamed with its Content-Length declared
  huge_chunked  for the manifest: 1 GiB streamed with no Content-Length
  listing       a GET of the mirror's root answers an HTML listing naming ../../etc/passwd; files are served
"range": false ignores Range headers (200 with the whole file). "rate" throttles every body of that mirror.
Every GET is appended to LOG as one JSON line {"mirror", "path", "range", "host"} before it is answered.
A mirror named in no config entry (and `good`) serves every file right.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

GiB = 1 << 30
BLOCK = 256 * 1024


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path
    config: dict
    log_path: Path
    log_lock = threading.Lock()
    redirect_host: str | None = None

    def log_message(self, *args) -> None:  # quiet
        pass

    def _log(self, mirror: str, rel: str) -> None:
        line = json.dumps({"mirror": mirror, "path": rel, "range": self.headers.get("Range"),
                           "host": self.server.server_address[0]})
        with self.log_lock, open(self.log_path, "a") as fh:
            fh.write(line + "\n")

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _write(self, data: bytes, rate: int | None) -> None:
        view = memoryview(data)
        while view:
            part, view = view[:BLOCK], view[BLOCK:]
            self.wfile.write(part)
            if rate:
                time.sleep(len(part) / rate)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _get(self) -> None:
        name, _, rel = unquote(self.path.lstrip("/")).partition("/")
        self._log(name, rel)
        conf = self.config.get(name, {})
        fault = conf.get("fault") if conf.get("path") in ("*", rel) else None
        rate = conf.get("rate")
        if conf.get("fault") == "listing":
            fault = None
            if rel == "":
                page = b'<html><body><a href="../../etc/passwd">passwd</a> <a href="/etc/passwd">x</a></body></html>'
                self._send(200, page, {"Content-Type": "text/html"})
                return
        if fault == "http500":
            self._send(500, b'{"error": "internal error"}', {"Content-Type": "application/json"})
            return
        if fault == "redirect":
            target = f"http://{self.redirect_host}:{self.server.server_address[1]}/good/{rel}"
            self._send(302, b"", {"Location": target})
            return
        if fault in ("huge", "huge_chunked"):
            self.send_response(200)
            if fault == "huge":
                self.send_header("Content-Length", str(GiB))
            else:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            block = b"\x93" * (1 << 20)
            for _ in range(GiB // len(block)):
                self.wfile.write(block)
            return
        path = (self.root / rel) if rel else None
        if path is None or ".." in rel.split("/") or not path.is_file():
            self._send(404, b'{"error": "not found"}', {"Content-Type": "application/json"})
            return
        data = path.read_bytes()
        if fault == "wrong_bytes":
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        if fault == "endless":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            block = b"\x5a" * BLOCK
            while True:
                self.wfile.write(block)
                if rate:
                    time.sleep(BLOCK / rate)
        start = 0
        range_header = self.headers.get("Range")
        if range_header and conf.get("range", True):
            spec = range_header.removeprefix("bytes=").split("-")[0]
            start = int(spec)
        if start >= len(data) and start:
            self._send(416, b'{"error": "range"}', {"Content-Range": f"bytes */{len(data)}"})
            return
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes" if conf.get("range", True) else "none")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if fault in ("short", "stall"):
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if fault == "short":
            self._write(body[:-1], rate)
            self.wfile.flush()
            time.sleep(1)  # the client reads what came before it sees the close (aiohttp drops data buffered then)
            return
        if fault == "stall":
            self._write(body[:len(body) // 2], rate)
            self.wfile.flush()
            time.sleep(30)
            return
        self._write(body, rate)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--log", required=True, type=Path)
    ap.add_argument("--port-file", required=True, type=Path)
    ap.add_argument("--also-host", default=None)
    args = ap.parse_args()
    Handler.root = args.root
    Handler.config = json.loads(args.config.read_text())
    Handler.log_path = args.log
    Handler.redirect_host = args.also_host
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    if args.also_host:
        other = ThreadingHTTPServer((args.also_host, port), Handler)
        threading.Thread(target=other.serve_forever, daemon=True).start()
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
