"""Serving under load on an emulated small machine: an OpenAI-compatible server runs inside the machine
(`_machine.started`), N concurrent clients outside it send the same greedy /v1/completions request (the prompt as
token ids, temperature 0) through the official `openai` client, and each window of requests is measured from both
sides: aggregate tokens/s and latency at the clients, device bytes read by the machine's cgroup, expert bytes read
from the server's Prometheus /metrics where it exports them (`shardtool serve` does; llama.cpp's `llama-server`
does not, so the figure is None there and nothing else changes). The same client loop (`run_clients`, one request
each through `ask`) also runs against a server started elsewhere (bench_serve.py), and can ask
/v1/chat/completions and stream: a streamed window carries each request's time to first token and the gaps between
its chunks (`stream_latencies`), summed up as p50/p99 by `stream_summary`.

    rows = measure_serving(argv, machine, data_dir, model="acme/moe", prompt=[5, 17, 300], max_tokens=32,
                           log=work / "serve.log")
"""

from __future__ import annotations

import math
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__:  # imported as benchmarks._serve_load (the tests)
    from ._machine import Machine, Started, started
else:  # a bench script run from benchmarks/
    from _machine import Machine, Started, started

# What `shardtool serve --port 0` prints once its socket listens; llama-server's own line is "server is listening
# on http://HOST:PORT" (pass `url=` when you chose its port).
SHARDTOOL_URL = r"serving \S+ on (https?://\S+)"
EXPERT_BYTES = "shardtool_expert_bytes_read_total"  # routed-expert shard bytes the engine read (a counter)


@dataclass(frozen=True)
class Load:
    """One window: `clients` requests sent at once (one each), what came back, and how long it took. Streamed, also
    each request's time to first token and the gaps between the chunks that carried text (`stream_latencies`)."""
    clients: int
    seconds: float  # from the barrier that released all clients to the last answer
    tokens: int  # completion tokens, as each response's usage counts them
    latencies: tuple[float, ...]  # per request, seconds
    texts: tuple[str, ...]  # per answered request
    token_ids: tuple[tuple[int, ...], ...] | None  # per answered request, when the server returns them
    errors: tuple[str, ...]  # one line per failed request
    ttfts: tuple[float, ...] = ()  # streamed: per answered request, seconds to its first chunk carrying text
    itls: tuple[float, ...] = ()  # streamed: every gap between two chunks carrying text, all requests, seconds
    chunks: int = 0  # streamed: chunks that carried text, all requests
    tpots: tuple[float, ...] = ()  # streamed: per request with > 1 token, (seconds - TTFT) / (tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def agree(self, reference: str | Sequence[int] | None = None) -> bool:
        """Every request answered, all alike, and like `reference` (text, or token ids when the server gave ids)."""
        outputs = [tuple(ids) for ids in self.token_ids] if self.token_ids is not None else list(self.texts)
        if self.errors or not outputs or any(o != outputs[0] for o in outputs):
            return False
        if reference is None:
            return True
        return outputs[0] == (reference if isinstance(reference, str) else tuple(reference))


@dataclass(frozen=True)
class Answer:
    """One request's answer as its client saw it."""
    seconds: float  # from sending the request to the last byte of the answer
    tokens: int  # completion tokens, as the usage counts them
    text: str
    ids: tuple[int, ...] | None  # the generated token ids, when asked for (`tokens_field`) and given
    sent: float  # time.perf_counter() when the request was sent
    arrivals: tuple[float, ...] = ()  # streamed: time.perf_counter() at each chunk that carried text


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): the smallest sample with at least q % of the samples at or below it;
    NaN for no samples."""
    s = sorted(xs)
    return s[min(len(s), max(1, math.ceil(q * len(s) / 100))) - 1] if s else float("nan")


def stream_latencies(sent: float, arrivals: Sequence[float]) -> tuple[float, tuple[float, ...]]:
    """A streamed answer's time to first token (the first chunk carrying text) and its inter-token latencies: the
    gaps between consecutive chunks carrying text. A chunk that carries k tokens (a character split across tokens
    is sent whole) has its gap counted once, not k times; `Load.chunks` against `Load.tokens` shows how often."""
    if not arrivals:
        raise ValueError("a stream with no chunk carrying text has no time to first token")
    times = (sent, *arrivals)
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"chunk arrivals must not precede the request or each other, got {sent} then {arrivals}")
    return arrivals[0] - sent, tuple(b - a for a, b in zip(arrivals, arrivals[1:]))


def time_per_output_token(seconds: float, ttft: float, tokens: int) -> float | None:
    """A streamed request's mean seconds per token after its first (TPOT: its answer's time after the first chunk
    over its other tokens), per token whatever the chunking; None for an answer of one token."""
    return (seconds - ttft) / (tokens - 1) if tokens > 1 else None


def stream_summary(loads: Sequence[Load]) -> dict[str, float]:
    """TTFT, inter-token latency and TPOT p50/p99 (seconds) over every request of streamed windows, pooled, and the
    completion tokens per chunk carrying text (1.0: one chunk per token)."""
    ttfts = [t for w in loads for t in w.ttfts]
    itls = [g for w in loads for g in w.itls]
    tpots = [t for w in loads for t in w.tpots]
    chunks = sum(w.chunks for w in loads)
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99),
            "tokens_per_chunk": sum(w.tokens for w in loads) / chunks if chunks else float("nan")}


def ask(client, model: str, prompt: Sequence[int] | Sequence[dict], max_tokens: int, *, chat: bool = False,
        stream: bool = False, extra_body: dict | None = None, tokens_field: str | None = None) -> Answer:
    """One greedy request through the `openai` client: /v1/completions with `prompt` (token ids), or with `chat`
    /v1/chat/completions with `prompt` as its messages; `stream` asks for server-sent events with the usage at
    the end. Raises openai.OpenAIError, or RuntimeError for a stream that ends without its usage."""
    asked = dict(model=model, max_tokens=max_tokens, temperature=0, extra_body=extra_body)
    create = client.chat.completions.create if chat else client.completions.create
    asked |= {"messages": list(prompt)} if chat else {"prompt": list(prompt)}
    sent = time.perf_counter()
    if not stream:
        r = create(**asked)
        choice = r.choices[0]
        ids = None
        if tokens_field is not None:
            ids = (choice.model_extra or {}).get(tokens_field, (r.model_extra or {}).get(tokens_field))
            ids = tuple(int(x) for x in ids) if ids is not None else None
        return Answer(time.perf_counter() - sent, r.usage.completion_tokens if r.usage else 0,
                      (choice.message.content or "") if chat else choice.text, ids, sent)
    arrivals, pieces, used = [], [], None
    for chunk in create(**asked, stream=True, stream_options={"include_usage": True}):
        now = time.perf_counter()
        if chunk.choices:
            piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            if piece:
                arrivals.append(now)
                pieces.append(piece)
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    if used is None:
        raise RuntimeError("the stream ended without its usage")
    return Answer(time.perf_counter() - sent, used, "".join(pieces), None, sent, tuple(arrivals))


def run_clients(base_url: str, model: str, prompt: Sequence[int] | Sequence[dict], max_tokens: int, clients: int, *,
                api_key: str = "unused", timeout: float = 600, extra_body: dict | None = None,
                tokens_field: str | None = None, chat: bool = False, stream: bool = False) -> Load:
    """`clients` threads, released together, each sending one greedy request (`ask`): POST {base_url}/v1/completions
    with `prompt` as token ids, or with `chat` /v1/chat/completions with `prompt` as the messages.

    `extra_body`: fields a particular server needs besides OpenAI's (shardtool refuses unknown fields, so none by
    default). `tokens_field`: the name of a field of the choice (or, failing that, of the response) carrying the
    generated token ids, for a server that returns them; without it the texts are compared. `stream`: each answer
    streamed, and the window carries its time to first token and inter-token latencies."""
    import openai

    client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
    barrier = threading.Barrier(clients + 1)

    def one(_: int) -> Answer | str:
        barrier.wait()
        try:
            return ask(client, model, prompt, max_tokens, chat=chat, stream=stream, extra_body=extra_body,
                       tokens_field=tokens_field)
        except (openai.OpenAIError, RuntimeError) as e:
            return f"{type(e).__name__}: {str(e)[:300]}"

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(one, i) for i in range(clients)]
        barrier.wait()
        start = time.perf_counter()
        results = [f.result() for f in futures]
        seconds = time.perf_counter() - start
    client.close()
    answered = [r for r in results if not isinstance(r, str)]
    errors = [r for r in results if isinstance(r, str)]
    timed, tpots = [], []
    if stream:
        for a in answered:
            try:
                timed.append(stream_latencies(a.sent, a.arrivals))
            except ValueError as e:
                errors.append(f"ValueError: {e}")
                continue
            tpots.append(time_per_output_token(a.seconds, timed[-1][0], a.tokens))
    ids = [a.ids for a in answered]
    return Load(clients, seconds, sum(a.tokens for a in answered), tuple(a.seconds for a in answered),
                tuple(a.text for a in answered),
                tuple(ids) if tokens_field is not None and all(i is not None for i in ids) else None,
                tuple(errors), tuple(t for t, _ in timed), tuple(g for _, gaps in timed for g in gaps),
                sum(len(a.arrivals) for a in answered), tuple(t for t in tpots if t is not None))


def scrape(base_url: str, *, api_key: str = "unused", timeout: float = 30) -> dict[str, float]:
    """Every sample of GET {base_url}/metrics (Prometheus text) by its name with labels; {} when there is none."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base_url.rstrip("/") + "/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
    if r.status_code != 200:
        return {}
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def wait_ready(server: Started, *, url: str | None = None, url_pattern: str = SHARDTOOL_URL, api_key: str = "unused",
               timeout: float = 600) -> str:
    """The server's base URL once GET /health answers 200: `url` as given, or the first match of `url_pattern`'s
    group 1 in its log. Raises RuntimeError, with the log's tail and the OOM kills, if it exits or times out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"the server exited {server.proc.returncode} before it was ready (OOM kills: "
                               f"{server.readings()[2]}): {server.log_text()[-3000:]}")
        if url is None:
            m = re.search(url_pattern, server.log_text())
            url = m.group(1) if m else None
        if url is not None:
            try:
                if httpx.get(url + "/health", headers={"Authorization": f"Bearer {api_key}"}, timeout=5).status_code \
                        == 200:
                    return url
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"the server was not ready within {timeout}s: {server.log_text()[-3000:]}")


@dataclass(frozen=True)
class ServingRow:
    clients: int
    tokens: int  # completion tokens over the window (all clients)
    seconds: float
    tokens_per_s: float  # aggregate: tokens / seconds
    latency_p50_s: float
    latency_max_s: float
    expert_bytes_per_token: float | None  # the server's routed-expert reads over the window / tokens (None: no metric)
    device_bytes_per_token: float  # the machine's cgroup's disk reads over the window / tokens
    peak_memory_bytes: int  # the machine's high-water charge since the server started (RSS + page cache)
    server_rss_peak_bytes: int  # the server process's own high-water RSS since it started (VmHWM)
    oom_kills: int  # since the server started
    agree: bool  # all answered, all alike, and like the reference if one was given
    errors: tuple[str, ...]


def serving_rows(server: Started, base_url: str, *, model: str, prompt: Sequence[int], max_tokens: int,
                 clients: Sequence[int] = (1, 4, 8), api_key: str = "unused",
                 reference: str | Sequence[int] | None = None,
                 expert_bytes_metric: str = EXPERT_BYTES, extra_body: dict | None = None,
                 tokens_field: str | None = None, timeout: float = 600) -> list[ServingRow]:
    """One warm-up request, then one window per entry of `clients` against a server already ready on the machine.
    A window whose server has died ends the list (its row is kept, with its errors)."""
    ask = dict(api_key=api_key, extra_body=extra_body, tokens_field=tokens_field, timeout=timeout)
    warm = run_clients(base_url, model, prompt, max_tokens, 1, **ask)
    if warm.errors:
        raise RuntimeError(f"the warm-up request failed: {warm.errors[0]}")
    rows = []
    for n in clients:
        before, read_before = scrape(base_url, api_key=api_key), server.device_read_bytes()
        load = run_clients(base_url, model, prompt, max_tokens, n, **ask)
        peak, read_after, oom = server.readings()
        after = scrape(base_url, api_key=api_key) if server.alive() else {}
        per = max(load.tokens, 1)
        expert = ((after[expert_bytes_metric] - before[expert_bytes_metric]) / per
                  if expert_bytes_metric in before and expert_bytes_metric in after else None)
        rows.append(ServingRow(n, load.tokens, load.seconds, load.tokens_per_s,
                               statistics.median(load.latencies) if load.latencies else float("nan"),
                               max(load.latencies, default=float("nan")), expert,
                               (read_after - read_before) / per, peak, server.rss_peak_bytes(), oom,
                               load.agree(reference), load.errors))
        if not server.alive():
            break
    return rows


def measure_serving(start_argv: Sequence[str], machine: Machine, data_dir: Path, *, model: str,
                    prompt: Sequence[int], max_tokens: int, log: Path, clients: Sequence[int] = (1, 4, 8),
                    url: str | None = None, url_pattern: str = SHARDTOOL_URL, api_key: str = "unused",
                    env: dict | None = None, reference: str | Sequence[int] | None = None,
                    ready_timeout: float = 600, **rows_options) -> list[ServingRow]:
    """Start the server (`start_argv`) on `machine` once (caches dropped, reads of `data_dir`'s disk throttled), wait
    until it is ready, warm it up with one request, then measure each client count in turn (`serving_rows`); the
    server is stopped and its cgroup removed on return. `rows_options`: `serving_rows`' keyword options."""
    with started(start_argv, machine, data_dir=data_dir, log=log, env=env) as server:
        base_url = wait_ready(server, url=url, url_pattern=url_pattern, api_key=api_key, timeout=ready_timeout)
        return serving_rows(server, base_url, model=model, prompt=prompt, max_tokens=max_tokens, clients=clients,
                            api_key=api_key, reference=reference, **rows_options)
