"""The installed `shardtool serve` on a tiny generated, split and signed Mixtral: the real server process on
127.0.0.1 (a free port, its own process group, ended by that group's id), driven by the official `openai`
client and by raw HTTP for the bad inputs. Greedy text equals verify-and-run's for the same prompt."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from _kit.cli import BIN, Result, run
from examples.make_tiny_moe import make_checkpoint

MODEL_ID = "test/tiny-serve"
MAX_CONTEXT = 128
READ_TIMEOUT = 2
SERVE_FLAGS = ("--memory-budget", "256MiB", "--max-context", str(MAX_CONTEXT), "--max-batch", "4",
               "--max-queue", "8", "--read-timeout", str(READ_TIMEOUT), "--readers", "1")


@dataclass
class Built:
    work: Path
    model: Path  # split, signed by a.key; its tokenizer_config.json has a chat template
    plain: Path  # the same without a chat template


def cli(*args, program: str = "shardtool", cwd: Path, timeout: int = 180) -> Result:
    """`shardtool args...` (or `program`) through the suite's runner, XDG state in `cwd`."""
    return run(program, *args, cwd=cwd, state=cwd, timeout=timeout)


def ok(*args, **kw) -> Result:
    r = cli(*args, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, args))} exited {r.returncode}:\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    if not (BIN / "shardtool").exists():
        pytest.fail(f"the shardtool console script is not installed next to {sys.executable}; run `make install`")
    work = tmp_path_factory.mktemp("serve")
    ok("keygen", "--out", "a", "--no-passphrase", cwd=work)
    out = {}
    for name, knobs in (("model", {}), ("plain", {"chat_template": False})):
        make_checkpoint(work / f"{name}-hf", "mixtral", experts=8, layers=2, **knobs)
        ok("split", "-q", work / f"{name}-hf", work / name, "--model-id", MODEL_ID, "--version", "1", cwd=work)
        ok("sign", work / name, "--key", "a.key", cwd=work)
        out[name] = work / name
    return Built(work, out["model"], out["plain"])


class Server:
    """One `shardtool serve` process in its own session; `stop()` signals its process group."""

    def __init__(self, built: Built, model: Path, *extra, trust: str = "a.pub", state: str = "state"):
        self.log = built.work / f"serve-{time.monotonic_ns()}.log"
        self.err = open(self.log, "w+")
        env = {**os.environ, "XDG_STATE_HOME": str(built.work)}
        self.proc = subprocess.Popen(
            [str(BIN / "shardtool"), "serve", str(model), "--trust", str(built.work / trust), "--state-dir",
             str(built.work / state), "--port", "0", *SERVE_FLAGS, *map(str, extra)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.err, cwd=built.work, env=env,
            start_new_session=True)
        self.url = None

    def wait_listening(self, seconds: float = 120) -> "Server":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m = re.search(r"serving (\S+) on (https?://127\.0\.0\.1:\d+)", self.stderr())
            if m:
                assert m.group(1) == MODEL_ID
                self.url = m.group(2)
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"shardtool serve exited {self.proc.returncode}:\n{self.stderr()}")
            time.sleep(0.05)
        raise AssertionError(f"shardtool serve did not listen within {seconds}s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.log.read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.err.close()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.split("://")[1].split(":")
        return host, int(port)


@pytest.fixture(scope="module")
def server(built):
    s = Server(built, built.model, "--model-id", MODEL_ID).wait_listening()
    yield s
    code = s.stop()
    assert code == 0, s.stderr()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def verify_and_run(built: Built, *args) -> str:
    r = ok(built.model, "--trust", built.work / "a.pub", "--state-dir", built.work / "state", "--model-id", MODEL_ID,
           "-q", *args, program="verify-and-run", cwd=built.work)
    assert r.stdout.endswith("\n")
    return r.stdout[:-1]


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, new", [("Hi", 24), ("The miller said the river", 40)])
def test_greedy_completion_equals_verify_and_run(built, client, prompt, new):
    result = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=new, temperature=0)
    assert result.choices[0].text == verify_and_run(built, "--prompt", prompt, "--max-new-tokens", new)
    assert result.choices[0].finish_reason in ("stop", "length")
    assert result.usage.completion_tokens <= new and result.usage.prompt_tokens >= 1


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_token_id_prompt_equals_verify_and_run(built, client):
    result = client.completions.create(model=MODEL_ID, prompt=[5, 77, 300], max_tokens=16, temperature=0)
    assert result.choices[0].text == verify_and_run(built, "--prompt-ids", "5,77,300", "--max-new-tokens", 16)


def test_chat_equals_verify_and_run_on_the_rendered_prompt(built, client):
    from tokenizers import Tokenizer

    from shardtool.serve import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the mill?"}]
    config = json.loads((built.model / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(built.model / "tokenizer.json"))
    ids = ChatTemplate.from_tokenizer_config(config).prompt_ids(tok, messages)
    expected = verify_and_run(built, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", 20)

    result = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected
    assert result.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_stop_strings(client):
    whole = client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=40, temperature=0).choices[0].text
    stop = whole[10:13]
    assert len(stop) == 3
    cut = client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def a_prompt_greedy_decoding_ends_at_eos(client, max_tokens: int) -> list[int]:
    """Token-id prompts tried in order until one's greedy answer stops on the model's EOS before max_tokens."""
    for first in range(3, 259):
        prompt = [first, 42]
        got = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0)
        if got.choices[0].finish_reason == "stop":
            return prompt
    raise AssertionError("no prompt of the tiny model reaches EOS greedily")


IGNORE_EOS_TOKENS = 40


@pytest.fixture(scope="module")
def eos_prompt(client) -> list[int]:
    return a_prompt_greedy_decoding_ends_at_eos(client, IGNORE_EOS_TOKENS)


def test_ignore_eos_generates_exactly_max_tokens(client, eos_prompt):
    n = IGNORE_EOS_TOKENS
    early = client.completions.create(model=MODEL_ID, prompt=eos_prompt, max_tokens=n, temperature=0)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens < n
    full = client.completions.create(model=MODEL_ID, prompt=eos_prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert (full.choices[0].finish_reason, full.usage.completion_tokens) == ("length", n)
    assert full.choices[0].text.startswith(early.choices[0].text)  # the same greedy answer, run on past EOS
    streamed = list(client.completions.create(model=MODEL_ID, prompt=eos_prompt, max_tokens=n, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert streamed[-1].usage.completion_tokens == n
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full.choices[0].text


def test_ignore_eos_keeps_stop_strings(client, eos_prompt):
    full = client.completions.create(model=MODEL_ID, prompt=eos_prompt, max_tokens=IGNORE_EOS_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(len(full) - 1, 0, -1) if full[i:i + 2].strip() and
                full.index(full[i:i + 2]) == i)  # a late piece of text that occurs only there
    cut = client.completions.create(model=MODEL_ID, prompt=eos_prompt, max_tokens=IGNORE_EOS_TOKENS,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert (cut.text, cut.finish_reason) == (full[:full.index(stop)], "stop")


def test_chat_ignore_eos_runs_to_max_tokens(client):
    n = 24
    got = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ("length", n)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_in_every_chunk(client, chat):
    n = 12
    options = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        chunks = list(client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=n, temperature=0, stream=True,
            stream_options=options, extra_body={"ignore_eos": True}))
    else:
        chunks = list(client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=n, temperature=0,
                                                stream=True, stream_options=options,
                                                extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[0].usage.prompt_tokens
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == n  # the counts so far, never going back
    assert all(c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + c.usage.completion_tokens
               for c in chunks)
    assert chunks[-1].choices == [] and counts[-2] == n  # the last usage chunk, as with include_usage alone
    # Without continuous_usage_stats only the last chunk counts, as before.
    plain = list(client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=n, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("extra, stream_options, param", [
    ({"ignore_eos": "true"}, None, "ignore_eos"),
    ({"ignore_eos": 1}, None, "ignore_eos"),
    ({}, {"include_usage": True, "continuous_usage_stats": "yes"}, "stream_options.continuous_usage_stats"),
    ({}, {"include_usage": True, "continuous_usage_stats": 0}, "stream_options.continuous_usage_stats"),
])
def test_the_vllm_extensions_refuse_other_types(client, chat, extra, stream_options, param):
    kw = {"stream": True, "stream_options": stream_options} if stream_options is not None else {}
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_body=extra, **kw)
        else:
            client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2, extra_body=extra, **kw)
    assert info.value.status_code == 400 and info.value.param == param
    assert "true or false" in info.value.message


def test_sampling_with_a_seed_is_reproducible(client):
    def run():
        return client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=20, temperature=0.9, top_p=0.9,
                                         seed=7).choices[0].text
    assert run() == run()


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("shardtool_queue_depth", "shardtool_last_batch_size", "shardtool_cache_hits_total",
                 "shardtool_cache_misses_total", "shardtool_cache_evictions_total", "shardtool_bytes_read_total",
                 "shardtool_bytes_verified_total", "shardtool_verification_failures_total",
                 "shardtool_kv_cache_bytes_in_use", "shardtool_generation_tokens_total",
                 'shardtool_http_requests_total{route="/v1/models",status="200"}'):
        assert re.search(rf"^{re.escape(name)} ", text, re.M), name


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2, n=2)
    assert info.value.param == "n"


def assert_error(r: httpx.Response, status: int, words: str, param=None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"], error["message"]
    assert error["param"] == param
    assert "Traceback" not in r.text


def post(server, body, path="/v1/completions", **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=60, **kw)


# name -> (body, status, words in the message, param)
BAD = {
    "malformed-json": (b'{"model": "x", ', 400, "not valid JSON", None),
    "duplicate-key": (b'{"model": "test/tiny-serve", "model": "test/tiny-serve", "prompt": "a"}', 400, "twice", None),
    "wrong-type": ({"model": MODEL_ID, "prompt": "a", "temperature": "warm"}, 400, "temperature must be a number",
                   "temperature"),
    "unknown-field": ({"model": MODEL_ID, "prompt": "a", "functions": []}, 400, "unknown field 'functions'",
                      "functions"),
    "negative-max-tokens": ({"model": MODEL_ID, "prompt": "a", "max_tokens": -1}, 400, "got -1", "max_tokens"),
    "huge-max-tokens": ({"model": MODEL_ID, "prompt": "a", "max_tokens": 10**12}, 400, "from 1 to", "max_tokens"),
    "max-tokens-over-context": ({"model": MODEL_ID, "prompt": "a", "max_tokens": MAX_CONTEXT}, 400,
                                f"more than the context of {MAX_CONTEXT}", None),
    "id-outside-vocab": ({"model": MODEL_ID, "prompt": [3, 512], "max_tokens": 2}, 400,
                         "token id 512 is outside this model's vocabulary of 512", None),
    "negative-id": ({"model": MODEL_ID, "prompt": [-3], "max_tokens": 2}, 400, "token id from 0", "prompt[0]"),
    "empty-prompt": ({"model": MODEL_ID, "prompt": "", "max_tokens": 2}, 400, "prompt is empty", "prompt"),
    "empty-id-list": ({"model": MODEL_ID, "prompt": [], "max_tokens": 2}, 400, "prompt is empty", "prompt"),
    "prompt-over-context": ({"model": MODEL_ID, "prompt": [5] * (MAX_CONTEXT + 1), "max_tokens": 1}, 400,
                            f"more than the context of {MAX_CONTEXT}", None),
    "text-prompt-over-context": ({"model": MODEL_ID, "prompt": "the river " * 200, "max_tokens": 1}, 400,
                                 f"more than the context of {MAX_CONTEXT}", None),
    "several-prompts": ({"model": MODEL_ID, "prompt": ["a", "b"]}, 400, "one prompt per request", "prompt"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_inputs(server, name):
    body, status, words, param = BAD[name]
    assert_error(post(server, body), status, words, param)


def test_chat_bad_inputs(server):
    assert_error(post(server, {"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      "/v1/chat/completions"), 400, "text only", "messages[0].content[0].type")
    late_system = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    assert_error(post(server, {"model": MODEL_ID, "messages": late_system, "max_tokens": 2}, "/v1/chat/completions"),
                 400, "chat template refused these messages: a system message must come first", "messages")


def test_a_10mb_body_is_refused_by_its_length(server):
    with socket.create_connection(server.address, timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10485760\r\n\r\n")
        reply = _read_response(s)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"more than the cap of 1048576" in reply


def test_a_10mb_chunked_body_is_refused_while_it_streams(server):
    sent = []

    def body():
        for _ in range(10):
            sent.append(1)
            yield b" " * (1 << 20)

    r = httpx.post(server.url + "/v1/completions", content=body(), headers={"content-type": "application/json"},
                   timeout=60)
    assert_error(r, 413, "more than the cap of 1048576 bytes")
    assert len(sent) < 10  # refused before the whole body was read


def test_slow_clients_time_out(server):
    with socket.create_connection(server.address, timeout=30) as s:  # a body that stalls
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50\r\n\r\n{\"model\":")
        reply = _read_response(s)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    with socket.create_connection(server.address, timeout=30) as s:  # headers that stall (slowloris)
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(4 * READ_TIMEOUT):
            time.sleep(0.5)
            try:
                s.sendall(b"X-a: b\r\n")  # a header line now and then never extends the deadline
            except OSError:
                break
        reply = _read_response(s)
        assert time.monotonic() - t0 < 4 * READ_TIMEOUT
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert httpx.get(server.url + "/health").status_code == 200  # and the server is fine


def _read_response(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return out
        if not data:
            return out
        out += data


def _metric(server, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(server.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_that_disconnects_mid_stream_is_cancelled(server, client):
    body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": MAX_CONTEXT - 10, "temperature": 0}
    # Greedy decoding of this prompt runs to max_tokens (no eos): a stream closed after its first chunk is
    # still running in the engine.
    assert client.completions.create(**body).choices[0].finish_reason == "length"
    before = _metric(server, "shardtool_requests_cancelled_total")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={**body, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 30
    while _metric(server, "shardtool_requests_cancelled_total") <= before:
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.05)


def test_chat_on_a_model_without_a_chat_template(built):
    # Its own rollback state: the same model ID and version with other bytes is refused (two manifests, one version).
    s = Server(built, built.plain, "--model-id", MODEL_ID, "--no-access-log", state="state-plain").wait_listening()
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert "no chat template" in str(info.value) and info.value.code == "no_chat_template"
        assert c.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        assert s.stop(signal.SIGINT) == 0  # Ctrl-C is a clean stop too
    assert s.stderr().rstrip().endswith("shardtool serve: stopped")
    assert "/v1/completions" not in s.stderr()  # --no-access-log


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA (PEM), and its key."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardtool test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_https_and_an_api_key_with_the_openai_client(built, tmp_path, monkeypatch):
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv("SHARDTOOL_API_KEY", "sk-e2e-secret")  # the server inherits it: not on its command line
    s = Server(built, built.model, "--model-id", MODEL_ID, "--ssl-certfile", cert, "--ssl-keyfile", key,
               state="state-tls").wait_listening()
    try:
        assert s.url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-e2e-secret", max_retries=0, timeout=60,
                              http_client=http)
            assert c.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=3).usage.completion_tokens >= 1
            chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=3)
            assert chat.choices[0].message.role == "assistant"
            wrong = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-e2e-wrong", max_retries=0, timeout=60,
                                  http_client=http)
            with pytest.raises(openai.AuthenticationError) as info:
                wrong.models.list()
            assert info.value.code == "invalid_api_key"
            assert http.get(s.url + "/health").json() == {"status": "ok"}
        # Not without the CA, and not in plain HTTP on the same port.
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=30)
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.url.replace("https://", "http://") + "/health", timeout=30)
    finally:
        assert s.stop() == 0, s.stderr()


@pytest.mark.parametrize("case, extra, words", [
    ("cert-without-key", ("--ssl-certfile", "cert.pem"), "go together"),
    ("not-a-certificate", ("--ssl-certfile", "a.pub", "--ssl-keyfile", "a.key"), "not a PEM certificate chain"),
    ("empty-api-key", ("--api-key", ""), "API key must be"),
    ("bad-allowed-host", ("--allowed-hosts", "http://x"), "is not a host name"),
])
def test_access_options_are_checked_before_anything_is_read(built, case, extra, words):
    s = Server(built, built.model, *extra)
    code = s.proc.wait(timeout=120)
    log = s.stderr()
    s.err.close()
    assert code == 2, log
    assert words in log and "serving" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("case", ["untrusted-key", "tampered-manifest", "budget-too-small", "bad-flag"])
def test_refuses_to_start(built, tmp_path, case):
    import shutil

    model = Path(shutil.copytree(built.model, tmp_path / "model"))
    extra: tuple = ()
    trust = "a.pub"
    if case == "untrusted-key":
        ok("keygen", "--out", tmp_path / "b", "--no-passphrase", cwd=built.work)
        trust = str(tmp_path / "b.pub")
        expected = 1
    elif case == "tampered-manifest":
        data = bytearray((model / "manifest.msgpack").read_bytes())
        data[len(data) // 2] ^= 0x01
        (model / "manifest.msgpack").write_bytes(bytes(data))
        expected = 1
    elif case == "budget-too-small":
        extra = ("--memory-budget", "2MiB")
        expected = 2
    else:
        extra = ("--kv-cache", "lots")
        expected = 2
    s = Server(built, model, *extra, trust=trust)
    code = s.proc.wait(timeout=120)
    log = s.stderr()
    s.err.close()
    assert code == expected, log
    assert "serving" not in log and "Traceback" not in log
    assert re.search(r"shardtool: (usage )?error: .*\[\w+Error\]$", log.strip().splitlines()[-1]), log


# ---------------------------------------------------------------------------------------------------------
# Scores through the official client, against transformers' log-softmax on the same checkpoint; conformance.

LOGPROB_TOL = 1e-4
SCORED_PROMPT = [5, 77, 300, 12, 9, 41, 250, 8]


@pytest.fixture(scope="module")
def oracle(built):
    """ids -> [T, V] float64 log-softmax of transformers' float32 logits for the signed model's checkpoint."""
    torch = pytest.importorskip("torch", reason="the scores' oracle needs torch (pip install -e '.[oracle]')")
    transformers = pytest.importorskip("transformers", reason="the scores' oracle needs transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(built.work / "model-hf", attn_implementation="eager",
                                                              dtype=torch.float32).eval()

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0].double(), dim=-1).numpy()
    return logprobs


@pytest.fixture(scope="module")
def token_text(built):
    """Token id -> the name a response gives it (its names: tests/serve/test_scores.py)."""
    from tokenizers import Tokenizer

    from shardtool.serve._scores import TokenText

    text = TokenText(Tokenizer.from_file(str(built.model / "tokenizer.json")))
    return lambda t: text(int(t))


def _greedy(oracle, prompt, n):
    """transformers' greedy continuation of `prompt` by n tokens, and the log-softmax rows of prompt + it."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(oracle(ids)[-1].argmax()))
    return ids[len(prompt):], oracle(ids)


def _assert_completion_scores(logprobs, ids, expected, token_text, top, *, first_unscored):
    """A completions `logprobs` object for `ids` against the oracle's rows (row i - 1 predicts ids[i])."""
    import numpy as np

    assert logprobs.tokens == [token_text(t) for t in ids]
    for i, t in enumerate(ids):
        if i == 0 and first_unscored:
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            continue
        row = expected[i - 1]
        assert abs(logprobs.token_logprobs[i] - row[t]) <= LOGPROB_TOL, (i, logprobs.token_logprobs[i], row[t])
        best = [int(b) for b in np.argsort(-row, kind="stable")[:top]]
        shown = logprobs.top_logprobs[i]
        assert set(shown) == {token_text(b) for b in best} | {token_text(t)}
        for b in best + [t]:
            assert abs(shown[token_text(b)] - row[b]) <= LOGPROB_TOL


def test_echo_with_max_tokens_zero_scores_the_prompt_as_transformers_does(client, oracle, token_text):
    """The request an evaluation harness sends to score a text: token ids, echo, max_tokens 0, logprobs."""
    r = client.completions.create(model=MODEL_ID, prompt=SCORED_PROMPT, max_tokens=0, echo=True, logprobs=5,
                                  temperature=0)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    _assert_completion_scores(r.choices[0].logprobs, SCORED_PROMPT, oracle(SCORED_PROMPT), token_text, 5,
                              first_unscored=True)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_tokens_and_the_echoed_prompt_are_scored_as_transformers_does(client, oracle, token_text, stream):
    new, expected = _greedy(oracle, SCORED_PROMPT, 6)
    r = client.completions.create(model=MODEL_ID, prompt=SCORED_PROMPT, max_tokens=6, echo=True, logprobs=3,
                                  temperature=0, stream=stream)
    if stream:
        parts = [c.choices[0].logprobs for c in r if c.choices and c.choices[0].logprobs is not None]
        logprobs = SimpleNamespace(**{key: [x for p in parts for x in getattr(p, key)] for key in
                                      ("tokens", "token_logprobs", "top_logprobs", "text_offset")})
    else:
        logprobs = r.choices[0].logprobs
    _assert_completion_scores(logprobs, SCORED_PROMPT + new, expected, token_text, 3, first_unscored=True)


def test_sampled_tokens_are_scored_before_temperature(client, oracle, token_text):
    """Scores are the model's own distribution (as vLLM's default), not the temperature-scaled one sampled from."""
    r = client.completions.create(model=MODEL_ID, prompt=SCORED_PROMPT, max_tokens=5, logprobs=2, temperature=1.7,
                                  top_p=0.8, seed=5)
    logprobs = r.choices[0].logprobs
    by_text = {}
    for t in range(len(oracle(SCORED_PROMPT)[0])):
        by_text.setdefault(token_text(t), t)
    ids = SCORED_PROMPT + [by_text[text] for text in logprobs.tokens]
    expected = oracle(ids)
    for i, t in enumerate(ids[len(SCORED_PROMPT):]):
        assert abs(logprobs.token_logprobs[i] - expected[len(SCORED_PROMPT) + i - 1][t]) <= LOGPROB_TOL


def test_chat_logprobs_as_transformers_does(built, client, oracle, token_text):
    import numpy as np
    from tokenizers import Tokenizer

    from shardtool.serve import ChatTemplate

    messages = [{"role": "user", "content": "Where is the mill?"}]
    config = json.loads((built.model / "tokenizer_config.json").read_text())
    prompt = ChatTemplate.from_tokenizer_config(config).prompt_ids(
        Tokenizer.from_file(str(built.model / "tokenizer.json")), messages)
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    new, expected = _greedy(oracle, prompt, len(content))
    for i, (entry, t) in enumerate(zip(content, new)):
        row = expected[len(prompt) + i - 1]
        assert entry.token == token_text(t)
        assert abs(entry.logprob - row[t]) <= LOGPROB_TOL
        best = [int(b) for b in np.argsort(-row, kind="stable")[:4]]
        assert [a.token for a in entry.top_logprobs] == [token_text(b) for b in best]
        assert all(abs(a.logprob - row[b]) <= LOGPROB_TOL for a, b in zip(entry.top_logprobs, best))


def test_openai_conformance(server, client):
    """client.models.retrieve, response_format text, context_length_exceeded, the access log, no *_created."""
    model = client.models.retrieve(MODEL_ID)
    assert model.id == MODEL_ID and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("acme/other")
    assert info.value.code == "model_not_found"
    answer = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, response_format={"type": "text"})
    assert answer.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       response_format={"type": "json_object"})
    assert info.value.param == "response_format.type"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt=[5] * (MAX_CONTEXT + 1), max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # a scored prompt is bounded by the context too
        client.completions.create(model=MODEL_ID, prompt=[5] * (MAX_CONTEXT + 1), max_tokens=0, echo=True, logprobs=1)
    assert info.value.code == "context_length_exceeded"
    whole = client.completions.create(model=MODEL_ID, prompt=[5] * MAX_CONTEXT, max_tokens=0, echo=True, logprobs=1)
    assert len(whole.choices[0].logprobs.token_logprobs) == MAX_CONTEXT
    assert "_created" not in httpx.get(server.url + "/metrics").text
    log = server.stderr()
    assert re.search(r'^127\.0\.0\.1:\d+ "GET /v1/models/test/tiny-serve" 200 \d+\.\d{3}s$', log, re.M), log
    assert re.search(r'^127\.0\.0\.1:\d+ "POST /v1/completions" 400 \d+\.\d{3}s$', log, re.M), log
