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
`shardtool serve --threads 2` and by llama.cpp's `llama-server -np 16 -t 2` (its converter's F32 GGUF, F32 KV
cache, EOS ignored), each alone, interleaved with `verify-and-run --threads 2`: aggregate tok/s at 1 and 16 clients,
serve / llama-server and serve (1 client) / verify-and-run's decode tok/s, medians of --repeats.
Usage: python benchmarks/bench_serve.py [--repeats 3] [--quick] [--tokens 64] [--workdir DIR] [--json FILE] [--vs-llama]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VENV_BIN, make_mixtral_without_eos, run_command  # noqa: E402

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


def percentile(xs, q):
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))] if s else float("nan")


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
    def ask(i: int) -> tuple[int, float | None]:
        if not stream:
            r = client.completions.create(model=MODEL_ID, prompt=PROMPTS[i], max_tokens=tokens, temperature=0)
            return r.usage.completion_tokens, None
        t0, first, used = time.perf_counter(), None, None
        for chunk in client.completions.create(model=MODEL_ID, prompt=PROMPTS[i], max_tokens=tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        if used is None:
            raise RuntimeError("the stream ended without usage")
        return used, first

    before = server.metrics()
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(ask, range(REQUESTS)))
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
LLAMA_CLIENTS = (1, 16)
ONE_CLIENT_REQUESTS = 3  # one after another: the 1-client figure is their tokens over their wall time
THREADS = 2
STEP_SECONDS = "shardtool_step_seconds_total"  # the engine's forward steps, wall seconds (a counter)


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_phases(server: Server, tokens: int) -> dict:
    """A warm-up, then ONE_CLIENT_REQUESTS single requests and one window of 16 at once: aggregate tok/s each. Where
    the server exports its engine's step seconds (shardtool), also where a token's wall time went: the engine's
    forward steps, and the rest (sampling, the hand-off to the event loop, text, HTTP), per token."""
    from _serve_load import run_clients, scrape

    prompt = PROMPTS[0]
    run_clients(server.url, MODEL_ID, prompt, 4, 1)  # every expert read (shardtool) and warm caches, both servers
    out = {}
    for clients in LLAMA_CLIENTS:
        before = scrape(server.url)
        windows = [run_clients(server.url, MODEL_ID, prompt, tokens, clients)
                   for _ in range(ONE_CLIENT_REQUESTS if clients == 1 else 1)]
        after = scrape(server.url)
        errors = [e for w in windows for e in w.errors]
        if errors:
            raise RuntimeError(f"{clients} clients: {errors[0]}")
        n, wall = sum(w.tokens for w in windows), sum(w.seconds for w in windows)
        out[clients] = {"tokens": n, "tokens_per_s": n / wall}
        if STEP_SECONDS in after:
            steps = after[STEP_SECONDS] - before[STEP_SECONDS]
            out[clients] |= {"wall_ms_per_token": wall / n * 1e3, "step_ms_per_token": steps / n * 1e3,
                             "rest_ms_per_token": (wall - steps) / n * 1e3}
        out[clients] |= _step_timings(before, after, wall)
    return out


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


def vs_llama(work: Path, repeats: int, tokens: int) -> dict:
    import _llamacpp

    ready = _llamacpp.available(server=True)
    if not ready:
        raise SystemExit(f"--vs-llama: {ready.reason}")
    model = build(work, CACHED_MODEL, "cached", keep_checkpoint=True)
    gguf = work / "cached-f32.gguf"
    if not gguf.exists():
        _llamacpp.convert(work / "cached-ck", "f32", gguf)
    ctx = max(map(len, PROMPTS)) + tokens + 8
    shardtool = [str(VENV_BIN / "shardtool"), "serve", str(model), "--trust", str(work / "bench.pub"), "--port", "0",
                 "--model-id", MODEL_ID, "--state-dir", str(work / "state"), "--memory-budget", "4GiB",
                 "--max-context", str(ctx), "--max-batch", str(max(LLAMA_CLIENTS)), "--threads", str(THREADS)]

    def llama() -> Server:
        port = _free_port()
        argv = _llamacpp.server_argv(gguf, port, parallel=max(LLAMA_CLIENTS), ctx_size=max(LLAMA_CLIENTS) * ctx,
                                     threads=THREADS) + ["-ctk", "f32", "-ctv", "f32", "--ignore-eos", "--metrics"]
        return Server.of(work, argv, f"http://127.0.0.1:{port}")

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

    runs: dict[str, list] = {"verify-and-run": [], "warm": [], "shardtool serve": [], "llama-server": []}
    for _ in range(repeats):  # interleaved, each server alone on the machine
        runs["verify-and-run"].append(decode_tps())
        runs["warm"].append(in_process_tps())
        for name, start in (("shardtool serve", lambda: Server.of(work, shardtool)), ("llama-server", llama)):
            server = start().wait_listening()
            try:
                runs[name].append(_load_phases(server, tokens))
            finally:
                server.stop()
    vr, warm = median(runs["verify-and-run"]), median(runs["warm"])
    med = {name: {c: median([r[c]["tokens_per_s"] for r in runs[name]]) for c in LLAMA_CLIENTS}
           for name in ("shardtool serve", "llama-server")}
    ours, theirs = med["shardtool serve"], med["llama-server"]
    print(f"\n## serve vs llama-server: {CACHED_MODEL}, every expert cached, {tokens} new tokens per request "
          f"(greedy), {THREADS} threads, {repeats} interleaved repeat(s), medians")
    print(f"verify-and-run decode: {vr:.1f} tok/s  runs " + " ".join(f"{x:.1f}" for x in runs["verify-and-run"])
          + " (each expert read and checked at its first use)")
    print(f"the same request in one process, every expert cached, no HTTP (prefill included): {warm:.1f} tok/s  "
          "runs " + " ".join(f"{x:.1f}" for x in runs["warm"]))
    for name in med:
        for c in LLAMA_CLIENTS:
            print(f"{name:<16} {c:>2} client(s): {med[name][c]:7.1f} tok/s  runs "
                  + " ".join(f"{r[c]['tokens_per_s']:.1f}" for r in runs[name]))
    for c in LLAMA_CLIENTS:
        split = {k: median([r[c][k] for r in runs["shardtool serve"]])
                 for k in ("wall_ms_per_token", "step_ms_per_token", "rest_ms_per_token")}
        print(f"shardtool serve {c:>2} client(s), where a token's wall time went (aggregate): engine steps "
              f"{split['step_ms_per_token']:.3f} ms, the rest {split['rest_ms_per_token']:.3f} ms "
              f"({split['rest_ms_per_token'] / split['step_ms_per_token']:.1%} of the steps) of "
              f"{split['wall_ms_per_token']:.3f} ms")
    for name in med:
        for c in LLAMA_CLIENTS:
            timed = [r[c] for r in runs[name] if "step_ms" in r[c]]
            if timed:
                print(f"{name:<16} {c:>2} client(s), its own per-step timing: "
                      f"{median([r['step_ms'] for r in timed]):.2f} ms a step, "
                      f"{median([r['rows_per_step'] for r in timed]):.1f} rows a step"
                      + (f", {median([r['wall_ms_per_decode'] for r in timed]):.2f} ms of wall time a llama_decode"
                         if "wall_ms_per_decode" in timed[0] else ""))
    ratios = {"serve_1_vs_verify_and_run": ours[1] / vr, "serve_1_vs_in_process": ours[1] / warm,
              **{f"serve_vs_llama_server_{c}": ours[c] / theirs[c] for c in LLAMA_CLIENTS}}
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return {"model": CACHED_MODEL, "tokens_per_request": tokens, "repeats": repeats, "threads": THREADS,
            "verify_and_run_decode_tokens_per_s": vr, "in_process_tokens_per_s": warm,
            "tokens_per_s": {n: {str(c): v for c, v in m.items()} for n, m in med.items()},
            "ratios": ratios, "runs": runs}


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
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.tokens = 1, 16
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: trust ratios, not times)")
    if args.vs_llama:
        result = vs_llama(work, args.repeats, args.tokens)
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
