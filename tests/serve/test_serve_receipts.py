"""`shardtool serve --receipt-key`: the real server process (own session, ended by its process group) driven by
the official `openai` client; every receipt it returns is checked by the real `shardtool verify-receipt` CLI
(a subprocess): plain, chat, streamed, 8 concurrent requests, fetched by id with its routing trace, the wrong
operator key, the LRU store, a stop string, and refusals to start."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from test_serve_e2e import MODEL_ID, Server, cli, ok, built  # noqa: F401  (the module fixture, reused)

FORMAT = "shardtool-receipt/1"


@pytest.fixture(scope="module")
def keys(built) -> Path:  # noqa: F811
    for name in ("op", "stranger"):
        ok("keygen", "--out", name, "--no-passphrase", cwd=built.work)
    return built.work


@pytest.fixture(scope="module")
def rserver(built, keys):  # noqa: F811
    s = Server(built, built.model, "--model-id", MODEL_ID, "--receipt-key", keys / "op.key").wait_listening()
    yield s
    assert s.stop() == 0, s.stderr()


@pytest.fixture(scope="module")
def client(rserver) -> openai.OpenAI:
    return openai.OpenAI(base_url=rserver.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_receipt(obj) -> bytes:
    """The receipt object's shape; its receipt file bytes."""
    assert set(obj) == {"id", "format", "data", "trace_url"}, obj
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,64}", obj["id"]) and obj["format"] == FORMAT
    assert obj["trace_url"] == f"/v1/receipts/{obj['id']}/trace"
    return base64.b64decode(obj["data"], validate=True)


def verify(built, data: bytes, *extra, operator: str = "op.pub", trace: bytes | None = None,  # noqa: F811
           name: str = "r") -> subprocess.CompletedProcess:
    (built.work / f"{name}.receipt").write_bytes(data)
    args = ["verify-receipt", f"{name}.receipt", built.model, "--operator", operator, "--trust", "a.pub",
            "--model-id", MODEL_ID, "--state-dir", built.work / "state", "--memory-budget", "256MiB", *extra]
    if trace is not None:
        (built.work / f"{name}.trace").write_bytes(trace)
        args += ["--trace", f"{name}.trace"]
    return cli(*args, cwd=built.work)


def valid(built, data: bytes, extra: tuple = (), **kw) -> dict:  # noqa: F811
    r = verify(built, data, "--json", *extra, **kw)
    assert r.returncode == 0, r.stdout + r.stderr
    verdict = json.loads(r.stdout)
    assert verdict["valid"] is True
    return verdict


def completion(client, **kw) -> dict:
    raw = client.completions.with_raw_response.create(model=MODEL_ID, **kw)
    return raw.http_response.json()


# ---------------------------------------------------------------------------------------------------------


def test_a_completion_carries_a_receipt_that_verifies(built, client):  # noqa: F811
    prompt = [5, 17, 42, 8, 99]
    doc = completion(client, prompt=prompt, max_tokens=12, temperature=0.7, top_p=0.9, seed=1234)
    verdict = valid(built, check_receipt(doc["receipt"]))
    assert verdict["receipt_id"] == doc["receipt"]["id"]
    assert verdict["prompt_ids"] == prompt and len(verdict["token_ids"]) == doc["usage"]["completion_tokens"]
    eos = json.loads((built.model / "config.json").read_text())["eos_token_id"]  # what the server stops at
    assert verdict["request"] == {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 1234,
                                  "stop_token_ids": sorted(eos if isinstance(eos, list) else [eos])}
    assert verdict["finish_reason"] == doc["choices"][0]["finish_reason"]
    # The parsed object keeps the field too (the openai client's models allow extra fields).
    parsed = client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=4, temperature=0)
    assert parsed.model_extra["receipt"]["format"] == FORMAT


def test_an_ignore_eos_receipt_verifies_as_what_it_was(built, client):  # noqa: F811
    """ignore_eos runs with no stop token: the receipt records that, and verify-receipt replays it when told the
    request asked for it (--ignore-eos), not when it holds the answer to the model's EOS ids."""
    doc = completion(client, prompt=[5, 17, 42], max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert doc["usage"]["completion_tokens"] == 10 and doc["choices"][0]["finish_reason"] == "length"
    data = check_receipt(doc["receipt"])
    verdict = valid(built, data, extra=("--ignore-eos",))
    assert verdict["request"]["stop_token_ids"] == [] and verdict["finish_reason"] == "length"
    r = verify(built, data)  # by default the stop list must be the signed config's EOS ids
    assert r.returncode == 1 and "the receipt stops at token ids []" in r.stderr, r.stderr
    r = verify(built, data, "--ignore-eos", "--stop-ids", "1")
    assert r.returncode == 2 and "not both" in r.stderr, r.stderr
    # Chat too: the engine ran it with no stop token, which its receipt shows.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    chat = valid(built, check_receipt(raw.http_response.json()["receipt"]), extra=("--ignore-eos",), name="chat")
    assert chat["request"]["stop_token_ids"] == [] and len(chat["token_ids"]) == 6


def test_a_receipt_signed_by_another_operator_is_refused(built, client):  # noqa: F811
    doc = completion(client, prompt="Hi", max_tokens=6, temperature=0)
    r = verify(built, check_receipt(doc["receipt"]), operator="stranger.pub")
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and r.stdout == ""


def test_a_chat_completion_carries_a_receipt_that_verifies(built, client):  # noqa: F811
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Hello there"}], max_tokens=10, temperature=0)
    doc = raw.http_response.json()
    verdict = valid(built, check_receipt(doc["receipt"]))
    assert len(verdict["token_ids"]) == doc["usage"]["completion_tokens"]
    assert verdict["request"]["temperature"] == 0.0


def test_a_stream_carries_the_receipt_on_its_finish_chunk(built, client):  # noqa: F811
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=9, temperature=0.8, seed=5, stream=True,
                                                 stream_options={"include_usage": True}))
    with_receipt = [c for c in chunks if (c.model_extra or {}).get("receipt") is not None]
    assert len(with_receipt) == 1
    last = with_receipt[0]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason] == [last]
    verdict = valid(built, check_receipt(last.model_extra["receipt"]))
    assert verdict["request"]["seed"] == 5 and len(verdict["token_ids"]) == chunks[-1].usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=9, temperature=0.8, seed=5)
    assert whole.choices[0].message.content == text


def test_eight_concurrent_requests_each_get_a_receipt_that_verifies(built, client):  # noqa: F811
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(2 + i)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        docs = list(pool.map(lambda p: completion(client, prompt=p, max_tokens=6 + p[0] % 5, temperature=0.5),
                             prompts))
    log = built.work / "log"
    log.mkdir()
    for i, doc in enumerate(docs):
        (log / f"{i}.receipt").write_bytes(check_receipt(doc["receipt"]))
    assert len({d["receipt"]["id"] for d in docs}) == 8
    r = cli("verify-receipt", log, built.model, "--operator", "op.pub", "--trust", "a.pub", "--model-id", MODEL_ID,
            "--state-dir", built.work / "state", "--memory-budget", "256MiB", "--sample", "1", "--json",
            cwd=built.work)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert summary["sampled"] == 8 and summary["valid"] == 8 and summary["invalid"] == []
    by_file = {v["file"]: v for v in summary["results"]}
    for i, prompt in enumerate(prompts):  # each receipt is its own request's
        assert by_file[f"{i}.receipt"]["prompt_ids"] == prompt
        assert len(by_file[f"{i}.receipt"]["token_ids"]) == docs[i]["usage"]["completion_tokens"]


def test_get_by_id_and_the_trace_round_trip(built, rserver, client):  # noqa: F811
    doc = completion(client, prompt="The miller said", max_tokens=8, temperature=0)
    obj = doc["receipt"]
    got = httpx.get(f"{rserver.url}/v1/receipts/{obj['id']}")
    assert got.status_code == 200 and got.headers["content-type"] == "application/octet-stream"
    assert got.content == check_receipt(obj)
    trace = httpx.get(rserver.url + obj["trace_url"])
    assert trace.status_code == 200 and trace.headers["content-type"] == "application/octet-stream"
    r = verify(built, got.content, "--json", trace=trace.content, name="fetched")
    assert r.returncode == 0 and json.loads(r.stdout)["valid"], r.stdout + r.stderr
    # The trace of another receipt is refused: its root is not the signed one.
    other = completion(client, prompt="Hi", max_tokens=8, temperature=0)["receipt"]
    wrong = httpx.get(rserver.url + other["trace_url"]).content
    assert verify(built, got.content, trace=wrong, name="mixed").returncode == 1


@pytest.mark.parametrize("rid", ["rcpt-000000000000000000000000", "x" * 65, "bad$id", "%20", "...", "a.b", "%C3%A9"])
def test_unknown_or_malformed_ids_are_404_json(rserver, rid):
    for suffix in ("", "/trace"):
        r = httpx.get(f"{rserver.url}/v1/receipts/{rid}{suffix}")
        assert r.status_code == 404 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "receipt_not_found", r.text
        assert "Traceback" not in r.text


def test_a_stop_string_gives_no_receipt_and_says_why(client):
    whole = completion(client, prompt="Hi", max_tokens=40, temperature=0)
    text = whole["choices"][0]["text"]
    stop = text[10:13]
    assert len(stop) == 3
    cut = completion(client, prompt="Hi", max_tokens=40, temperature=0, stop=[stop])
    assert cut["choices"][0]["text"] == text[:text.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    assert cut["receipt"] is None and cut["receipt_unavailable"]["reason"] == "stop_string"
    assert "stop string" in cut["receipt_unavailable"]["message"]


def test_a_scored_answer_carries_a_receipt_and_a_scored_prompt_says_why_it_has_none(built, client):  # noqa: F811
    """Scores come from the same verified weights: an answer with logprobs and echo is signed as any other (its
    tokens; the scores are not signed); max_tokens 0 generated no token, so no receipt, with the reason."""
    prompt = [5, 17, 42, 8, 99]
    doc = completion(client, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True)
    assert len(doc["choices"][0]["logprobs"]["token_logprobs"]) == len(prompt) + doc["usage"]["completion_tokens"]
    verdict = valid(built, check_receipt(doc["receipt"]))
    assert verdict["prompt_ids"] == prompt and len(verdict["token_ids"]) == doc["usage"]["completion_tokens"]
    scored = completion(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == len(prompt)
    assert scored["receipt"] is None and scored["receipt_unavailable"]["reason"] == "no_new_tokens"


def test_metrics_count_receipts(rserver, client):
    def metric(name: str) -> float:
        text = httpx.get(rserver.url + "/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    before = metric("shardtool_receipts_signed_total")
    completion(client, prompt="Hi", max_tokens=2, temperature=0)
    assert metric("shardtool_receipts_signed_total") == before + 1
    assert metric("shardtool_receipts_stored") >= 1 and metric("shardtool_receipts_evicted_total") == 0


def test_the_store_evicts_the_oldest_past_max_receipts(built, keys):  # noqa: F811
    s = Server(built, built.model, "--model-id", MODEL_ID, "--receipt-key", keys / "op.key", "--max-receipts", "2",
               state="state-lru").wait_listening()
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ids = [completion(c, prompt=[3 + i, 4], max_tokens=2, temperature=0)["receipt"]["id"] for i in range(3)]
        codes = [httpx.get(f"{s.url}/v1/receipts/{i}").status_code for i in ids]
        assert codes == [404, 200, 200]
        assert "evicted" in httpx.get(f"{s.url}/v1/receipts/{ids[0]}").json()["error"]["message"]
        text = httpx.get(s.url + "/metrics").text
        assert re.search(r"^shardtool_receipts_evicted_total 1\.0$", text, re.M), text
        assert re.search(r"^shardtool_receipts_stored 2\.0$", text, re.M), text
    finally:
        assert s.stop() == 0, s.stderr()


def test_without_a_key_receipts_are_off(built):  # noqa: F811
    s = Server(built, built.model, "--model-id", MODEL_ID, state="state-off").wait_listening()
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert "receipt" not in completion(c, prompt="Hi", max_tokens=2, temperature=0)
        r = httpx.get(f"{s.url}/v1/receipts/rcpt-1")
        assert r.status_code == 404 and r.json()["error"]["code"] == "receipts_disabled"
        assert "--receipt-key" in r.json()["error"]["message"]
    finally:
        assert s.stop() == 0, s.stderr()


@pytest.mark.parametrize("case", ["missing-key", "not-a-key", "wrong-passphrase", "no-passphrase",
                                  "passphrase-without-key"])
def test_a_bad_receipt_key_refuses_to_start(built, keys, tmp_path, case):  # noqa: F811
    extra: tuple = ("--receipt-key", tmp_path / "nope.key")
    expected = (2, 3)
    if case == "not-a-key":
        (tmp_path / "garbage.key").write_bytes(b"not a key\n")
        (tmp_path / "garbage.key").chmod(0o600)
        extra = ("--receipt-key", tmp_path / "garbage.key")
        expected = (2,)
    elif case in ("wrong-passphrase", "no-passphrase"):
        for name, secret in (("right", "correct horse battery staple"), ("wrong", "incorrect horse battery")):
            (tmp_path / name).write_text(secret + "\n")
            (tmp_path / name).chmod(0o600)
        ok("keygen", "--out", tmp_path / "locked", "--passphrase-file", tmp_path / "right", cwd=built.work)
        extra = ("--receipt-key", tmp_path / "locked.key", "--receipt-passphrase-file", tmp_path / "wrong")
        if case == "no-passphrase":  # no terminal to ask on: the hint names this command's option
            extra, expected = ("--receipt-key", tmp_path / "locked.key"), (2,)
    elif case == "passphrase-without-key":
        extra = ("--receipt-passphrase-file", tmp_path / "nope")
        expected = (2,)
    s = Server(built, built.model, "--model-id", MODEL_ID, *extra, state=f"state-{case}")
    code = s.proc.wait(timeout=120)
    log = s.stderr()
    s.err.close()
    assert code in expected, (code, log)
    assert log.count("\n") == 1 and "serving" not in log and "Traceback" not in log, log
    assert re.search(r"^shardtool: (usage )?error: .*\[\w+Error\]$", log.strip()), log
    if case == "no-passphrase":
        assert "--receipt-passphrase-file" in log and "keygen" not in log, log


def test_the_store_is_least_recently_used_first_out():
    from shardtool.runtime import SignedReceipt
    from shardtool.serve._receipts import ReceiptStore

    store = ReceiptStore(2)
    a, b, c = (SignedReceipt(name, name.encode(), b"") for name in "abc")
    store.put(a)
    store.put(b)
    assert store.get("a") is a  # a fetch makes it the most recently used: b goes first
    store.put(c)
    assert store.get("b") is None and store.get("a") is a and store.get("c") is c
    assert store.metrics() == {"receipts_signed_total": 3, "receipts_evicted_total": 1,
                               "receipts_unavailable_total": 0, "receipts_stored": 2, "receipts_stored_bytes": 2}
    with pytest.raises(ValueError):
        ReceiptStore(0)


def test_the_store_keeps_to_its_byte_cap():
    from shardtool.runtime import SignedReceipt
    from shardtool.serve._receipts import ReceiptStore

    store = ReceiptStore(100, max_bytes=10)
    for name in "abcd":  # 4 bytes each (receipt 1 + trace 3): two fit
        store.put(SignedReceipt(name, name.encode(), b"xyz"))
    assert [n for n in "abcd" if store.get(n) is not None] == ["c", "d"] and store.bytes == 8
    store.put(SignedReceipt("big", b"b" * 50, b""))  # alone over the cap: kept (its response names it)
    assert store.get("big") is not None and store.get("c") is None and store.get("d") is None
    assert store.metrics()["receipts_evicted_total"] == 4
