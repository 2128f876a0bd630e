"""One untrusted store that holds a split model's files, read through fsspec.

A mirror only ever hands out byte streams of paths the caller names (paths a verified manifest lists); it
is never asked for a listing. Everything it says is a claim: the caller bounds each stream by the signed
size and checks the signed BLAKE3 before a byte is trusted (`remote/_fetch.py`). Anything a mirror does
wrong for one request (an error status, a refused connection, a stall past the time-out, a redirect to
another host, a declared size other than the signed one) is a `MirrorFault`: the caller tries the next
mirror.

Two readers:
* `_HttpMirror` (http://, https://): fsspec's HTTP filesystem gives the aiohttp session and its event loop;
  each request is our own GET so that nothing reads more than we ask for (fsspec's ranged reads buffer a
  whole response, an endless body included), redirects are followed only within the same origin, content
  encodings are refused (a gzip bomb is not decoded), and every await has the per-request time-out.
* `_FsspecMirror` (s3:// through s3fs, file:// and plain paths, hf:// through huggingface_hub, any other
  fsspec protocol): bounded ranged reads (`cat_file(path, start, end)`), the object's declared size checked
  against the signed size before a byte is read for files larger than one chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

from shardtool.errors import UsageError

READ_CHUNK = 8 * 1024 * 1024  # bytes asked of a store per read: bounds memory per job and each range request
MAX_REDIRECTS = 5
SMALL_FILE = 1024 * 1024  # files below this are read whole within their request (HTTP)
MIN_RATE = 32 * 1024  # bytes/s a store must keep up over each --timeout window (curl's --speed-limit/--speed-time)
DEFAULT_TIMEOUT = 60.0


class MirrorFault(Exception):
    """This mirror failed this one request; `reason` is one short line (not yet terminal-escaped)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def display_url(url: str) -> str:
    """The URL without user:password, for messages and reports."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


class Stream:
    """The bytes of one file from `offset` on (the offset asked for, or 0 when the store cannot start
    there). `read(n)` returns at most n bytes, b"" at the end."""

    offset: int

    def read(self, n: int) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass
class Mirror:
    """A store's base URL and how to read files below it."""

    url: str
    timeout: float

    @property
    def label(self) -> str:
        return display_url(self.url)

    def open(self, relpath: str, start: int, size: int | None, cap: int | None = None) -> Stream:
        """A stream of `relpath` from `start`. `size`: the signed size (None for the manifest, whose size is not
        known before it is verified: then a declared size above `cap` is refused); a declared size other than
        it is a fault before any byte is read."""
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- HTTP ------------------------------------------------------------------------------------------------------

class _BytesStream(Stream):
    """A small file's bytes, already read (bounded) in the request's own trip to the event loop; `fault`: what
    stopped that read early, raised once the bytes that did arrive are handed on (a prefix the next mirror
    continues)."""

    def __init__(self, data: bytes, offset: int, fault: str | None = None):
        self._data, self.offset, self._pos, self._fault = data, offset, 0, fault

    def read(self, n: int) -> bytes:
        out = self._data[self._pos:self._pos + n]
        self._pos += len(out)
        if not out and self._fault is not None:
            raise MirrorFault(self._fault)
        return out


class _LoopStream(Stream):
    """A response body that belongs to its mirror's event loop: every read (under the time-out) and the close run
    there."""

    def __init__(self, mirror: "_LoopMirror", offset: int):
        self._mirror, self.offset = mirror, offset

    async def _read(self, n: int) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    async def _close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def read(self, n: int) -> bytes:
        async def read() -> bytes:
            return await asyncio.wait_for(self._read(n), self._mirror.timeout)
        return self._mirror.run(read)

    def close(self) -> None:
        try:
            self._mirror.run(self._close)
        except MirrorFault:
            pass


class _LoopMirror(Mirror):
    """A store whose client runs on an fsspec event loop (aiohttp for HTTP, aiobotocore for S3)."""

    loop: Any

    def run(self, coroutine_fn: Callable) -> Any:
        """Run one of our coroutines on the store's event loop; its errors and time-outs turn into faults."""
        from fsspec.asyn import sync

        with _as_fault(self.timeout):
            return sync(self.loop, coroutine_fn)


class _HttpStream(_LoopStream):
    def __init__(self, mirror: "_HttpMirror", response: Any, offset: int):
        super().__init__(mirror, offset)
        self._response = response
        self._ended = False

    async def _read(self, n: int) -> bytes:
        data = await self._response.content.read(n)
        self._ended = not data
        return data

    async def _close(self) -> None:  # on the loop: aiohttp's objects belong to it
        if self._ended:
            self._response.release()  # the whole body was read: the connection goes back to the pool
        else:
            self._response.close()  # a body we stopped reading (too long, a fault): the connection is dropped


class _HttpMirror(_LoopMirror):
    def __init__(self, url: str, timeout: float):
        super().__init__(url.rstrip("/") + "/", timeout)
        import aiohttp
        import fsspec

        self._fs = fsspec.filesystem("http", skip_instance_cache=True, client_kwargs={
            "timeout": aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout),
            "auto_decompress": False, "trust_env": False})
        # The operator's proxy settings apply, read once: aiohttp's trust_env re-reads the whole environment (and
        # ~/.netrc) on every request, which cost 5 ms of CPU per small file.
        self._proxy = _proxy_for(self.url)
        self._session = None
        self.loop = self._fs.loop

    def open(self, relpath: str, start: int, size: int | None, cap: int | None = None) -> Stream:
        from yarl import URL

        url = self.url + quote(relpath, safe="/")  # a listed name may hold '#', '?' or '%'

        async def get() -> tuple[Any, int]:
            if self._session is None:
                self._session = await self._fs.set_session()
            headers = {"Accept-Encoding": "identity"}
            if start:
                headers["Range"] = f"bytes={start}-"
            target = url
            for _ in range(MAX_REDIRECTS + 1):
                response = await asyncio.wait_for(
                    self._session.get(URL(target, encoded=True), headers=headers, allow_redirects=False,
                                      proxy=self._proxy), self.timeout)
                if response.status not in (301, 302, 303, 307, 308):
                    break
                location = response.headers.get("Location", "")
                response.release()
                following = urljoin(target, location)
                if _origin(following) != _origin(self.url):
                    raise MirrorFault(f"redirects to another origin ({display_url(following)[:200]}); only "
                                      f"redirects within the mirror are followed")
                target = following
            else:
                raise MirrorFault(f"more than {MAX_REDIRECTS} redirects")
            try:
                offset = _check_response(response, start, size, cap)
            except BaseException:
                response.release()
                raise
            if size is None or size - offset >= SMALL_FILE:
                return response, offset
            # A small file is read whole here, in the same trip to the event loop (a few hops per file cost more
            # than the bytes): at most one byte past the signed size, each read under the time-out.
            want, data = size - offset + 1, bytearray()

            async def read_all() -> None:
                while len(data) < want:
                    piece = await asyncio.wait_for(response.content.read(want - len(data)), self.timeout)
                    if not piece:
                        break
                    data.extend(piece)
            fault = None
            try:  # each read under the time-out, and the whole at MIN_RATE (a trickle is a stall too)
                await asyncio.wait_for(read_all(), self.timeout + want / MIN_RATE)
            except (asyncio.TimeoutError, TimeoutError):
                fault = f"no answer within {self.timeout:g}s"
            except Exception as e:  # a reset connection, bad chunking: what arrived is still handed on
                fault = _describe(e)
            if fault is None and len(data) < want:
                response.release()  # the whole body was read: the connection goes back to the pool
            else:
                response.close()  # longer than signed, or a fault: the rest is not read
            return _BytesStream(bytes(data), offset, fault), offset

        got, offset = self.run(get)
        return got if isinstance(got, _BytesStream) else _HttpStream(self, got, offset)

    def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None

            async def close() -> None:
                await session.close()
            try:
                self.run(close)
            except MirrorFault:
                pass


def _proxy_for(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTP_PROXY / HTTPS_PROXY, NO_PROXY honoured), or None."""
    import urllib.request

    parts = urlsplit(url)
    if urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return urllib.request.getproxies().get(parts.scheme.lower())


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


def _check_response(response: Any, start: int, size: int | None, cap: int | None) -> int:
    """The offset the body starts at, once the status, encoding and declared length are what a file of
    `size` bytes read from `start` allows."""
    status = response.status
    if status == 404:
        raise MirrorFault("not found (HTTP 404)")
    if status == 416 and size is not None and start >= size:
        raise MirrorFault(f"refuses a read from byte {start} (HTTP 416)")
    if status not in (200, 206):
        raise MirrorFault(f"HTTP {status}")
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MirrorFault(f"sends a {encoding[:40]!r}-encoded body; only the file's own bytes are accepted")
    offset = 0
    if status == 206:
        offset = _range_start(response.headers.get("Content-Range", ""))
        if offset != start:
            raise MirrorFault(f"answers a read from byte {start} with bytes from {offset}")
    declared = response.headers.get("Content-Length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit() and len(declared) <= 20):
            raise MirrorFault(f"declares a Content-Length of {declared[:40]!r}")
        _check_declared(int(declared) + offset, size, cap)
    return offset


def _check_declared(declared: int, size: int | None, cap: int | None) -> None:
    if size is not None and declared != size:
        raise MirrorFault(f"declares {declared} bytes, the signed size is {size}")
    if size is None and cap is not None and declared > cap:
        raise MirrorFault(f"declares {declared} bytes, more than the cap of {cap}")


def _range_start(content_range: str) -> int:
    """`bytes 100-199/200` -> 100; anything else is a fault."""
    unit, _, rest = content_range.strip().partition(" ")
    first = rest.partition("-")[0]
    if unit.lower() != "bytes" or not (first.isascii() and first.isdigit() and len(first) <= 20):
        raise MirrorFault(f"a partial answer with Content-Range {content_range[:60]!r}")
    return int(first)


# -- every other fsspec store ----------------------------------------------------------------------------------

class _RangeStream(Stream):
    """Ranged reads of a known-size object: each read asks for exactly the next n bytes (never past `end`). A read
    answered with fewer bytes than asked reached the object's end: no further read is sent (an object store
    refuses a range that starts at or past the end, HTTP 416, where a local file answers b"")."""

    def __init__(self, mirror: "_FsspecMirror", path: str, offset: int, end: int | None):
        self._mirror, self._path, self.offset, self._end = mirror, path, offset, end
        self._pos = offset
        self._at_end = False

    def read(self, n: int) -> bytes:
        stop = self._pos + n if self._end is None else min(self._pos + n, self._end)
        if stop <= self._pos or self._at_end:
            return b""
        data = self._mirror.call(self._mirror.fs.cat_file, self._path, start=self._pos, end=stop)
        if len(data) > stop - self._pos:
            raise MirrorFault(f"answered a read of {stop - self._pos} bytes with {len(data)}")
        self._at_end = len(data) < stop - self._pos
        self._pos += len(data)
        return data


class _FsspecMirror(Mirror):
    def __init__(self, url: str, timeout: float):
        super().__init__(url, timeout)
        from fsspec.core import url_to_fs

        options: dict[str, Any] = {}
        protocol = urlsplit(url).scheme.lower()
        if protocol in ("s3", "s3a"):
            options["config_kwargs"] = {"connect_timeout": timeout, "read_timeout": timeout,
                                        "retries": {"max_attempts": 2, "mode": "standard"}}
            options["skip_instance_cache"] = True
        try:
            self.fs, self._base = url_to_fs(url, **options)
        except (ImportError, ValueError) as e:
            raise UsageError(f"cannot open store {display_url(url)!r}: {e}",
                             hint="s3:// needs s3fs, hf:// needs huggingface_hub (pip install 'shardtool[remote]')") \
                from None

    def path(self, relpath: str) -> str:
        return posixpath.join(self._base, relpath) if self._base else relpath

    def call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        with _as_fault(self.timeout):
            return fn(*args, **kwargs)

    def open(self, relpath: str, start: int, size: int | None, cap: int | None = None) -> Stream:
        path = self.path(relpath)
        if size is None or size - start > READ_CHUNK:
            # One metadata call (a HEAD on S3): a wrong or absurd declared size is refused before any byte.
            info = self.call(self.fs.info, path)
            declared = info.get("size")
            if info.get("type") not in (None, "file") or not isinstance(declared, int):
                raise MirrorFault(f"is not a file (type {str(info.get('type'))[:20]!r})")
            _check_declared(declared, size, cap)
            return _RangeStream(self, path, start, declared if size is None else size)
        # A small file: one ranged read of up to one byte more than signed, which notices a longer object.
        return _RangeStream(self, path, start, size + 1)


class _FdStream(Stream):
    def __init__(self, fd: int, offset: int):
        self._fd, self.offset, self._pos = fd, offset, offset

    def read(self, n: int) -> bytes:
        try:
            data = os.pread(self._fd, n, self._pos)
        except OSError as e:
            raise MirrorFault(f"read failed: {e.strerror}") from None
        self._pos += len(data)
        return data

    def close(self) -> None:
        os.close(self._fd)


class _LocalMirror(Mirror):
    """A directory (a path or file://): each file opened through the safe-open beneath it (non-blocking, regular
    files only, no links), its size compared before a byte is read."""

    def __init__(self, url: str, timeout: float, base: str):
        super().__init__(url, timeout)
        self._base = base

    def open(self, relpath: str, start: int, size: int | None, cap: int | None = None) -> Stream:
        from shardtool.errors import ShardtoolError
        from shardtool.safeio import open_beneath

        try:
            fd = open_beneath(self._base, relpath)
        except ShardtoolError as e:
            raise MirrorFault(e.message) from None
        try:
            _check_declared(os.fstat(fd).st_size, size, cap)
        except BaseException:
            os.close(fd)
            raise
        return _FdStream(fd, start)


class _S3Stream(_LoopStream):
    def __init__(self, mirror: "_S3Mirror", body: Any, offset: int):
        super().__init__(mirror, offset)
        self._body = body

    async def _read(self, n: int) -> bytes:
        return await self._body.read(n)

    async def _close(self) -> None:
        self._body.close()


class _S3Mirror(_LoopMirror):
    """s3:// through s3fs's client: one GET per file (a range from where a partial file ends), the object's size
    from Content-Range or Content-Length compared before the body is read, the body read in bounded pieces, each
    await under the time-out, no retries of our own or s3fs's (the next mirror is the retry)."""

    def __init__(self, url: str, timeout: float):
        super().__init__(url, timeout)
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={
            "connect_timeout": timeout, "read_timeout": timeout, "retries": {"max_attempts": 1, "mode": "standard"}})
        self.fs.retries = 1
        self._base = self.fs._strip_protocol(url).rstrip("/")
        self.loop = self.fs.loop

    def path(self, relpath: str) -> str:
        return f"{self._base}/{relpath}"

    def open(self, relpath: str, start: int, size: int | None, cap: int | None = None) -> Stream:
        bucket, key, _ = self.fs.split_path(self.path(relpath))

        async def get() -> tuple[Any, int]:
            kw = {"Bucket": bucket, "Key": key}
            if start:
                kw["Range"] = f"bytes={start}-"
            reply = await asyncio.wait_for(self.fs._call_s3("get_object", **kw), self.timeout)
            body = reply["Body"]
            try:
                offset, total = _s3_extent(reply, start)
                _check_declared(total, size, cap)
            except BaseException:
                body.close()
                raise
            return body, offset

        body, offset = self.run(get)
        return _S3Stream(self, body, offset)


def _s3_extent(reply: dict, start: int) -> tuple[int, int]:
    """(offset the body starts at, the object's whole size) from a GetObject reply."""
    length = reply.get("ContentLength")
    if not isinstance(length, int) or length < 0:
        raise MirrorFault(f"a reply without a usable Content-Length ({str(length)[:30]!r})")
    content_range = reply.get("ContentRange")
    if not content_range:
        return 0, length
    offset = _range_start(content_range)
    total = content_range.rpartition("/")[2]
    if offset != start or not (total.isascii() and total.isdigit() and len(total) <= 20):
        raise MirrorFault(f"answers a read from byte {start} with Content-Range {content_range[:60]!r}")
    return offset, int(total)


class _BrokenMirror(Mirror):
    """A store that could not even be set up (a refused connection at start, a client library error): each request
    is this mirror's fault, and the other mirrors still serve."""

    def __init__(self, url: str, timeout: float, reason: str):
        super().__init__(url, timeout)
        self._reason = reason

    def open(self, relpath: str, start: int, size: int | None, cap: int | None = None) -> Stream:
        raise MirrorFault(self._reason)


@contextlib.contextmanager
def _as_fault(timeout: float) -> Iterator[None]:
    """A store's errors for one request (aiohttp's, botocore's, a client library's, an OSError) are this mirror's
    fault for this file: the caller asks the next mirror."""
    try:
        yield
    except MirrorFault:
        raise
    except FileNotFoundError:
        raise MirrorFault("not found") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise MirrorFault(f"no answer within {timeout:g}s") from None
    except Exception as e:  # noqa: BLE001 - whatever the backend raises
        raise MirrorFault(_describe(e)) from None


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())[:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def open_mirror(url: str, *, timeout: float = DEFAULT_TIMEOUT) -> Mirror:
    """A mirror for `url` (http(s)://, s3://, file://, a local path, hf://, or any fsspec URL)."""
    scheme = check_url(url)
    try:
        if scheme in ("http", "https"):
            return _HttpMirror(url, timeout)
        if scheme in ("s3", "s3a"):
            return _S3Mirror(url, timeout)
        if scheme in ("", "file", "local"):
            return _LocalMirror(url, timeout, urlsplit(url).path if scheme else url)
        return _FsspecMirror(url, timeout)
    except UsageError:
        raise
    except ImportError as e:
        raise UsageError(f"cannot open store {display_url(url)!r}: {e}",
                         hint="s3:// needs s3fs, hf:// needs huggingface_hub (pip install 'shardtool[remote]')") from None
    except Exception as e:  # noqa: BLE001 - the store's client failed to start: this mirror's fault only
        return _BrokenMirror(url, timeout, f"cannot be reached: {_describe(e)}")


def check_url(url: str) -> str:
    """The URL's scheme ('' for a plain path), or a UsageError for text that is no URL at all."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as e:
        raise UsageError(f"{url[:60]!r} is not a store URL: {e}") from None
    return parts.scheme.lower() if len(parts.scheme) > 1 else ""  # "C:" style is a path, not a scheme
