"""The ASGI application: OpenAI-style routes over one engine, which it only feeds.

Routes: GET / (the status page, polling GET /status.json; see `serve/_status.py`), GET /health, GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions, GET
/metrics, and the run receipts: GET /v1/receipts/{id} and /v1/receipts/{id}/trace (with a ReceiptSigner, every finished completion
carries a signed receipt; see `serve/_receipts.py`). Every error is a JSON body {"error": {"message", "type",
"param", "code"}}, never a traceback. Before any route, `_Guard` checks who asks: the `Host` header against the
allowed names (a web page that rebinds its own DNS name to this address sends its own name), and with an API key
the `Authorization: Bearer` header (every route but /health and the status page, a static document without data:
its figures come from /status.json, which needs the key like every other route). No CORS header is ever sent, and a POST body must
be `Content-Type: application/json` (a page can send a "simple" text/plain request without a preflight; JSON
needs one, which this server never grants). A request body is read with a size cap (Content-Length first, then while
it streams) and a deadline. A client that goes away, while its result streams or while it waits for one, has its
request cancelled in the engine (its KV cache is freed at the next step boundary). With `access_log`, one line per
request: method, path, status and seconds from its first byte to its last.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shardtool.errors import (InvalidRequestError, OverloadedError, RequestRefusedError, ShardtoolError,
                              UnavailableError, UsageError)
from shardtool.manifest import valid_receipt_id
from shardtool.runtime import ErrorEvent, FinishEvent, PromptScoresEvent, SamplingParams, TokenEvent, encode_prompt
from shardtool.serve._access import Access
from shardtool.serve._chat import ChatTemplate, encode_rendered
from shardtool.serve._handoff import Mailbox
from shardtool.serve._health import ShardHealth
from shardtool.serve._metrics import CONTENT_TYPE, Metrics
from shardtool.serve._protocol import Sampling, StreamUsage, parse_chat, parse_completion
from shardtool.serve._receipts import NO_NEW_TOKENS, RECEIPT_HELP, STOP_STRING, ReceiptSigner
from shardtool.serve._render import RenderPool
from shardtool.serve._status import PAGE, PAGE_HEADERS, manifest_card, status_document
from shardtool.serve._scores import CompletionScores, Scored, TokenText, chat_scores
from shardtool.text import printable
from shardtool.serve._text import TextStream
from shardtool.strict_json import loads_strict

ROUTES = ("/", "/status.json", "/health", "/v1/models", "/v1/models/{id}", "/v1/completions", "/v1/chat/completions", "/metrics", "/v1/receipts/{id}",
          "/v1/receipts/{id}/trace")
_RECEIPT_PREFIX = "/v1/receipts/"
_MODEL_PREFIX = "/v1/models/"
_JSON_TYPES = ("application/json",)
_OPEN_PATHS = ("/health", "/")  # without the API key: the health check, and the status page's static document


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0  # seconds to receive a whole request body, once its headers are in
    render_seconds: float = 5.0  # one chat template render (a worker process, killed past it)
    renderers: int = 2  # chat template worker processes: renders at once


def create_app(engine, *, model_id: str, chat: ChatTemplate | None = None, limits: Limits = Limits(),
               receipts: ReceiptSigner | None = None, access: Access = Access(),
               access_log: Callable[[str], None] | None = None) -> Starlette:
    """`engine`: a started runtime Engine (or anything with its interface); `model_id`: the verified
    manifest's model ID, the only `model` requests may name; `receipts`: sign every finished completion;
    `access`: the Host names and API key requests need; `access_log`: called with one line per request."""
    api = _API(engine, model_id, chat if chat is not None else ChatTemplate(None, {}), limits, receipts)
    routes = [
        Route("/", api.status_page, methods=["GET"]),
        Route("/status.json", api.status, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{id:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/metrics", api.metrics_page, methods=["GET"]),
        Route("/v1/receipts/{id}", api.receipt, methods=["GET"]),
        Route("/v1/receipts/{id}/trace", api.receipt_trace, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception, Exception: _crash})
    app.state.renderer = api.renderer  # `app.state.renderer.close()` stops its worker processes (also at exit)
    app.add_middleware(_Guard, access=access)
    # added last, so outermost: refusals are counted and logged too
    app.add_middleware(_CountRequests, metrics=api.metrics, log=access_log)
    return app


class _API:
    def __init__(self, engine, model_id: str, chat: ChatTemplate, limits: Limits, receipts: ReceiptSigner | None):
        self.engine = engine
        self.model_id = model_id
        self.chat = chat
        self.renderer = RenderPool(chat, workers=limits.renderers, seconds=limits.render_seconds)
        self.limits = limits
        self.receipts = receipts
        if receipts is None:
            self.metrics = Metrics(engine.metrics)
        else:
            store = receipts.store
            self.metrics = Metrics(lambda: {**engine.metrics(), **store.metrics()}, RECEIPT_HELP)
        self.created = int(time.time())
        self.shards = ShardHealth()

    async def status_page(self, request: Request) -> Response:
        return Response(PAGE, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def status(self, request: Request) -> Response:
        expert_cache = getattr(self.engine, "expert_cache", None)
        cache = await anyio.to_thread.run_sync(expert_cache) if expert_cache is not None else None
        card = manifest_card(getattr(self.engine, "manifest", None))
        document = status_document(self.metrics.read_engine(), card, cache, time.monotonic())
        return JSONResponse(document, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    async def health(self, request: Request) -> Response:
        status, document = self.shards.document()
        return JSONResponse(document, status_code=status)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["id"]
        if name != self.model_id:
            return JSONResponse(error_body(f"The model {printable(name[:100])!r} does not exist: this server serves "
                                           f"{self.model_id!r}", 404, param="model", code="model_not_found"),
                                status_code=404)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "shardtool",
                "max_model_len": self.engine.max_context}

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def receipt(self, request: Request) -> Response:
        signed = self._stored(request.path_params["id"])
        if isinstance(signed, Response):
            return signed
        return Response(signed.data, media_type="application/octet-stream")

    async def receipt_trace(self, request: Request) -> Response:
        signed = self._stored(request.path_params["id"])
        if isinstance(signed, Response):
            return signed
        return Response(signed.trace, media_type="application/octet-stream")

    def _stored(self, receipt_id: str):
        """The stored receipt, or the 404 JSON response saying why there is none."""
        if self.receipts is None:
            return JSONResponse(error_body("this server signs no run receipts (start it with --receipt-key)", 404,
                                           code="receipts_disabled"), status_code=404)
        if not valid_receipt_id(receipt_id):
            return JSONResponse(error_body(f"{receipt_id[:80]!r} is not a receipt id (1 to 64 of A-Z a-z 0-9 . _ -)",
                                           404, code="receipt_not_found"), status_code=404)
        signed = self.receipts.store.get(receipt_id)
        if signed is None:
            return JSONResponse(error_body(f"no receipt {receipt_id!r} here (never signed by this server, or evicted "
                                           f"from its store of the last {self.receipts.store.capacity} within "
                                           f"{self.receipts.store.max_bytes} bytes)", 404,
                                           code="receipt_not_found"), status_code=404)
        return signed

    async def completions(self, request: Request) -> Response:
        try:
            req = parse_completion(await _read_json(request, self.limits), self.model_id)
            if isinstance(req.prompt, str):
                ids = await anyio.to_thread.run_sync(encode_prompt, self.engine.tokenizer, req.prompt)
            else:
                ids = list(req.prompt)
            echo = None
            if req.echo:
                echo = req.prompt if isinstance(req.prompt, str) else self._decode(ids)
            scores = CompletionScores(TokenText(self.engine.tokenizer)) if req.logprobs is not None else None
            fmt = _CompletionFormat(self.model_id, scores, echo)
            # The prompt is scored when its scores are shown, or when it is all there is to answer (max_tokens 0).
            score_prompt = req.echo and (req.logprobs is not None or req.sampling.max_tokens == 0)
            return self._start(ids, req.sampling, req.stream, req.usage, fmt, logprobs=req.logprobs,
                               score_prompt=score_prompt)
        except ShardtoolError as err:
            return error_response(err)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req = parse_chat(await _read_json(request, self.limits), self.model_id)
            if self.engine.tokenizer is None:
                raise UsageError("this model ships no tokenizer.json: chat needs one; use /v1/completions with "
                                 "token ids")
            # The template renders in a worker process, bounded in time and memory; encoding a long conversation
            # may take a while too: off the event loop.
            text = await _while_connected(request, self.renderer.render, [m.as_template_dict() for m in req.messages])
            ids = await anyio.to_thread.run_sync(encode_rendered, self.engine.tokenizer, text)
            fmt = _ChatFormat(self.model_id, TokenText(self.engine.tokenizer) if req.top_logprobs is not None else None)
            return self._start(ids, req.sampling, req.stream, req.usage, fmt, logprobs=req.top_logprobs)
        except ShardtoolError as err:
            return error_response(err)

    def _start(self, ids: list[int], sampling: Sampling, stream: bool, usage: StreamUsage, fmt, *,
               logprobs: int | None = None, score_prompt: bool = False) -> Response:
        """Submit to the engine (refusals and a full queue are raised here, before any response starts)."""
        if sampling.stop and self.engine.tokenizer is None:
            raise UsageError("stop strings need the model's tokenizer.json, which this model does not ship")
        max_tokens = sampling.max_tokens
        if max_tokens is None:  # the rest of what one request can ever hold: the context, or the KV share
            max_tokens = max(1, self.engine.max_request_tokens - len(ids))
        # ignore_eos: no stop token at all (the receipt records the empty list it ran with).
        params = SamplingParams(max_new_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                seed=sampling.seed, stop_token_ids=() if sampling.ignore_eos else None)
        # A JSON answer without stop strings needs nothing before its end: its tokens wake the event loop not once.
        events = Mailbox(asyncio.get_running_loop(), every_token=stream or bool(sampling.stop))
        ticket = self.engine.submit(ids, params, events.put, record=self.receipts is not None, logprobs=logprobs,
                                    score_prompt=score_prompt)
        text = TextStream(self._decode, sampling.stop)
        return _Generation(self.engine, ticket, events, text, fmt, ids, stream, usage, self.receipts,
                           self.shards)

    def _decode(self, ids) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(list(ids), skip_special_tokens=True) if tokenizer is not None else ""


# ---------------------------------------------------------------------------------------------------------
# Reading the request


async def _read_json(request: Request, limits: Limits) -> Any:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in _JSON_TYPES:  # none at all too: a browser sends text/plain without asking first
        found = f"Content-Type {kind[:60]!r}" if kind else "no Content-Type"
        raise InvalidRequestError(f"the body must be JSON (Content-Type: application/json), got {found}",
                                  status=415)
    body = await _read_body(request, limits)
    try:
        return loads_strict(body, "the request body")
    except ShardtoolError as err:
        raise InvalidRequestError(f"the request body is not valid JSON: {err.message}") from None


async def _read_body(request: Request, limits: Limits) -> bytes:
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise InvalidRequestError(f"Content-Length {declared[:40]!r} is not a number of bytes")
        if int(declared) > cap:
            raise InvalidRequestError(f"the request body is {int(declared)} bytes, more than the cap of {cap}",
                                      status=413, code="request_too_large")
    chunks, size = [], 0
    try:
        with anyio.fail_after(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise InvalidRequestError(f"the request body is more than the cap of {cap} bytes", status=413,
                                              code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise InvalidRequestError(f"the request body did not arrive within {limits.body_timeout:g} seconds",
                                  status=408, code="request_timeout") from None
    except ClientDisconnect:
        raise InvalidRequestError("the client closed the connection before its request body was complete",
                                  code="client_disconnected") from None
    return b"".join(chunks)


async def _while_connected(request: Request, work, *args):
    """`await work(*args)`, cancelled if the client goes away meanwhile (its body was read: the next message
    is the disconnect). A chat render so cancelled has its worker process killed at once."""
    gone = False
    outcome: list = []
    async with anyio.create_task_group() as tasks:
        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        try:  # caught here: raised inside the task group, it would come out wrapped in an exception group
            outcome.append(await work(*args))
        except ShardtoolError as err:
            outcome.append(err)
        tasks.cancel_scope.cancel()
    if gone:
        raise InvalidRequestError("the client closed the connection before its answer", code="client_disconnected")
    if isinstance(outcome[0], ShardtoolError):
        raise outcome[0]
    return outcome[0]


# ---------------------------------------------------------------------------------------------------------
# Errors


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: ShardtoolError) -> JSONResponse:
    """Our error classes -> HTTP status (the one place that maps them)."""
    headers = {}
    param = code = None
    if isinstance(err, InvalidRequestError):
        status, param, code = err.status, err.param, err.code
    elif isinstance(err, OverloadedError):
        status, code = 503, "overloaded"
        headers["Retry-After"] = str(max(1, int(err.retry_after)))
    elif isinstance(err, UnavailableError):
        status, code = 503, "unavailable"
    elif isinstance(err, RequestRefusedError):
        status, code = 400, err.code
    elif isinstance(err, UsageError):
        status = 400
    else:  # verification failures and anything else on the server's side
        status = 500
    if status in (408, 413):  # the rest of the body may still be on its way: do not read it as a next request
        headers["Connection"] = "close"
    return JSONResponse(error_body(err.one_line(), status, param, code), status_code=status, headers=headers)


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 (no such route) and 405 (wrong method), as JSON bodies."""
    message = {404: f"no route {request.url.path[:100]!r}: this server has {', '.join(ROUTES)}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)


async def _crash(request: Request, exc: Exception) -> Response:
    """A bug: the client gets a JSON 500 without its traceback. (Starlette re-raises the exception after this
    response, and uvicorn logs it with its traceback on the server's stderr.)"""
    return JSONResponse(error_body("internal server error (a bug in shardtool: see the server's log)", 500),
                        status_code=500)


class _Guard:
    """The `Host` check, then the API key, before any route is reached; refusals are JSON errors."""

    def __init__(self, app, access: Access):
        self.app = app
        self.access = access
        self.key = None if access.api_key is None else b"Bearer " + access.api_key.encode("ascii")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # the last of a repeated header: h11 refuses a repeated Host anyway
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if not self.access.host_allowed(host, scope.get("server")):
            shown = repr(host[:80]) if host else "none"
            return await _send_json(send, 400, error_body(
                f"Host {shown} is not one this server answers to (start it with --allowed-hosts NAME to add one)",
                400, code="host_not_allowed"))
        if self.key is not None and scope["path"] not in _OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):  # constant time: no key byte by byte from the timing
                what = "no Authorization header" if not given else "an Authorization header that is not the API key"
                return await _send_json(send, 401, error_body(
                    f"this server needs an API key (Authorization: Bearer KEY): got {what}", 401,
                    code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)



class _CountRequests:
    """Counts every response by route (the path when it is one of ours, else "other") and status; with `log`, one
    access log line per request once its response ended (or the connection did)."""

    def __init__(self, app, metrics: Metrics, log: Callable[[str], None] | None = None):
        self.app = app
        self.metrics = metrics
        self.log = log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path.startswith(_RECEIPT_PREFIX):
            route = "/v1/receipts/{id}/trace" if path.endswith("/trace") else "/v1/receipts/{id}"
        elif path.startswith(_MODEL_PREFIX):
            route = "/v1/models/{id}"
        else:
            route = path if path in ROUTES else "other"
        start = time.perf_counter()
        status = None

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.count(route, status)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if self.log is not None:
                self.log(_access_line(scope, status, time.perf_counter() - start))


def _access_line(scope, status: int | None, seconds: float) -> str:
    """`127.0.0.1:5123 "POST /v1/completions" 200 0.412s` (status "-": no response was started). The path is the
    client's: escaped, and clipped."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    # A quote or space in the (percent-decoded) path would end the quoted request early and let it write a status
    # and time of its own: escaped like the controls.
    path = printable(scope["path"][:200]).replace('"', "\\x22").replace(" ", "\\x20")
    return f'{who} "{printable(scope["method"][:16])} {path}" {status if status is not None else "-"} {seconds:.3f}s'


# ---------------------------------------------------------------------------------------------------------
# Responses: one request's events from the engine, as one JSON document or as server-sent events


class _CompletionFormat:
    """`scores`: the answer shows its tokens' scores; `echo`: its text starts with the prompt's (this text)."""

    prefix, obj, chunk_obj = "cmpl-", "text_completion", "text_completion"

    def __init__(self, model_id: str, scores: CompletionScores | None = None, echo: str | None = None):
        self.model_id = model_id
        self.scores = scores
        self.echo = echo
        self._generated = False  # the first generated token's offset is set (after the echoed text)

    def choice(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return self.choice(text, finish, logprobs)

    def first_chunk(self) -> dict | None:
        return None

    def logprobs(self, prompt: list[Scored] | None, generated: list[Scored]) -> dict | None:
        """The `logprobs` object of these tokens (`prompt`: the echoed prompt's, first), or None without scores."""
        if self.scores is None:
            return None
        parts = [] if prompt is None else [self.scores.render(prompt, start=0)]
        if generated or not parts:
            start = None if self._generated else len(self.echo or "")
            self._generated = True
            parts.append(self.scores.render(generated, start=start))
        return {key: [x for part in parts for x in part[key]] for key in parts[0]}


class _ChatFormat(_CompletionFormat):
    """`scores`: the answer shows its tokens' scores (`logprobs: true`)."""

    prefix, obj, chunk_obj = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, model_id: str, token_text: TokenText | None = None):
        super().__init__(model_id)
        self.token_text = token_text

    def choice(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish}

    def first_chunk(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def logprobs(self, prompt: list[Scored] | None, generated: list[Scored]) -> dict | None:
        return None if self.token_text is None else chat_scores(generated, self.token_text)


class _Generation(Response):
    """An ASGI response that waits for the engine's events while watching for the client going away."""

    def __init__(self, engine, ticket, events: Mailbox, text: TextStream, fmt: _CompletionFormat,
                 prompt: list[int], stream: bool, usage: StreamUsage, receipts: ReceiptSigner | None = None,
                 shards: ShardHealth | None = None):
        self.engine, self.ticket, self.events, self.text, self.fmt = engine, ticket, events, text, fmt
        self.prompt, self.prompt_tokens = prompt, len(prompt)
        self.stream, self.usage = stream, usage
        self.prompt_scores: list[Scored] | None = None  # a PromptScoresEvent's, for an echo with scores
        self.scored: list[Scored] = []  # generated tokens' scores not yet sent
        self.receipts = receipts
        self.shards = shards if shards is not None else ShardHealth()
        self.record = None  # the finished request's RunRecord (a FinishEvent's), when receipts are signed
        self.ended = False  # the ticket ended (a finish or error event) or we cancelled it
        self.id = fmt.prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch, receive, tasks.cancel_scope)
                if self.stream:
                    await self._send_events(send)
                else:
                    await self._send_document(send)
                tasks.cancel_scope.cancel()
        finally:
            self._cancel()  # a disconnect, a server shutdown, a bug: the engine frees the request's KV cache

    async def _watch(self, receive: Callable, scope: anyio.CancelScope) -> None:
        """The body was read in full, so the next message is the disconnect (or nothing, until the response)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    def _cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self.engine.cancel(self.ticket)

    async def _next(self) -> tuple[str, Any]:
        """("text", delta) per token, then ("finish", reason) or ("error", ErrorEvent)."""
        while True:
            event = await self.events.get()
            if isinstance(event, TokenEvent):
                if event.logprobs is not None and not self.text.stopped:
                    self.scored.append((event.token, event.logprobs))
                delta = self.text.push(event.token)
                if self.text.stopped:  # a stop string: the text is complete, the rest is not wanted
                    self._cancel()
                    return "finish", ("stop", delta)
                if delta:
                    return "text", delta
            elif isinstance(event, PromptScoresEvent):  # before the first token
                self.prompt_scores = list(zip(self.prompt, event.scores))
            elif isinstance(event, FinishEvent):
                self.ended = True
                self.record = event.record
                return "finish", (event.reason, self.text.finish())
            elif isinstance(event, ErrorEvent):
                self.ended = True
                self.shards.note(event.error)  # a shard that failed its check: /health reports it
                return "error", event
            else:  # pragma: no cover - the engine's interface has exactly three events
                raise TypeError(f"unexpected engine event {event!r}")

    def _usage(self) -> dict:
        done = self.text.tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    async def _send_document(self, send) -> None:
        while True:
            kind, value = await self._next()
            if kind == "error":
                return await _send_json(send, value.status, error_body(value.message, value.status))
            if kind == "finish":
                reason, _ = value
                break
        echo = self.fmt.echo
        text = self.text.text if echo is None else echo + self.text.text
        logprobs = self._logprobs(self.prompt_scores if echo is not None else None)
        document = {"id": self.id, "object": self.fmt.obj, "created": self.created, "model": self.fmt.model_id,
                    "choices": [self.fmt.choice(text, reason, logprobs)], "usage": self._usage()}
        await self._add_receipt(document)
        await _send_json(send, 200, document)

    def _logprobs(self, prompt: list[Scored] | None) -> dict | None:
        """The scores of the tokens not sent yet (after `prompt`'s, for an echo), as the format shows them."""
        scored, self.scored = self.scored, []
        return self.fmt.logprobs(prompt, scored)

    async def _add_receipt(self, document: dict) -> None:
        """With receipts on: `receipt` (signed on a worker thread), or null and `receipt_unavailable` saying why."""
        if self.receipts is None:
            return
        if self.record is not None and self.record.tokens:
            document["receipt"] = await anyio.to_thread.run_sync(self.receipts.sign, self.record)
            return
        if self.record is not None:  # max_tokens 0: the prompt scored, no token generated
            why = NO_NEW_TOKENS
        elif self.text.stopped:  # a stop string ended it (its ticket was cancelled)
            why = STOP_STRING
        else:  # pragma: no cover - every other finished answer comes with its record
            raise RuntimeError("a finished request came without its run record")
        self.receipts.store.count_unavailable()
        document["receipt"] = None
        document["receipt_unavailable"] = {"reason": why[0], "message": why[1]}

    async def _send_events(self, send) -> None:
        kind, value = await self._next()
        if kind == "error":  # nothing was sent yet: a real status
            return await _send_json(send, value.status, error_body(value.message, value.status))
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        first = self.fmt.first_chunk()
        if first is not None:
            await self._chunk(send, [first])
        if self.fmt.echo is not None:  # the prompt's text (and scores) first; its scores came before any token
            await self._chunk(send, [self.fmt.delta(self.fmt.echo, None, self.fmt.logprobs(self.prompt_scores, []))])
        while True:
            if kind == "error":  # mid-stream: an error event, and the stream ends without [DONE]
                await _send_sse(send, error_body(value.message, value.status))
                break
            if kind == "text":
                await self._chunk(send, [self.fmt.delta(value, None, self._logprobs(None))])
            else:
                reason, delta = value
                if delta:
                    await self._chunk(send, [self.fmt.delta(delta, None, self._logprobs(None))])
                await self._chunk(send, [self.fmt.delta("", reason, self._logprobs(None) if self.scored else None)],
                                  receipt=True)
                if self.usage.include:
                    await self._chunk(send, [], usage=self._usage())
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
                break
            kind, value = await self._next()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _chunk(self, send, choices: list, usage: dict | None = None, receipt: bool = False) -> None:
        """`receipt`: this is the chunk with the finish_reason, which carries the receipt (when they are on)."""
        chunk = {"id": self.id, "object": self.fmt.chunk_obj, "created": self.created, "model": self.fmt.model_id,
                 "choices": choices}
        if self.usage.include:  # null in every chunk but the last, or (continuous) the counts so far in each
            chunk["usage"] = self._usage() if self.usage.continuous else usage
        if receipt:
            await self._add_receipt(chunk)
        await _send_sse(send, chunk)


async def _send_json(send, status: int, document: dict, headers: list | None = None) -> None:
    body = _dumps(document)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_sse(send, document: dict) -> None:
    await send({"type": "http.response.body", "body": b"data: " + _dumps(document) + b"\n\n", "more_body": True})


def _dumps(document: dict) -> bytes:
    return json.dumps(document, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
