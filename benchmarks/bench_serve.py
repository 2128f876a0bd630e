"""`shardtool serve` under concurrent load, against references measured in the same run (medians over repeats):
  - aggregate decode tokens/s at 1, 4 and 16 concurrent openai clients (the same 16 requests each time, each
    asking /v1/completions for --tokens new tokens, greedy) versus the same 16 requests one after another
    through the one-shot CLI (verify-and-run). Target: >= 4x at 16 clients.
  - routed-expert bytes read per generated token at 16 clients versus 1 client, from GET /metrics deltas
    around each phase (shardtool_expert_bytes_read_total / shardtool_generation_tokens_total). Target <= 0.35x.
  - p50/p99 time to first token at 16 clients (stream=True, time to the first chunk carrying text), and the
    share of the phase's wall time the reader threads spent hashing (shardtool_verify_seconds_total delta).
The model is a Mixtral-shaped checkpoint from examples/make_tiny_moe.py whose experts exceed the shard cache:
the budget is planned (runtime.plan_budget, through Engine) so the cache holds only --cache-experts experts.
With --vs-llama, instead: the model that fits in memory (f32, hidden 512, every expert cached) served by
`shardtool serve --threads 2 --max-batch 32` and by llama.cpp's `llama-server -np 32 -t 2` (its converter's F32
GGUF, F32 KV cache, EOS ignored; the same context per slot), each alone, interleaved with `verify-and-run
--threads 2`: at 1, 4, 16 and 32 clients, through /v1/completions (token-id prompt) and /v1/chat/completions (one
user message, the checkpoint's chat template on both servers), aggregate tok/s from non-streamed windows, and TTFT and
inter-token latency p50/p99 from the same windows streamed (the official openai client, stream=True; an inter-token
latency is the gap between two chunks carrying text, counted once however many tokens the later chunk carried;
TPOT, per token whatever the chunking, beside it).
It prints the issue's ratios: serve (1 client) / verify-and-run's decode tok/s, serve / llama-server at each client
count, and ITL p99 at 16 clients serve / llama-server; medians of --repeats, every run kept in the JSON.
Usage: python benchmarks/bench_serve.py [--repeats 3] [--quick] [--tokens 64] [--workdir DIR] [--json FILE] [--vs-llama | --ttft-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VENV_BIN, make_mixtral_without_eos, run_command  # noqa: E402
from _serve_load import percentile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
MODEL_ID = "bench/serve"
# 8 experts of 3 x 256 x 512 f32 = 1.5 MiB each, top-2, 4 layers: 48 MiB of experts.
MODEL = dict(layers=4, experts=8, experts_per_tok=2, hidden=256, moe_intermediate=512, heads=4, kv_heads=2,
             vocab=1024, dtype="f32")
REQUESTS = 16
# 16 different token-id prompts, 4 to 16 tokens long.
PROMPTS = [[(37 * i + 11 * j) % 1000 + 5 for j in range(4 + (i * 5) % 13)] for i in range(REQUESTS)]
CONCURRENCY = (1, 4, 16)
MAX_BATCH, MAX_QUEUE = 16, 64
METRICS = ("expert_bytes_read_total", "generation_tokens_total", "verify_seconds_total", "read_seconds_total",
           "steps_total", "step_sequences_total", "cache_misses_total", "cache_hits_total")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# --- the model ----------------------------------------------------------------------------------------------

def build(work: Path, knobs: dict = MODEL, name: str = "model", keep_checkpoint: bool = False) -> Path:
    """Generate, split and sign the model once through the real CLI (reused across runs while `knobs` hold); with
    `keep_checkpoint`, its Hugging Face checkpoint stays in WORK/NAME-ck (for llama.cpp's converter)."""
    out, marker = work / name, work / ("signed.json" if name == "model" else f"{name}-signed.json")
    ck = work / (f"{name}-ck" if keep_checkpoint else "ck")
    if marker.exists() and json.loads(marker.read_text()) == knobs and (ck.exists() or not keep_checkpoint):
        return out
    for p in (out, ck, work / "state", work / "cli-state"):
        shutil.rmtree(p, ignore_errors=True)
    shardtool = str(VENV_BIN / "shardtool")
    if not (work / "bench.key").exists():
        subprocess.run([shardtool, "keygen", "--out", str(work / "bench"), "--no-passphrase"], check=True,
                       capture_output=True)
    make_mixtral_without_eos(ck, knobs)
    subprocess.run([shardtool, "split", "-q", str(ck), str(out), "--model-id", MODEL_ID], check=True,
                   capture_output=True)
    subprocess.run([shardtool, "sign", str(out), "--key", str(work / "bench.key")], check=True, capture_output=True)
    if not keep_checkpoint:
        shutil.rmtree(ck)
    marker.write_text(json.dumps(knobs))
    return out


def plan(work: Path, model: Path, max_context: int, cache_experts: int) -> dict:
    """The budget whose shard cache holds `cache_experts` experts with a KV cache for MAX_BATCH full-length
    sequences, planned by the runtime itself (Engine -> plan_budget) in a fresh process."""
    out = work / "plan.json"
    subprocess.run([sys.executable, __file__, "--_plan", str(out), str(model), str(work / "bench.pub"),
                    str(max_context), str(cache_experts)], check=True)
    return json.loads(out.read_text())


def run_plan(out: str, model: str, pub: str, max_context: str, cache_experts: str) -> None:
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import Engine, plan_budget

    verified = load_trusted_manifest(Path(model) / "manifest.msgpack", [load_public_key(Path(pub))], 1,
                                     Path(model).parent / "plan-state")
    experts = [e.size for e in verified.entries if e.kind == "expert"]
    ctx = int(max_context)
    probe = Engine(Path(model), verified, budget=1 << 36, max_batch=MAX_BATCH, max_context=ctx)
    try:
        kv = probe.bytes_per_token * ctx * MAX_BATCH
        working = plan_budget(1 << 36, probe.config, verified, ctx, 2, max_batch=MAX_BATCH, kv_cache=kv).working
        top_k = probe.config.top_k
    finally:
        probe.close()
    budget = kv + working + int(cache_experts) * max(experts)
    p = plan_budget(budget, probe.config, verified, ctx, 2, max_batch=MAX_BATCH, kv_cache=kv)
    Path(out).write_text(json.dumps({"budget": budget, "kv_cache": kv, "plan": p.as_dict(), "top_k": top_k,
                                     "expert_bytes": sum(experts), "experts": len(experts),
                                     "largest_expert": max(experts)}))


# --- the server ---------------------------------------------------------------------------------------------

class Server:
    """One `shardtool serve` in its own session; stopped by signalling its own process group only."""

    def __init__(self, work: Path, model: Path, budget: int, kv_cache: int, max_context: int):
        self.start(work, [str(VENV_BIN / "shardtool"), "serve", str(model), "--trust", str(work / "bench.pub"),
                          "--port", "0", "--model-id", MODEL_ID, "--state-dir", str(work / "state"), "--memory-budget",
                          str(budget), "--kv-cache", str(kv_cache), "--max-context", str(max_context),
                          "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)])

    def start(self, work: Path, argv: list[str], url: str = "") -> None:
        """`argv` in its own session; `url`: where it listens, when known (else read from its log)."""
        self.log = work / "serve.log"
        self.err = open(self.log, "w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.err,
                                     start_new_session=True)
        self.url = url

    @classmethod
    def of(cls, work: Path, argv: list[str], url: str = "") -> "Server":
        server = cls.__new__(cls)
        server.start(work, argv, url)
        return server

    def wait_listening(self, seconds: float = 120) -> "Server":
        import httpx

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m = None if self.url else re.search(r"serving \S+ on (http://\S+)", self.log.read_text())
            if m:
                self.url = m.group(1)
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"{Path(self.proc.args[0]).name} exited {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"shardtool serve did not listen within {seconds}s: {self.log.read_text()[-2000:]}")

    def metrics(self) -> dict[str, float]:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {k: float(re.search(rf"^shardtool_{k} (\S+)", text, re.M)[1]) for k in METRICS}

    def stop(self) -> int:
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.err.close()


def phase(server: Server, client, concurrency: int, tokens: int, stream: bool) -> dict:
    """The 16 requests through `concurrency` client threads; figures from /metrics deltas around the phase."""
    from _serve_load import ask, stream_latencies

    def one(i: int) -> tuple[int, float | None]:
        a = ask(client, MODEL_ID, PROMPTS[i], tokens, stream=stream)
        return a.tokens, stream_latencies(a.sent, a.arrivals)[0] if stream else None

    before = server.metrics()
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(REQUESTS)))
    wall = time.perf_counter() - t
    after = server.metrics()
    d = {k: after[k] - before[k] for k in METRICS}
    generated = sum(n for n, _ in results)
    return {"wall_s": wall, "tokens": generated, "tokens_per_s": generated / wall,
            "expert_bytes_per_token": d["expert_bytes_read_total"] / max(d["generation_tokens_total"], 1),
            "server_tokens": d["generation_tokens_total"], "verify_share": d["verify_seconds_total"] / wall,
            "mean_batch": d["step_sequences_total"] / max(d["steps_total"], 1),
            "cache_misses": d["cache_misses_total"], "ttft_s": [f for _, f in results if f is not None]}


def serve_run(work: Path, model: Path, budget: int, kv: int, ctx: int, tokens: int) -> dict:
    """One server lifetime: a warm-up request, then each concurrency, then a streamed 16-client phase."""
    import openai

    server = Server(work, model, budget, kv, ctx).wait_listening()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        client.completions.create(model=MODEL_ID, prompt=[5, 6, 7], max_tokens=2, temperature=0)  # warm-up
        out = {c: phase(server, client, c, tokens, stream=False) for c in CONCURRENCY}
        out["stream16"] = phase(server, client, 16, tokens, stream=True)
    finally:
        code = server.stop()
    if code != 0:
        raise RuntimeError(f"shardtool serve exited {code}: {server.log.read_text()[-2000:]}")
    return out


def cli_run(work: Path, model: Path, budget: int, tokens: int) -> dict:
    """The same 16 requests one after another through verify-and-run: total tokens / total wall seconds."""
    total_s, total_tokens = 0.0, 0
    for prompt in PROMPTS:
        report = work / "cli-report.json"
        report.unlink(missing_ok=True)
        s = run_command([str(VENV_BIN / "verify-and-run"), str(model), "--trust", str(work / "bench.pub"),
                         "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(tokens),
                         "--memory-budget", str(budget), "-q", "--print-ids", "--state-dir", str(work / "cli-state"),
                         "--json-report", str(report)])
        total_s += s.seconds
        total_tokens += len(json.loads(report.read_text())["generated_ids"])
    return {"wall_s": total_s, "tokens": total_tokens, "tokens_per_s": total_tokens / total_s}


# --- against llama.cpp's server, the model in memory -------------------------------------------------------

# 54 M parameters, f32: 8 experts of 3 x 1024 x 512 per layer, top-2, 4 layers; the whole model fits the budget.
CACHED_MODEL = dict(layers=4, experts=8, experts_per_tok=2, hidden=512, intermediate=1024, moe_intermediate=1024,
                    heads=8, kv_heads=4, vocab=1024, dtype="f32")
LLAMA_CLIENTS = (1, 4, 16, 32)
ONE_CLIENT_REQUESTS = 3  # one after another: the 1-client figures are over their tokens and wall time
THREADS = 2
STEP_SECONDS = "shardtool_step_seconds_total"  # the engine's forward steps, wall seconds (a counter)
# The chat phase's one user message: both servers apply the checkpoint's own chat template (ChatML-style, from
# examples/make_tiny_moe.py) to it; llama-server reads the template from the GGUF its converter wrote.
CHAT = [{"role": "user", "content": "Check every shard against the signed manifest before you load it."}]
MODES = {"completions": PROMPTS[0], "chat": CHAT}  # endpoint -> the prompt (token ids, or the messages)
PROMPT_ROOM = 96  # context per slot beyond the new tokens: the longest prompt, the chat prompt's template included
SERVERS = ("shardtool serve", "llama-server")
TARGETS = {"serve_1_vs_verify_and_run": ">= 0.9", "serve_vs_llama_server_1": ">= 1.0",
           "serve_vs_llama_server_16": ">= 1.0", "itl_p99_16_serve_vs_llama_server": "<= 1.2"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _windows(server: Server, mode: str, clients: int, tokens: int, stream: bool) -> list:
    """ONE_CLIENT_REQUESTS single requests one after another, or one window of `clients` at once; every request
    must be answered with exactly `tokens` new tokens (both servers ignore EOS), else the figures compare unlike."""
    from _serve_load import run_clients

    windows = [run_clients(server.url, MODEL_ID, MODES[mode], tokens, clients, chat=mode == "chat", stream=stream)
               for _ in range(ONE_CLIENT_REQUESTS if clients == 1 else 1)]
    what = f"{Path(server.proc.args[0]).name}, {mode}, {clients} client(s){', streamed' if stream else ''}"
    errors = [e for w in windows for e in w.errors]
    if errors:
        raise RuntimeError(f"{what}: {errors[0]}")
    got, asked = sum(w.tokens for w in windows), sum(w.clients for w in windows) * tokens
    if got != asked:
        raise RuntimeError(f"{what}: expected {asked} new tokens, the usage counted {got}")
    return windows


def _load_phases(server: Server, tokens: int) -> dict:
    """Warm-ups, then for each endpoint and client count: non-streamed windows (aggregate tok/s) and the same
    streamed (TTFT and inter-token latency p50/p99; their own tok/s kept as `stream_tokens_per_s`). Where the
    server exports its engine's step seconds (shardtool), also where a non-streamed token's wall time went: the
    engine's forward steps, and the rest (sampling, the hand-off to the event loop, text, HTTP), per token."""
    from _serve_load import run_clients, scrape, stream_summary

    for mode, prompt in MODES.items():  # every expert read (shardtool), the template compiled, caches warm
        run_clients(server.url, MODEL_ID, prompt, 4, 1, chat=mode == "chat")
    out: dict = {"chat_prompt_tokens": _chat_prompt_tokens(server), "texts": {}}
    for mode in MODES:
        out[mode] = {}
        for clients in LLAMA_CLIENTS:
            before = scrape(server.url)
            windows = _windows(server, mode, clients, tokens, stream=False)
            out["texts"].setdefault(mode, windows[0].texts[0])
            after = scrape(server.url)
            streamed = _windows(server, mode, clients, tokens, stream=True)
            n, wall = sum(w.tokens for w in windows), sum(w.seconds for w in windows)
            row = {"tokens": n, "tokens_per_s": n / wall, **stream_summary(streamed),
                   "stream_tokens_per_s": sum(w.tokens for w in streamed) / sum(w.seconds for w in streamed)}
            if STEP_SECONDS in after:
                steps = after[STEP_SECONDS] - before[STEP_SECONDS]
                row |= {"wall_ms_per_token": wall / n * 1e3, "step_ms_per_token": steps / n * 1e3,
                        "rest_ms_per_token": (wall - steps) / n * 1e3}
            out[mode][clients] = row | _step_timings(before, after, wall)
    return out


def _chat_prompt_tokens(server: Server) -> int:
    """The chat prompt's length in tokens as the server counts it (its template applied), from one request's usage."""
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens


def _check_llama_template(server: Server, checkpoint: Path) -> None:
    """llama-server must apply the checkpoint's own chat template (from its GGUF), not a built-in fallback."""
    import httpx

    ours = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    theirs = httpx.get(server.url + "/props", timeout=30).json().get("chat_template")
    if theirs != ours:
        raise RuntimeError(f"llama-server's chat template (GET /props) is not the checkpoint's: expected {ours!r}, "
                           f"found {theirs!r}")


def _step_timings(before: dict, after: dict, wall: float) -> dict:
    """Each server's own per-step figures from its /metrics deltas around a phase: shardtool's mean forward step
    (step seconds over steps) and mean batch; llama-server's (--metrics) mean time a slot took per generated token,
    which at one token per slot per llama_decode is the wall time of a decode step, and the phase's wall time over
    its llama_decode calls (the server loop's whole iteration)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    if delta("shardtool_steps_total"):
        return {"step_ms": delta(STEP_SECONDS) / delta("shardtool_steps_total") * 1e3,
                "rows_per_step": delta("shardtool_step_sequences_total") / delta("shardtool_steps_total")}
    if delta("llamacpp:n_decode_total") and delta("llamacpp:tokens_predicted_total"):
        return {"step_ms": delta("llamacpp:tokens_predicted_seconds_total") / delta("llamacpp:tokens_predicted_total")
                * 1e3, "wall_ms_per_decode": wall / delta("llamacpp:n_decode_total") * 1e3,
                "rows_per_step": delta("llamacpp:tokens_predicted_total") / delta("llamacpp:n_decode_total")}
    return {}


def llama_pair(work: Path, tokens: int) -> tuple[Path, int, dict[str, Callable[[], Server]]]:
    """The in-memory model (CACHED_MODEL) signed and converted to llama.cpp's F32 GGUF, once; the context per slot for
    requests of up to PROMPT_ROOM prompt and `tokens` new tokens; and how to start each of SERVERS on it alone
    (`max(LLAMA_CLIENTS)` slots of that context, THREADS threads; call `.wait_listening()` on what it returns)."""
    import _llamacpp

    ready = _llamacpp.available(server=True)
    if not ready:
        raise SystemExit(f"--vs-llama: {ready.reason}")
    model = build(work, CACHED_MODEL, "cached", keep_checkpoint=True)
    gguf = work / "cached-f32.gguf"
    if not gguf.exists():
        _llamacpp.convert(work / "cached-ck", "f32", gguf)
    ctx = PROMPT_ROOM + tokens  # per slot, both servers
    slots = max(LLAMA_CLIENTS)
    shardtool = [str(VENV_BIN / "shardtool"), "serve", str(model), "--trust", str(work / "bench.pub"), "--port", "0",
                 "--model-id", MODEL_ID, "--state-dir", str(work / "state"), "--memory-budget", "4GiB",
                 "--max-context", str(ctx), "--max-batch", str(slots), "--threads", str(THREADS)]

    def llama() -> Server:
        port = _free_port()
        argv = _llamacpp.server_argv(gguf, port, parallel=slots, ctx_size=slots * ctx, threads=THREADS) \
            + ["-ctk", "f32", "-ctv", "f32", "--ignore-eos", "--metrics"]
        return Server.of(work, argv, f"http://127.0.0.1:{port}")

    return model, ctx, dict(zip(SERVERS, (lambda: Server.of(work, shardtool), llama)))


def vs_llama(work: Path, repeats: int, tokens: int) -> dict:
    model, ctx, starts = llama_pair(work, tokens)

    def in_process_tps() -> float:
        """The same request through verify-and-run's loop with every expert cached, without HTTP: the library call
        under it, the second of two generations in one process, new tokens over its wall time (prefill included,
        as serve's figure). The command itself reads and checks each expert at its first use, which a short run
        cannot amortize."""
        out = subprocess.run([sys.executable, __file__, "--_warm", str(model), str(work / "bench.pub"),
                              ",".join(map(str, PROMPTS[0])), str(tokens)], check=True, capture_output=True, text=True)
        return float(out.stdout.split()[-1])

    def decode_tps() -> float:
        report = work / "cli-report.json"
        report.unlink(missing_ok=True)
        run_command([str(VENV_BIN / "verify-and-run"), str(model), "--trust", str(work / "bench.pub"), "--prompt-ids",
                     ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(tokens), "--memory-budget", "4GiB",
                     "--threads", str(THREADS), "-q", "--print-ids", "--state-dir", str(work / "cli-state"),
                     "--json-report", str(report)])
        return json.loads(report.read_text())["decode_tokens_per_s"]

    runs: dict[str, list] = {"verify-and-run": [], "warm": [], "load_average": [], **{n: [] for n in SERVERS}}
    for _ in range(repeats):  # interleaved, each server alone on the machine
        runs["load_average"].append(os.getloadavg()[0])
        runs["verify-and-run"].append(decode_tps())
        runs["warm"].append(in_process_tps())
        for name, start in starts.items():
            server = start().wait_listening()
            try:
                if name == "llama-server":
                    _check_llama_template(server, work / "cached-ck")
                runs[name].append(_load_phases(server, tokens))
            finally:
                server.stop()
    return _report_vs_llama(runs, repeats, tokens, ctx)


def ttft_only(work: Path, repeats: int, tokens: int) -> dict:
    """The chat prompt's time to first token through `shardtool serve` alone (the --vs-llama server and model):
    per repeat, a fresh server, warmed, then ONE_CLIENT_REQUESTS single streamed requests and one window of 16 at
    once; and the inter-token latency of one running stream while a new chat prompt arrives (the gap that spans the
    new prompt's prefill). Medians over repeats, the load average at each repeat's start."""
    import threading

    import openai
    from _serve_load import percentile, run_clients

    model = build(work, CACHED_MODEL, "cached", keep_checkpoint=True)
    ctx = PROMPT_ROOM + tokens
    argv = [str(VENV_BIN / "shardtool"), "serve", str(model), "--trust", str(work / "bench.pub"), "--port", "0",
            "--model-id", MODEL_ID, "--state-dir", str(work / "state"), "--memory-budget", "4GiB",
            "--max-context", str(ctx), "--max-batch", str(max(LLAMA_CLIENTS)), "--threads", str(THREADS)]
    runs: list[dict] = []
    for _ in range(repeats):
        load = os.getloadavg()[0]
        server = Server.of(work, argv).wait_listening()
        try:
            for mode, prompt in MODES.items():
                run_clients(server.url, MODEL_ID, prompt, 4, 1, chat=mode == "chat")
            one = [t for _ in range(ONE_CLIENT_REQUESTS)
                   for t in run_clients(server.url, MODEL_ID, CHAT, tokens, 1, chat=True, stream=True).ttfts]
            many = run_clients(server.url, MODEL_ID, CHAT, tokens, 16, chat=True, stream=True)
            if many.errors:
                raise RuntimeError(f"16 streamed chat clients: {many.errors[0]}")
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            arrivals: list[float] = []

            def running() -> None:  # a long completion, streamed: its chunks' arrival times
                for chunk in client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=ctx - len(PROMPTS[0]),
                                                       temperature=0, stream=True):
                    if chunk.choices and chunk.choices[0].text:
                        arrivals.append(time.perf_counter())

            thread = threading.Thread(target=running)
            thread.start()
            while len(arrivals) < 8:
                time.sleep(0.002)
            asked = time.perf_counter()
            client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=1, temperature=0)
            thread.join()
            client.close()
            gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
            spanning = max(b - a for a, b in zip(arrivals, arrivals[1:]) if b > asked)
        finally:
            server.stop()
        runs.append({"load_average": load, "ttft_1_s": statistics.median(one), "ttft_16_p50_s":
                     percentile(many.ttfts, 50), "ttft_16_p99_s": percentile(many.ttfts, 99),
                     "itl_p50_s": statistics.median(gaps), "itl_new_prompt_s": spanning})
    med = {k: median([r[k] for r in runs]) for k in runs[0] if k != "load_average"}
    print(f"\n## shardtool serve, chat prompt ({CHAT[0]['content']!r}, its template applied), {tokens} new tokens, "
          f"{THREADS} threads, {repeats} repeat(s), medians; load average " + " ".join(f"{r['load_average']:.1f}"
                                                                                      for r in runs))
    print(f"TTFT 1 client p50 {med['ttft_1_s'] * 1e3:.0f} ms; 16 clients p50 {med['ttft_16_p50_s'] * 1e3:.0f} ms, "
          f"p99 {med['ttft_16_p99_s'] * 1e3:.0f} ms; a running stream's ITL p50 {med['itl_p50_s'] * 1e3:.1f} ms, "
          f"its longest gap while a new chat prompt arrived {med['itl_new_prompt_s'] * 1e3:.0f} ms")
    print("runs: " + "; ".join(" ".join(f"{k} {v * 1e3:.0f}ms" if k.endswith("_s") else f"{k} {v:.1f}"
                                        for k, v in r.items()) for r in runs))
    return {"model": CACHED_MODEL, "tokens_per_request": tokens, "repeats": repeats, "medians": med, "runs": runs}


def _report_vs_llama(runs: dict, repeats: int, tokens: int, ctx: int) -> dict:
    """Medians over the runs, the tables, the issue's ratios; the JSON document (every run kept)."""
    vr, warm = median(runs["verify-and-run"]), median(runs["warm"])
    keys = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s", "tpot_p99_s",
            "tokens_per_chunk", "stream_tokens_per_s")
    med = {name: {mode: {c: {k: median([r[mode][c][k] for r in runs[name]]) for k in keys} for c in LLAMA_CLIENTS}
                  for mode in MODES} for name in SERVERS}
    print(f"\n## serve vs llama-server: {CACHED_MODEL}, every expert cached, {tokens} new tokens per request "
          f"(greedy, EOS ignored), {THREADS} threads, {max(LLAMA_CLIENTS)} slots x {ctx} tokens of context each, "
          f"{repeats} interleaved repeat(s), each server alone, medians; load average at each repeat's start "
          + " ".join(f"{x:.1f}" for x in runs["load_average"]))
    print(f"verify-and-run decode: {vr:.1f} tok/s  runs " + " ".join(f"{x:.1f}" for x in runs["verify-and-run"])
          + " (each expert read and checked at its first use)")
    print(f"the same request in one process, every expert cached, no HTTP (prefill included): {warm:.1f} tok/s  "
          "runs " + " ".join(f"{x:.1f}" for x in runs["warm"]))
    print("chat prompt tokens (template applied) as each server counts them: "
          + ", ".join(f"{n} {sorted({r['chat_prompt_tokens'] for r in runs[n]})}" for n in SERVERS))
    for mode in MODES:  # greedy on the same weights: unlike texts stream unlike chunks (see tok/chunk)
        texts = {n: {r["texts"][mode] for r in runs[n]} for n in SERVERS}
        same = len(texts[SERVERS[0]] | texts[SERVERS[1]]) == 1
        print(f"{mode}: the two servers' greedy texts " + ("agree" if same else f"differ: {texts}"))
    for mode in MODES:
        _print_mode(mode, med, runs)
    _print_split(runs["shardtool serve"])
    _print_step_timings(runs)
    ratios = {"serve_1_vs_verify_and_run": med["shardtool serve"]["completions"][1]["tokens_per_s"] / vr,
              "serve_1_vs_in_process": med["shardtool serve"]["completions"][1]["tokens_per_s"] / warm}
    for mode in MODES:
        pre = "" if mode == "completions" else "chat_"
        ours, theirs = med["shardtool serve"][mode], med["llama-server"][mode]
        ratios |= {f"{pre}serve_vs_llama_server_{c}": ours[c]["tokens_per_s"] / theirs[c]["tokens_per_s"]
                   for c in LLAMA_CLIENTS}
        ratios[f"{pre}itl_p99_16_serve_vs_llama_server"] = ours[16]["itl_p99_s"] / theirs[16]["itl_p99_s"]
        ratios[f"{pre}ttft_p99_16_serve_vs_llama_server"] = ours[16]["ttft_p99_s"] / theirs[16]["ttft_p99_s"]
    print("\n## the issue's ratios (completions; chat_ the same through /v1/chat/completions)")
    for k, v in ratios.items():
        print(f"{k:<40} {v:6.2f}" + (f"   target {TARGETS[k]}" if k in TARGETS else ""))
    return {"model": CACHED_MODEL, "tokens_per_request": tokens, "repeats": repeats, "threads": THREADS,
            "context_per_slot": ctx, "slots": max(LLAMA_CLIENTS), "verify_and_run_decode_tokens_per_s": vr,
            "in_process_tokens_per_s": warm, "medians": med, "ratios": ratios, "runs": runs}


def _print_mode(mode: str, med: dict, runs: dict) -> None:
    """One endpoint's table: aggregate tok/s (non-streamed) and the streamed latencies, per server and client count."""
    print(f"\n### /v1/{'chat/completions' if mode == 'chat' else 'completions'}: tok/s from non-streamed windows; from "
          "the same windows streamed: TTFT, ITL (the gaps between chunks carrying text, each counted once however many "
          "tokens its chunk carried: tok/chunk) and TPOT ((answer time - TTFT) / (tokens - 1), per token)")
    print(f"{'server':<16} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} "
          f"{'TPOT p50':>8} {'p99':>8} {'tok/chunk':>9} {'streamed tok/s':>14}  runs tok/s")
    for c in LLAMA_CLIENTS:
        for name in SERVERS:
            m = med[name][mode][c]
            print(f"{name:<16} {c:>7} {m['tokens_per_s']:8.1f} {m['ttft_p50_s'] * 1e3:7.1f}ms "
                  f"{m['ttft_p99_s'] * 1e3:6.1f}ms {m['itl_p50_s'] * 1e3:6.2f}ms {m['itl_p99_s'] * 1e3:6.2f}ms "
                  f"{m['tpot_p50_s'] * 1e3:6.2f}ms {m['tpot_p99_s'] * 1e3:6.2f}ms "
                  f"{m['tokens_per_chunk']:9.2f} {m['stream_tokens_per_s']:14.1f}  "
                  + " ".join(f"{r[mode][c]['tokens_per_s']:.1f}" for r in runs[name]))


def _print_split(serve_runs: list) -> None:
    for c in LLAMA_CLIENTS:
        split = {k: median([r["completions"][c][k] for r in serve_runs])
                 for k in ("wall_ms_per_token", "step_ms_per_token", "rest_ms_per_token")}
        print(f"shardtool serve {c:>2} client(s), completions, where a token's wall time went (aggregate): engine "
              f"steps {split['step_ms_per_token']:.3f} ms, the rest {split['rest_ms_per_token']:.3f} ms "
              f"({split['rest_ms_per_token'] / split['step_ms_per_token']:.1%} of the steps) of "
              f"{split['wall_ms_per_token']:.3f} ms")


def _print_step_timings(runs: dict) -> None:
    """Each server's own per-step figures (`_step_timings`), completions, medians over the runs."""
    for name in SERVERS:
        for c in LLAMA_CLIENTS:
            timed = [r["completions"][c] for r in runs[name] if "step_ms" in r["completions"][c]]
            if timed:
                print(f"{name:<16} {c:>2} client(s), its own per-step timing: "
                      f"{median([r['step_ms'] for r in timed]):.2f} ms a step, "
                      f"{median([r['rows_per_step'] for r in timed]):.1f} rows a step"
                      + (f", {median([r['wall_ms_per_decode'] for r in timed]):.2f} ms of wall time a llama_decode"
                         if "wall_ms_per_decode" in timed[0] else ""))


def run_warm(model: str, pub: str, prompt: str, tokens: str) -> None:
    """Print the new tokens per wall second (prefill included, as a served request's) of the second of two greedy
    generations in this process (`verify-and-run`'s threads)."""
    from shardtool.cli._common import set_compute_threads  # the CLI's own sizing, before numpy loads

    set_compute_threads(THREADS, 2)
    from shardtool.api import open_model

    ids = [int(x) for x in prompt.split(",")]
    with open_model(model, trust=[pub], memory_budget="4GiB", state_dir=Path(model).parent / "warm-state") as m:
        m.generate(ids, int(tokens))
        t = time.perf_counter()
        m.generate(ids, int(tokens))
        print(int(tokens) / (time.perf_counter() - t))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--_plan", "--_warm"):
        (run_plan if sys.argv[1] == "--_plan" else run_warm)(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--cache-experts", type=int, default=4, help="experts the server's shard cache holds")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 16 new tokens per request")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-serve"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--vs-llama", action="store_true", help="the in-memory model against llama.cpp's llama-server")
    ap.add_argument("--ttft-only", action="store_true", help="--vs-llama's server alone: the chat prompt's TTFT at 1 "
                    "and 16 clients, and a running stream's ITL while a new prompt arrives")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.tokens = 1, 16
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: trust ratios, not times)")
    if args.vs_llama or args.ttft_only:
        result = (ttft_only if args.ttft_only else vs_llama)(work, args.repeats, args.tokens)
        print(json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return
    model = build(work)
    ctx = max(map(len, PROMPTS)) + args.tokens
    p = plan(work, model, ctx, args.cache_experts)
    budget, kv = p["budget"], p["kv_cache"]
    print(f"model: {MODEL}; {p['experts']} experts, {p['expert_bytes'] / MIB:.1f} MiB "
          f"({p['largest_expert'] / MIB:.2f} MiB each); budget {budget / MIB:.1f} MiB: server shard cache "
          f"{p['plan']['shard_cache'] / MIB:.1f} MiB (~{p['plan']['shard_cache'] / p['largest_expert']:.1f} experts), "
          f"KV {kv / MIB:.1f} MiB for {MAX_BATCH} x {ctx} tokens, working {p['plan']['working'] / MIB:.1f} MiB")
    runs: list[dict] = []
    clis: list[dict] = []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        clis.append(cli_run(work, model, budget, args.tokens))
        runs.append(serve_run(work, model, budget, kv, ctx, args.tokens))
    cli_tps = median([c["tokens_per_s"] for c in clis])
    med = {c: {k: median([r[c][k] for r in runs]) for k in ("tokens_per_s", "expert_bytes_per_token",
                                                            "verify_share", "mean_batch", "tokens")}
           for c in (*CONCURRENCY, "stream16")}
    ttfts = [r["stream16"]["ttft_s"] for r in runs]
    p50, p99 = median([percentile(t, 50) for t in ttfts]), median([percentile(t, 99) for t in ttfts])
    bpt1 = med[1]["expert_bytes_per_token"]
    print(f"\n## serve: {REQUESTS} requests x {args.tokens} new tokens (greedy), {args.repeats} repeat(s), medians")
    print(f"{'what':<24} {'tok/s':>8} {'vs CLI':>7} {'batch':>6} {'expert MiB/tok':>15} {'vs 1':>6} "
          f"{'verify':>7}  runs tok/s")
    print(f"{'CLI, one after another':<24} {cli_tps:8.1f} {1.0:7.2f} {'1':>6} {'-':>15} {'-':>6} {'-':>7}  "
          + " ".join(f"{c['tokens_per_s']:.1f}" for c in clis))
    for c in (*CONCURRENCY, "stream16"):
        m = med[c]
        name = f"serve, {c} clients" if c != "stream16" else "serve, 16 streamed"
        print(f"{name:<24} {m['tokens_per_s']:8.1f} {m['tokens_per_s'] / cli_tps:7.2f} {m['mean_batch']:6.1f} "
              f"{m['expert_bytes_per_token'] / MIB:15.3f} {m['expert_bytes_per_token'] / bpt1:6.2f} "
              f"{m['verify_share']:7.1%}  " + " ".join(f"{r[c]['tokens_per_s']:.1f}" for r in runs))
    ratio16 = med[16]["tokens_per_s"] / cli_tps
    bytes_ratio = med[16]["expert_bytes_per_token"] / bpt1
    print(f"16 clients vs sequential CLI: {ratio16:.2f}x (target >= 4x); expert bytes per token 16 vs 1 client: "
          f"{bytes_ratio:.2f}x (target <= 0.35x)")
    print(f"time to first token at 16 streamed clients: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; "
          f"verify share of wall at 16 clients {med[16]['verify_share']:.1%} (reader-thread hashing seconds / wall)")
    tokens_ok = all(r[c]["tokens"] == REQUESTS * args.tokens for r in runs for c in (*CONCURRENCY, "stream16")) and \
        all(c["tokens"] == REQUESTS * args.tokens for c in clis)
    if not tokens_ok:
        print("warning: some requests generated fewer tokens than asked (see tokens in the JSON)")
    result = {"model": MODEL, "budget": budget, "plan": p["plan"], "tokens_per_request": args.tokens,
              "repeats": args.repeats, "cli_tokens_per_s": cli_tps,
              "serve": {str(c): {k: v for k, v in med[c].items()} for c in med},
              "ratio_16_vs_cli": ratio16, "expert_bytes_per_token_16_vs_1": bytes_ratio,
              "ttft_p50_s": p50, "ttft_p99_s": p99, "all_tokens_generated": tokens_ok}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
