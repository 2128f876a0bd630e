"""Attacks on `shardtool serve`: the installed server process on the attack suite's signed model, driven by raw
HTTP as a hostile web page, a hostile request or a hostile (but signed) chat template would drive it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import _attackkit as kit
from conftest import MODEL_ID

SERVE_FLAGS = ("--memory-budget", "256MiB", "--max-context", "64", "--readers", "1", "--max-batch", "2")
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
EXPERTS = [f"experts/layer-{layer:03d}/expert-{e:04d}.safetensors" for layer in range(2) for e in range(2)]
CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_ID, "prompt": "hello", "max_tokens": 2}


class Serve:
    """`shardtool serve MODEL` in its own session (ended by its process group's id)."""

    def __init__(self, world, model: Path, *extra: str, env: dict | None = None):
        self.log = world.tmp / f"serve-{time.monotonic_ns()}.log"
        self.err = open(self.log, "w+")
        self.proc = subprocess.Popen(
            [str(kit.BIN / "shardtool"), "serve", str(model), "--trust", str(world.keys.pub("A")), "--state-dir",
             str(world.tmp / "state"), "--model-id", MODEL_ID, "--port", "0", *SERVE_FLAGS, *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.err, cwd=world.tmp,
            env={**kit.env_for(world.tmp / "xdg"), **(env or {})}, start_new_session=True)
        self.url = None

    def __enter__(self) -> "Serve":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def listening(self, seconds: float = 120) -> "Serve":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m = re.search(r"serving \S+ on (http://127\.0\.0\.1:(\d+))", self.stderr())
            if m:
                self.url, self.port = m.group(1), int(m.group(2))
                return self
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}:\n{self.stderr()}"
            time.sleep(0.05)
        raise AssertionError(f"serve did not listen within {seconds}s:\n{self.stderr()}")

    def exited(self, seconds: float = 120) -> int:
        return self.proc.wait(timeout=seconds)

    def stderr(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.err.close()

    def post(self, path: str, body, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=data, timeout=timeout,
                          headers={"content-type": "application/json", **(headers or {})})


def assert_error(r: httpx.Response, status: int, words: str, param=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    assert "Traceback" not in r.text and "a bug in shardtool" not in r.text
    return error


# ---------------------------------------------------------------------------------------------------------
# A web page's requests (DNS rebinding, no-preflight "simple" requests)


def test_attack_serve_dns_rebinding_page_is_refused(world, model):
    """A page on rebind.attacker.example, its name now resolving to 127.0.0.1, posts with no Content-Type (no
    CORS preflight): it reached the model, and its answers, receipts and /metrics were readable."""
    with Serve(world, model).listening() as s:
        rebound = {"host": f"rebind.attacker.example:{s.port}", "origin": "http://rebind.attacker.example"}
        for r in (s.post("/v1/completions", json.dumps(COMPLETION).encode(), {**rebound, "content-type": ""}),
                  httpx.get(s.url + "/metrics", headers=rebound, timeout=30),
                  httpx.get(s.url + "/v1/models", headers=rebound, timeout=30)):
            assert_error(r, 400, "is not one this server answers to")
            assert not [h for h in r.headers if h.lower().startswith("access-control-")]
        # The same simple request from a page on the right name: a JSON body must say so.
        for kind in ("", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = s.post("/v1/completions", json.dumps(COMPLETION).encode(), {"content-type": kind,
                                                                            "origin": "http://evil.example"})
            assert_error(r, 415, "must be JSON")
            assert not [h for h in r.headers if h.lower().startswith("access-control-")]
        assert s.post("/v1/completions", COMPLETION).status_code == 200


def test_attack_serve_api_key_from_the_environment(world, model):
    """--api-key from SHARDTOOL_API_KEY: not in the process's argv (ps), and every route but /health needs it."""
    key = "sk-attack-suite-7f3a9c"
    with Serve(world, model, env={"SHARDTOOL_API_KEY": key}).listening() as s:
        assert key.encode() not in Path(f"/proc/{s.proc.pid}/cmdline").read_bytes()
        assert_error(s.post("/v1/completions", COMPLETION), 401, "needs an API key")
        assert_error(s.post("/v1/completions", COMPLETION, {"authorization": "Bearer sk-attack-suite-7f3a9"}), 401,
                     "needs an API key")
        assert_error(httpx.get(s.url + "/metrics", timeout=30), 401, "needs an API key")
        assert httpx.get(s.url + "/health", timeout=30).json() == {"status": "ok"}
        assert s.post("/v1/completions", COMPLETION, {"authorization": f"Bearer {key}"}).status_code == 200


# ---------------------------------------------------------------------------------------------------------
# A lone surrogate (valid JSON) in any string field


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "%s", "prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "stop": ["\\udfff"], "max_tokens": 2}', "stop[0]"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "a"}], "user": "\\ud800"}',
     "user"),
], ids=["prompt", "stop", "chat-content", "user"])
def test_attack_serve_lone_surrogate_is_a_400(world, model, path, body, param):
    with Serve(world, model).listening() as s:
        assert_error(s.post(path, body % MODEL_ID.encode()), 400, "lone UTF-16 surrogate", param=param)
        assert "Traceback" not in s.stderr()


# ---------------------------------------------------------------------------------------------------------
# A signed chat template that spins


def test_attack_serve_spinning_chat_template(world, model):
    """Two nested range(100000) loops in a (validly signed) template: the first chat request never answered,
    and 41 of them exhausted the worker threads, so completions hung too."""
    def spin(path: Path) -> None:
        config = json.loads(path.read_text())
        config["chat_template"] = SPIN
        path.write_text(json.dumps(config))

    kit.publish_rewritten(model, "tokenizer_config.json", spin, world.keys.signer("A"))
    with Serve(world, model).listening() as s, ThreadPoolExecutor(max_workers=8) as pool:
        chats = [pool.submit(s.post, "/v1/chat/completions", CHAT) for _ in range(6)]
        time.sleep(1.0)
        started = time.monotonic()
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        assert s.post("/v1/completions", COMPLETION).status_code == 200
        assert time.monotonic() - started < 5, "completions waited behind the template"
        for chat in chats:
            assert_error(chat.result(timeout=120), 500, "exceeded its render limit")


# ---------------------------------------------------------------------------------------------------------
# Tampered weights


def test_attack_serve_verify_all_first_refuses_tampered_experts(world, model):
    for rel in EXPERTS:
        kit.flip(model / rel)
    s = Serve(world, model, "--verify-all-first")
    try:
        code = s.exited()
        err = s.stderr()
    finally:
        s.stop()
    assert code == 1, err
    assert "serving" not in err and "Traceback" not in err
    assert "DigestMismatchError" in err and "experts/layer-000/expert-0000.safetensors" in err, err


def test_attack_serve_health_reports_tampered_experts(world, model):
    """Without --verify-all-first it starts (the experts are checked when first used); once a request has
    found them bad, /health says degraded with a 503, naming them, instead of "ok"."""
    for rel in EXPERTS:
        kit.flip(model / rel)
    with Serve(world, model).listening() as s:
        assert httpx.get(s.url + "/health", timeout=30).json() == {"status": "ok"}
        assert s.post("/v1/completions", COMPLETION).status_code == 500
        r = httpx.get(s.url + "/health", timeout=30)
        assert r.status_code == 503, r.text
        doc = r.json()
        assert doc["status"] == "degraded" and doc["bad_files"] >= 1
        assert set(doc["files"]) <= set(EXPERTS) and doc["files"], doc


def test_attack_serve_chat_template_worker_gets_no_secrets(monkeypatch):
    """A render worker runs the signed template's code path; it is started without shardtool's secrets (the API
    key, a passphrase), which the server's own environment may hold."""
    from shardtool.serve._chat import ChatTemplate
    from shardtool.serve._render import RenderPool

    monkeypatch.setenv("SHARDTOOL_API_KEY", "key-that-must-not-leak")
    monkeypatch.setenv("SHARDTOOL_PASSPHRASE", "passphrase-that-must-not-leak")
    pool = RenderPool(ChatTemplate("{{ messages[0]['content'] }}", {}), workers=1)
    try:
        pool.warm()
        (worker,) = list(pool._all)
        environ = Path(f"/proc/{worker.proc.pid}/environ").read_bytes()
        assert b"must-not-leak" not in environ and b"SHARDTOOL_" not in environ
        assert b"PATH=" in environ  # the rest of the environment is kept
    finally:
        pool.close()
