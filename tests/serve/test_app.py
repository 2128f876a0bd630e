"""serve/_app.py and _server.py over a scripted engine (tests/serve/_fake_engine.py): the real uvicorn server on
127.0.0.1 in a thread, driven by raw HTTP. Responses, SSE framing, errors, caps, timeouts, disconnects, metrics.
(The real engine and the real `shardtool serve` process: test_serve_e2e.py.)"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from examples.make_tiny_moe import build_tokenizer
from shardtool.runtime import ErrorEvent
from shardtool.errors import UsageError
from shardtool.serve import Access, ChatTemplate, Limits, ServerSettings, bind, create_app, url_of
from shardtool.serve._server import uvicorn_server

from _fake_engine import EOS, FakeEngine, fake_score  # noqa: E402  (tests/serve is on sys.path: pytest's prepend mode)

MODEL = "acme/tiny"
REPLY = "Hello world, said the miller."
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


@contextlib.contextmanager
def serving(engine: FakeEngine, **kw):
    with serving_app(engine, **kw) as (base, _):
        yield base


@contextlib.contextmanager
def serving_app(engine: FakeEngine, *, limits: Limits = Limits(), settings: ServerSettings = ServerSettings(),
                chat: ChatTemplate | None = None, access: Access = Access(), access_log=None):
    """The server's URL, and its app."""
    app = create_app(engine, model_id=MODEL, chat=chat, limits=limits, access=access, access_log=access_log)
    sock = bind("127.0.0.1", 0)
    server = uvicorn_server(app, settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    engine.start()
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield url_of(sock), app
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()
        sock.close()
        app.state.renderer.close()


def replying(tok, text: str = REPLY, *, eos: bool = True):
    ids = tok.encode(text).ids + ([EOS] if eos else [])
    return lambda prompt, params: ids


@pytest.fixture
def engine(tok):
    return FakeEngine(tok, reply=replying(tok), tokenizer_config={"chat_template": CHAT_TEMPLATE})


@pytest.fixture
def url(engine):
    chat = ChatTemplate.from_tokenizer_config(engine.tokenizer_config)
    with serving(engine, chat=chat) as base:
        yield base


def post(url: str, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(url + path, content=data, headers=headers, **{"timeout": 30, **kw})


def sse(response_text: str) -> list:
    """Server-sent events as a client reads them: `data:` lines, each a JSON document or [DONE]."""
    events = []
    for block in response_text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(r: httpx.Response, status: int, *, param=None, code=None, words: str = "", kind=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == (kind or ("invalid_request_error" if status < 500 else "server_error"))
    assert (error["param"], error["code"]) == (param, code)
    assert words in error["message"], error["message"]
    assert "Traceback" not in r.text and "\n" not in error["message"]
    return error


# ---------------------------------------------------------------------------------------------------------


def test_health_models_and_json_404_405(url):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 64
    assert_error(httpx.get(url + "/v2/nothing"), 404, words="no route '/v2/nothing'")
    assert_error(httpx.get(url + "/v1/completions"), 405, words="GET is not allowed")


def test_a_completion(url, engine, tok):
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "The miller", "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "text_completion" and doc["model"] == MODEL and doc["id"].startswith("cmpl-")
    assert doc["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    n_reply = len(tok.encode(REPLY).ids) + 1  # the eos token counts as generated
    n_prompt = len(tok.encode("The miller").ids)
    assert doc["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_reply, "total_tokens": n_prompt + n_reply}
    params = engine.submitted[0].params
    assert (params.max_new_tokens, params.temperature, params.top_p, params.seed) == (40, 0.0, 1.0, None)
    assert engine.submitted[0].prompt == tok.encode("The miller").ids


def test_token_id_prompt_and_length_finish(url, engine, tok):
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "seed": 3})
    doc = r.json()
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["choices"][0]["text"] == tok.decode(tok.encode(REPLY).ids[:2])
    assert engine.submitted[0].prompt == [5, 6, 7] and engine.submitted[0].params.seed == 3


def test_a_stop_string_cuts_the_text_and_cancels_the_request(url, engine):
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 40, "stop": [", said", "zzz"]})
    doc = r.json()
    assert doc["choices"][0]["text"] == "Hello world" and doc["choices"][0]["finish_reason"] == "stop"
    assert engine.cancels == [engine.submitted[0].id]


def test_a_streamed_completion(url, engine):
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all("usage" not in c for c in chunks)


def test_a_streamed_completion_with_usage_and_a_stop_string(url, engine, tok):
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True,
                                      "stream_options": {"include_usage": True}, "stop": "miller"})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world, said the "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 1
    assert usage["usage"]["completion_tokens"] == next(
        i + 1 for i in range(40) if "miller" in tok.decode(tok.encode(REPLY).ids[:i + 1]))
    assert engine.cancels == [engine.submitted[0].id]


@pytest.mark.parametrize("name, body, most", [
    ("json", {}, 1),  # only its end: the tokens before it are read in one go
    ("json with a stop string", {"stop": "zzz"}, None),  # watched token by token
    ("stream", {"stream": True}, None),
])
def test_engine_to_loop_wakeups(url, engine, tok, monkeypatch, name, body, most):
    """A JSON answer's tokens cost the event loop no wake-up each (the engine thread's call_soon_threadsafe)."""
    import asyncio

    calls = []
    real = asyncio.BaseEventLoop.call_soon_threadsafe

    def counting(loop, *args, **kw):
        if threading.current_thread().name == "fake-engine":
            calls.append(args[0])
        return real(loop, *args, **kw)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", counting)
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 40, **body})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"] if not body.get("stream") else \
        "".join(c["choices"][0]["text"] for c in sse(r.text)[:-1])
    assert text == REPLY
    tokens = len(tok.encode(REPLY).ids) + 1
    if most is not None:
        assert len(calls) == most, calls
    else:  # each token was delivered as it came (the fake engine's steps are 2 ms apart: none rode along)
        assert len(calls) >= tokens // 2, calls


def test_a_chat_completion_and_its_stream(url, engine, tok):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 40}
    doc = post(url, "/v1/chat/completions", body).json()
    assert doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
    assert doc["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "logprobs": None,
                               "finish_reason": "stop"}]
    assert engine.submitted[0].prompt == tok.encode("user: Hi\nassistant:", add_special_tokens=False).ids
    events = sse(post(url, "/v1/chat/completions", {**body, "stream": True}).text)
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == REPLY
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


def test_chat_max_tokens_default_is_the_rest_of_the_context(url, engine, tok):
    post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    prompt = engine.submitted[0].prompt
    assert engine.submitted[0].params.max_new_tokens == 64 - len(prompt)


def test_engine_refusals_are_400_and_a_full_queue_is_503_with_retry_after(url, engine):
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": [1, 600]}), 400, words="token id 600")
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 64}), 400,
                 code="context_length_exceeded", words="exceed the context of 64")
    engine.max_batch = 0  # nothing is admitted: every request waits in the queue
    held = [threading.Thread(target=post, args=(url, "/v1/completions", {"model": MODEL, "prompt": "x"}))
            for _ in range(engine.max_queue)]
    for t in held:
        t.start()
    _wait(lambda: len(engine.submitted) == engine.max_queue, "the queue to fill")
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    engine.max_batch = 2
    for t in held:
        t.join()
    assert_error(r, 503, code="overloaded", words="wait queue is full")
    assert r.headers["retry-after"] == "3"


def test_an_error_before_the_first_token_is_a_real_status(url, engine):
    engine.reply = lambda prompt, params: [ErrorEvent(500, "expert 3 of layer 1 failed verification", ValueError())]
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}), 500,
                 words="expert 3 of layer 1 failed verification")
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": "x"}), 500, words="failed verification")


def test_an_error_mid_stream_is_an_error_event_and_no_done(url, engine, tok):
    ids = tok.encode("Hello world").ids
    engine.reply = lambda prompt, params: ids + [ErrorEvent(500, "a shard failed verification", ValueError())]
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == 200
    events = sse(r.text)
    assert events[-1] == {"error": {"message": "a shard failed verification", "type": "server_error", "param": None,
                                    "code": None}}
    assert "[DONE]" not in events
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello world"
    # Not streamed: no partial text, only the error.
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": "x"}), 500, words="failed verification")


def test_a_bug_is_a_json_500_without_traceback(url, engine):
    def broken(prompt, params):
        raise RuntimeError("a planted bug")

    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        engine.reply = broken
        assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": "x"}), 500, words="internal server error")
        # The traceback is in the server's log instead (uvicorn logs it after the response went out).
        deadline = time.monotonic() + 10
        while not any(r.exc_info and "a planted bug" in str(r.exc_info[1]) for r in logged):
            assert time.monotonic() < deadline, [r.getMessage() for r in logged]
            time.sleep(0.01)
    finally:
        logger.removeHandler(handler)


# name -> (raw body, extra headers, status, param, code, words)
RAW_BAD = {
    "malformed-json": (b'{"model": "acme/tiny", "prompt": ', {}, 400, None, None, "not valid JSON"),
    "not-utf8": (b'{"model": "\xff"}', {}, 400, None, None, "not UTF-8"),
    "duplicate-key": (b'{"model": "acme/tiny", "prompt": "a", "prompt": "b"}', {}, 400, None, None, "twice"),
    "nan": (b'{"model": "acme/tiny", "prompt": "a", "temperature": NaN}', {}, 400, None, None, "NaN"),
    "deep-nesting": (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400, None, None, "nested too deeply"),
    "top-level-array": (b'[1, 2]', {}, 400, None, None, "must be a JSON object"),
    "empty-body": (b"", {}, 400, None, None, "not valid JSON"),
    "form-content-type": (b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 415, None, None,
                          "must be JSON"),
    # What a web page can send without a CORS preflight: text/plain, or no Content-Type at all.
    "text-plain-json": (b'{"model": "acme/tiny", "prompt": "a"}', {"content-type": "text/plain"}, 415, None, None,
                        "got Content-Type 'text/plain'"),
    "no-content-type": (b'{"model": "acme/tiny", "prompt": "a"}', {"content-type": ""}, 415, None, None,
                        "got no Content-Type"),
    "wrong-type": (b'{"model": "acme/tiny", "prompt": "a", "max_tokens": "ten"}', {}, 400, "max_tokens", None,
                   "must be an integer"),
    "other-model": (b'{"model": "gpt-4", "prompt": "a"}', {}, 404, "model", "model_not_found", "does not exist"),
}


@pytest.mark.parametrize("name", RAW_BAD)
def test_bad_raw_bodies(url, name):
    body, headers, status, param, code, words = RAW_BAD[name]
    assert_error(post(url, "/v1/completions", body, headers=headers), status, param=param, code=code, words=words)


def test_body_cap_by_content_length_and_while_streaming(engine):
    with serving(engine, limits=Limits(max_body_bytes=1000)) as base:
        big = json.dumps({"model": MODEL, "prompt": "x" * 2000})
        assert_error(post(base, "/v1/completions", big), 413, code="request_too_large", words=f"{len(big)} bytes")

        def chunks():  # no Content-Length: chunked transfer encoding
            for _ in range(10):
                yield b" " * 500

        r = httpx.post(base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large", words="more than the cap of 1000 bytes")
        assert r.headers["connection"] == "close"


def test_a_slow_body_times_out_with_408(engine):
    with serving(engine, limits=Limits(body_timeout=0.5)) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_slow_headers_time_out_with_408_and_a_closed_connection(engine):
    with serving(engine, settings=ServerSettings(header_timeout=0.5)) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # ... and the rest never comes
            t0 = time.monotonic()
            reply = _read_all(s)
            assert time.monotonic() - t0 < 9  # closed by the server, not by our socket timeout
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        with socket.create_connection((host, int(port)), timeout=10) as s:  # a keep-alive request after one answer
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            first = b""
            while not first.endswith(b'{"status":"ok"}'):
                first += s.recv(65536)
            assert first.startswith(b"HTTP/1.1 200 ")
            s.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request's headers stall
            assert _read_all(s).startswith(b"HTTP/1.1 408 ")


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return out
        if not data:
            return out
        out += data


def _wait(predicate, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_while_queued_is_cancelled(url, engine, stream):
    engine.gate.clear()
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "x", "stream": stream}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait(lambda: engine.submitted, "the request to reach the engine")
    _wait(lambda: engine.cancels == [engine.submitted[0].id], "the cancel")
    engine.gate.set()


def test_a_client_that_goes_away_mid_stream_is_cancelled(url, engine, tok):
    engine.reply = lambda prompt, params: tok.encode("word " * 50).ids
    engine.step_seconds = 0.05
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 60,
                                                             "stream": True}) as r:
        next(r.iter_lines())
    _wait(lambda: engine.cancels == [engine.submitted[0].id], "the cancel")


def test_metrics(url, engine):
    post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    post(url, "/v1/completions", {"model": MODEL, "prompt": ""})
    httpx.get(url + "/nowhere")
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in ("# TYPE shardtool_queue_depth gauge", "# TYPE shardtool_generation_tokens_total counter",
                 "shardtool_requests_finished_total 1.0", "shardtool_kv_cache_bytes_capacity 1.048576e+06",
                 'shardtool_http_requests_total{route="/v1/completions",status="200"} 1.0',
                 'shardtool_http_requests_total{route="/v1/completions",status="400"} 1.0',
                 'shardtool_http_requests_total{route="other",status="404"} 1.0'):
        assert line in text, line
    assert "python_gc" not in text and "process_" not in text  # a private registry: only ours
    assert "_created" not in text  # prometheus_client's creation times would be one more gauge family per counter


def test_chat_without_a_template_is_400_and_a_broken_one_500(engine):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    with serving(engine, chat=ChatTemplate.from_tokenizer_config({})) as base:
        assert_error(post(base, "/v1/chat/completions", body), 400, param="messages", code="no_chat_template",
                     words="no chat template")
        assert post(base, "/v1/completions", {"model": MODEL, "prompt": "x"}).status_code == 200
    engine2 = FakeEngine(engine.tokenizer, reply=engine.reply)
    with serving(engine2, chat=ChatTemplate.from_tokenizer_config({"chat_template": "{% if %}"})) as base:
        assert_error(post(base, "/v1/chat/completions", body), 500, words="does not compile")


# ---------------------------------------------------------------------------------------------------------
# Who may ask: the Host header, the API key, no CORS


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


# name -> (Access, Host header with {port} for the server's own, allowed?)
HOSTS = {
    "default-bound-address": (Access(), "127.0.0.1:{port}", True),
    "default-bound-address-no-port": (Access(), "127.0.0.1", True),
    "default-localhost": (Access(), "localhost:{port}", True),
    "default-localhost-upper-case": (Access(), "LocalHost:{port}", True),
    "default-ipv6-loopback": (Access(), "[::1]:{port}", True),
    "default-ipv6-loopback-no-port": (Access(), "[::1]", True),
    "default-rebound-name": (Access(), "rebind.attacker.example:{port}", False),
    "default-rebound-name-no-port": (Access(), "rebind.attacker.example", False),
    "default-localhost-other-port": (Access(), "localhost:1", False),
    "default-loopback-prefix": (Access(), "127.0.0.1.attacker.example:{port}", False),
    "default-port-twice": (Access(), "localhost:{port}:{port}", False),
    "default-empty": (Access(), "", False),
    "listed-name": (Access(("api.example",)), "api.example", True),
    "listed-name-own-port": (Access(("api.example",)), "api.example:{port}", True),
    "listed-name-other-port": (Access(("api.example",)), "api.example:1", False),
    "listed-name-with-port": (Access(("api.example:443",)), "api.example:443", True),
    "listed-replaces-the-default": (Access(("api.example",)), "localhost:{port}", False),
}


@pytest.mark.parametrize("name", HOSTS)
def test_host_header(engine, name):
    access, host, allowed = HOSTS[name]
    with serving(engine, access=access) as base:
        r = httpx.get(base + "/v1/models", headers={"host": host.format(port=_port(base))}, timeout=30)
    if allowed:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 400, code="host_not_allowed", words="is not one this server answers to")


def test_a_request_without_host_is_refused(engine):
    with serving(engine) as base, socket.create_connection(("127.0.0.1", _port(base)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        reply = b"".join(iter(lambda: s.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 400 ") and b"Host none is not one" in reply, reply


KEY = "sk-test-0123456789"
# name -> (method, path, Authorization header or None, status)
API_KEY = {
    "models-without-key": ("GET", "/v1/models", None, 401),
    "models-wrong-key": ("GET", "/v1/models", "Bearer sk-test-0123456780", 401),
    "models-key-prefix": ("GET", "/v1/models", "Bearer sk-test", 401),
    "models-key-without-bearer": ("GET", "/v1/models", KEY, 401),
    "models-basic-scheme": ("GET", "/v1/models", "Basic " + KEY, 401),
    "completions-without-key": ("POST", "/v1/completions", None, 401),
    "chat-without-key": ("POST", "/v1/chat/completions", None, 401),
    "metrics-without-key": ("GET", "/metrics", None, 401),
    "receipt-without-key": ("GET", "/v1/receipts/abc", None, 401),
    "unknown-route-without-key": ("GET", "/nothing", None, 401),
    "health-without-key": ("GET", "/health", None, 200),
    "models-with-key": ("GET", "/v1/models", "Bearer " + KEY, 200),
    "completions-with-key": ("POST", "/v1/completions", "Bearer " + KEY, 200),
    "metrics-with-key": ("GET", "/metrics", "Bearer " + KEY, 200),
}


@pytest.fixture
def keyed_url(engine):
    chat = ChatTemplate.from_tokenizer_config(engine.tokenizer_config)
    with serving(engine, chat=chat, access=Access(api_key=KEY)) as base:
        yield base


@pytest.mark.parametrize("name", API_KEY)
def test_api_key(keyed_url, name):
    method, path, auth, status = API_KEY[name]
    headers = {"content-type": "application/json", **({"authorization": auth} if auth is not None else {})}
    fields = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    body = json.dumps({"model": MODEL, **fields}) if method == "POST" else None
    r = httpx.request(method, keyed_url + path, content=body, headers=headers, timeout=30)
    if status == 401:
        assert_error(r, 401, code="invalid_api_key", words="needs an API key")
        assert r.headers["www-authenticate"] == "Bearer"
    else:
        assert r.status_code == status, r.text


@pytest.mark.parametrize("key", ["", "two words", "tab\there", "\u00e9t\u00e9", "x" * 4097])
def test_unusable_api_keys_are_a_usage_error(key):
    with pytest.raises(UsageError):
        Access(api_key=key)


@pytest.mark.parametrize("host", ["", "a b", "http://x", "user@x", "x/y", "a,b"])
def test_unusable_allowed_hosts_are_a_usage_error(host):
    with pytest.raises(UsageError):
        Access(allowed_hosts=(host,))


def test_no_cors_headers_are_ever_sent(url):
    """A preflight is not granted and no answer names an allowed origin: a page elsewhere cannot read one."""
    origin = {"origin": "http://attacker.example"}
    answers = [httpx.options(url + "/v1/completions", headers={**origin, "access-control-request-method": "POST",
                                                                "access-control-request-headers": "content-type"},
                             timeout=30),
               httpx.get(url + "/v1/models", headers=origin, timeout=30),
               httpx.get(url + "/health", headers=origin, timeout=30),
               post(url, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers=origin)]
    assert answers[0].status_code == 405
    for r in answers:
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], dict(r.headers)


# ---------------------------------------------------------------------------------------------------------
# A hostile signed chat template: bounded in time, killed when its client leaves, never starving other routes

SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@contextlib.contextmanager
def hostile(tok, seconds: float):
    engine = FakeEngine(tok, reply=replying(tok), tokenizer_config={"chat_template": SPIN}, max_queue=64)
    chat = ChatTemplate.from_tokenizer_config(engine.tokenizer_config)
    with serving_app(engine, chat=chat, limits=Limits(render_seconds=seconds, renderers=2)) as (base, app):
        yield base, app.state.renderer


def test_a_template_that_spins_is_a_500_at_its_deadline(tok):
    with hostile(tok, seconds=1.0) as (base, renderer):
        started = time.monotonic()
        r = post(base, "/v1/chat/completions", CHAT_BODY)
        took = time.monotonic() - started
        assert_error(r, 500, words="exceeded its render limit (1 seconds")
        assert took < 15, took
        # The worker was killed and is replaced: the next render gets a fresh one, and the same answer.
        assert_error(post(base, "/v1/chat/completions", CHAT_BODY), 500, words="exceeded its render limit")
        assert renderer.overruns == 2 and renderer.running == 0


def test_spinning_templates_never_starve_completions_or_health(tok):
    """Twice as many hostile chat requests as renderers, each held for its whole deadline: completions and
    /health still answer at once meanwhile."""
    with hostile(tok, seconds=6.0) as (base, _):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=8) as pool:
            chats = [pool.submit(post, base, "/v1/chat/completions", CHAT_BODY) for _ in range(4)]
            time.sleep(0.5)  # the renders are under way
            started = time.monotonic()
            health = httpx.get(base + "/health", timeout=30)
            completion = post(base, "/v1/completions", {"model": MODEL, "prompt": "x"})
            took = time.monotonic() - started
            assert health.status_code == 200 and completion.status_code == 200, (health.text, completion.text)
            assert not any(c.done() for c in chats), "the hostile renders ended early"
            assert took < 3.0, f"other routes waited {took:.1f}s behind the renders"
            for c in chats:
                assert_error(c.result(), 500, words="exceeded its render limit")


def test_a_render_whose_client_left_is_killed(tok):
    """The deadline is ten minutes: only the client's leaving can stop this render, and it does, at once."""
    with hostile(tok, seconds=600) as (base, renderer):
        with pytest.raises(httpx.ReadTimeout):
            post(base, "/v1/chat/completions", CHAT_BODY, timeout=2)
        deadline = time.monotonic() + 10
        while renderer.running:
            assert time.monotonic() < deadline, "the render went on after its client left"
            time.sleep(0.05)
        # and the next request gets a fresh worker
        with pytest.raises(httpx.ReadTimeout):
            post(base, "/v1/chat/completions", CHAT_BODY, timeout=2)


# ---------------------------------------------------------------------------------------------------------
# Scores (logprobs) in OpenAI's shapes; the values come from the engine (made up by the fake one, checked against
# transformers in test_serve_e2e.py).


def _completion_scores(tok, ids, top, *, start=0, first_unscored=False) -> dict:
    """What the completions `logprobs` object must hold for these ids under `fake_score`."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for i, t in enumerate(ids):
        text = tok.decode([t], skip_special_tokens=False)
        tokens.append(text)
        offsets.append(start)
        start += len(text)
        if first_unscored and i == 0:
            logprobs.append(None)
            tops.append(None)
            continue
        score = fake_score(t, top)
        logprobs.append(score.logprob)
        tops.append({**{tok.decode([a], skip_special_tokens=False): lp for a, lp in score.top}, text: score.logprob})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _joined(parts: list[dict]) -> dict:
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


def test_completion_logprobs(url, engine, tok):
    doc = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 40, "logprobs": 2}).json()
    reply = tok.encode(REPLY).ids + [EOS]
    assert doc["choices"][0]["text"] == REPLY
    assert doc["choices"][0]["logprobs"] == _completion_scores(tok, reply, 2)
    assert engine.submitted[0].logprobs == 2 and not engine.submitted[0].score_prompt


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_echo_scores_the_prompt_then_the_answer(url, engine, tok, stream):
    prompt = "The miller said"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "logprobs": 1, "echo": True, "stream": stream}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [e["choices"][0] for e in sse(r.text)[:-1]]
        text = "".join(c["text"] for c in chunks)
        logprobs = _joined([c["logprobs"] for c in chunks if c["logprobs"] is not None])
        assert chunks[0]["text"] == prompt  # the echo comes first, with the prompt's scores
    else:
        choice = r.json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    ids = tok.encode(prompt).ids
    reply = tok.encode(REPLY).ids + [EOS]
    assert text == prompt + REPLY
    expected = _joined([_completion_scores(tok, ids, 1, first_unscored=True),
                        _completion_scores(tok, reply, 1, start=len(prompt))])
    assert logprobs == expected
    assert engine.submitted[0].score_prompt and engine.submitted[0].logprobs == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_max_tokens_zero_with_echo_scores_the_prompt_only(url, engine, tok, stream):
    """What evaluation harnesses send to score a given text: token ids, echo, max_tokens 0."""
    ids = [5, 77, 300, 9]
    body = {"model": MODEL, "prompt": [ids], "max_tokens": 0, "logprobs": 0, "echo": True, "temperature": 0,
            "stream": stream}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        echo, end = (e["choices"][0] for e in events[:-1])
        assert (echo["text"], echo["finish_reason"], end["text"], end["finish_reason"]) == (
            tok.decode(ids), None, "", "length")
        logprobs = echo["logprobs"]
    else:
        doc = r.json()
        assert doc["choices"][0]["text"] == tok.decode(ids) and doc["choices"][0]["finish_reason"] == "length"
        assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}
        logprobs = doc["choices"][0]["logprobs"]
    assert logprobs == _completion_scores(tok, ids, 0, first_unscored=True)
    assert engine.submitted[0].params.max_new_tokens == 0


def test_echo_without_logprobs_prefixes_the_prompt_unscored(url, engine, tok):
    doc = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 40, "echo": True}).json()
    assert doc["choices"][0]["text"] == "x" + REPLY and doc["choices"][0]["logprobs"] is None
    assert engine.submitted[0].logprobs is None and not engine.submitted[0].score_prompt


def _chat_scores(tok, ids, top) -> dict:
    def entry(t, lp):
        text = tok.decode([t], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, fake_score(t, top).logprob),
                         "top_logprobs": [entry(a, lp) for a, lp in fake_score(t, top).top]} for t in ids]}


@pytest.mark.parametrize("fields, top", [({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 3}, 3)])
def test_chat_logprobs_and_their_stream(url, engine, tok, fields, top):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 40, **fields}
    doc = post(url, "/v1/chat/completions", body).json()
    expected = _chat_scores(tok, tok.encode(REPLY).ids + [EOS], top)
    assert doc["choices"][0]["message"]["content"] == REPLY
    assert doc["choices"][0]["logprobs"] == expected
    events = sse(post(url, "/v1/chat/completions", {**body, "stream": True}).text)[:-1]
    streamed = [c for e in events if e["choices"][0]["logprobs"] is not None
                for c in e["choices"][0]["logprobs"]["content"]]
    assert streamed == expected["content"]
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk


def test_scores_past_the_context_are_refused_with_its_code(url, engine):
    assert_error(post(url, "/v1/completions", {"model": MODEL, "prompt": list(range(2, 70)), "max_tokens": 0,
                                               "echo": True, "logprobs": 1}),
                 400, code="context_length_exceeded", words="exceed the context of 64")


def test_a_model_by_its_id(url):
    listed = httpx.get(url + "/v1/models").json()["data"][0]
    assert httpx.get(url + "/v1/models/" + MODEL).json() == listed
    assert_error(httpx.get(url + "/v1/models/acme/other"), 404, param="model", code="model_not_found",
                 words="'acme/other' does not exist")
    assert_error(httpx.get(url + "/v1/models/"), 404, param="model", code="model_not_found")


def test_response_format_text_is_accepted(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "text"}}
    assert post(url, "/v1/chat/completions", body).status_code == 200
    assert_error(post(url, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}}), 400,
                 param="response_format.type", words="json_object is not supported")


def test_the_access_log_has_one_line_per_request(engine):
    lines: list[str] = []
    with serving(engine, access_log=lines.append) as base:
        post(base, "/v1/completions", {"model": MODEL, "prompt": "x"})
        httpx.get(base + "/v1/models/" + MODEL)
        httpx.get(base + "/nowhere%1B[31m")
        post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    assert len(lines) == 4, lines
    pattern = r'127\.0\.0\.1:\d+ "(GET|POST) (\S+)" (\d{3}) (\d+\.\d{3})s'
    parsed = [re.fullmatch(pattern, line).groups()[:3] for line in lines]
    assert parsed == [("POST", "/v1/completions", "200"), ("GET", "/v1/models/" + MODEL, "200"),
                      ("GET", "/nowhere\\x1b[31m", "404"), ("POST", "/v1/completions", "200")]


def test_an_access_log_line_cannot_be_forged_by_a_path(engine):
    """A path that decodes to a quote and spaces would close the quoted request early and write a status and time of
    its choosing: `"GET /x" 200 0.001s "GET /y" 404 0.002s`, read as a 200 by anything that parses the line."""
    lines: list[str] = []
    with serving(engine, access_log=lines.append) as base:
        httpx.get(base + '/x%22%20200%200.001s%20%22GET%20/y')
    pattern = r'127\.0\.0\.1:\d+ "(GET|POST) ([^" ]+)" (\d{3}) (\d+\.\d{3})s'
    assert [re.fullmatch(pattern, line).groups()[1:3] for line in lines] == [
        ("/x\\x22\\x20200\\x200.001s\\x20\\x22GET\\x20/y", "404")], lines
