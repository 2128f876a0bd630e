"""guidellm, an existing OpenAI-serving load generator, unchanged, against `shardtool serve` and llama.cpp's
`llama-server` on the same model (bench_serve.py --vs-llama's in-memory f32 Mixtral, its converter's F32 GGUF; the
same slots, context and threads), each alone: a concurrency sweep (guidellm's `concurrent` profile, a fixed number of
seconds per level) of streamed /v1/completions with synthetic prompts of a fixed token count (guidellm's
`synthetic_text`, counted by the model's own tokenizer from its signed directory) and a fixed output length. From
guidellm's JSON report: TTFT and inter-token latency p50/p99 and output tokens/s per level, side by side, with ratios.

guidellm points straight at each server. It sends two vLLM extensions with every streamed request of a fixed output
length, `ignore_eos: true` and `stream_options: {"include_usage": true, "continuous_usage_stats": true}`, which both
servers implement.

guidellm lives in its own venv (`make bench-loadgen` builds .venv-loadgen; it pins torch to the local CPU wheel).
Usage: python benchmarks/bench_loadgen.py [--streams 1,4,16,32] [--seconds 10] [--prompt-tokens 32]
           [--output-tokens 32] [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOADGEN_VENV = REPO / ".venv-loadgen"
GUIDELLM = LOADGEN_VENV / "bin" / "guidellm"
GUIDELLM_VERSION = "0.8.1"
STREAMS = (1, 4, 16, 32)
WARM_UP = [5, 6, 7]  # token ids of the warm-up request, inside any bench model's vocabulary


def available() -> str:
    """Why guidellm cannot run here (one line), or "" when it can."""
    if not os.access(GUIDELLM, os.X_OK):
        return f"{GUIDELLM} is not installed: run make bench-loadgen"
    return ""


@dataclass(frozen=True)
class Sweep:
    """What guidellm runs: `seconds` at each of `streams` concurrent streams, synthetic prompts of `prompt_tokens`
    tokens each asking `output_tokens`."""

    streams: tuple[int, ...] = STREAMS
    seconds: float = 10
    prompt_tokens: int = 32
    output_tokens: int = 32


def guidellm_argv(url: str, tokenizer: Path, out: Path, sweep: Sweep) -> list[str]:
    """guidellm's own command line for `sweep`: streamed /v1/completions, prompts counted by `tokenizer` (a local
    directory)."""
    streams, seconds = sweep.streams, sweep.seconds
    prompt_tokens, output_tokens = sweep.prompt_tokens, sweep.output_tokens
    return [str(GUIDELLM), "run",
            "--backend", f"kind=openai_http,target={url},model={bench_serve.MODEL_ID},request_format=/v1/completions",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--profile", "kind=concurrent", "--override", "profile.streams", ",".join(map(str, streams)),
            "--constraint", f"kind=max_duration,seconds={seconds:g}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


@dataclass(frozen=True)
class Level:
    """One concurrency level of a guidellm report: its requests and the streamed figures of the successful ones."""

    streams: int
    successful: int
    errored: int
    incomplete: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tokens_per_s: float  # guidellm's output-token rate over the level (successful requests)
    first_error: str = ""


def parse(report: dict) -> list[Level]:
    """The levels of a guidellm JSON report (its `--output kind=json`), in the order run."""
    levels = []
    for b in report["benchmarks"]:
        m, requests = b["metrics"], b["requests"]

        def pct(name: str, p: str) -> float:
            return float(m[name]["successful"]["percentiles"][p])

        totals = m["request_totals"]
        errored = requests.get("errored") or []
        levels.append(Level(
            streams=int(b["config"]["strategy"]["streams"]), successful=int(totals["successful"]),
            errored=int(totals["errored"]), incomplete=int(totals["incomplete"]),
            ttft_p50_ms=pct("time_to_first_token_ms", "p50"), ttft_p99_ms=pct("time_to_first_token_ms", "p99"),
            itl_p50_ms=pct("inter_token_latency_ms", "p50"), itl_p99_ms=pct("inter_token_latency_ms", "p99"),
            output_tokens_per_s=float(m["output_tokens_per_second"]["successful"]["mean"]),
            first_error=str(errored[0].get("info", {}).get("error", "")) if errored else ""))
    return levels


def run_guidellm(url: str, tokenizer: Path, out: Path, sweep: Sweep) -> list[Level]:
    out.unlink(missing_ok=True)
    done = subprocess.run(guidellm_argv(url, tokenizer, out, sweep), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300 + len(sweep.streams) * (sweep.seconds + 60))
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited {done.returncode}: {done.stderr[-2000:]}")
    return parse(json.loads(out.read_text()))


def against(work: Path, name: str, start: Callable[[], bench_serve.Server], tokenizer: Path, sweep: Sweep
            ) -> list[Level]:
    """`name` alone (bench_serve's start-up), warmed with one request, then guidellm's sweep straight at it; the
    server is stopped whatever happens."""
    from _serve_load import run_clients

    server = start().wait_listening()
    try:
        run_clients(server.url, bench_serve.MODEL_ID, WARM_UP, 4, 1)  # caches warm
        return run_guidellm(server.url, tokenizer, work / f"guidellm-{name.split()[0]}.json", sweep)
    finally:
        server.stop()


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_table(results: dict[str, list[Level]]) -> dict:
    """Side by side per level, with serve / llama-server ratios (latency ratios > 1: serve slower; tok/s < 1)."""
    ours, theirs = (results[n] for n in bench_serve.SERVERS)
    print(f"{'streams':>7} {'server':<16} {'ok':>4} {'err':>4} {'TTFT p50':>9} {'p99':>9} {'ITL p50':>8} {'p99':>8} "
          f"{'out tok/s':>9}")
    ratios = {}
    for a, b in zip(ours, theirs):
        for name, lv in zip(bench_serve.SERVERS, (a, b)):
            print(f"{lv.streams:>7} {name:<16} {lv.successful:>4} {lv.errored:>4} {lv.ttft_p50_ms:7.1f}ms "
                  f"{lv.ttft_p99_ms:7.1f}ms {lv.itl_p50_ms:6.2f}ms {lv.itl_p99_ms:6.2f}ms "
                  f"{lv.output_tokens_per_s:9.1f}")
        r = {k: ratio(getattr(a, k), getattr(b, k)) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                                               "output_tokens_per_s")}
        ratios[a.streams] = r
        print(f"{a.streams:>7} {'serve / llama':<16} {'':>4} {'':>4} {r['ttft_p50_ms']:8.2f}x "
              f"{r['ttft_p99_ms']:8.2f}x {r['itl_p50_ms']:7.2f}x {r['itl_p99_ms']:7.2f}x "
              f"{r['output_tokens_per_s']:8.2f}x")
    for name, levels in results.items():
        for lv in levels:
            if lv.first_error:
                print(f"{name}, {lv.streams} stream(s): {lv.errored} errored, the first: {lv.first_error[:300]}")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=lambda s: tuple(int(x) for x in s.split(",")), default=STREAMS)
    ap.add_argument("--seconds", type=float, default=10, help="guidellm's max_duration per concurrency level")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-loadgen"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if reason := available():
        raise SystemExit(f"bench_loadgen: {reason}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if max(args.streams) > max(bench_serve.LLAMA_CLIENTS):
        raise SystemExit(f"bench_loadgen: --streams: at most {max(bench_serve.LLAMA_CLIENTS)} (the servers' slots)")
    model, ctx, starts = bench_serve.llama_pair(args.workdir, args.output_tokens)
    if args.prompt_tokens + args.output_tokens > ctx:
        raise SystemExit(f"bench_loadgen: --prompt-tokens + --output-tokens must fit the {ctx}-token context per slot")
    load = {"before": os.getloadavg()[0]}
    sweep = Sweep(args.streams, args.seconds, args.prompt_tokens, args.output_tokens)
    results = {}
    for name, start in starts.items():  # one after the other, each alone
        results[name] = against(args.workdir, name, start, model, sweep)
        load[f"after {name}"] = os.getloadavg()[0]
    print(f"\n## guidellm {GUIDELLM_VERSION} (unchanged, straight at each server) "
          f"against serve and llama-server: {bench_serve.CACHED_MODEL}, {args.prompt_tokens} prompt + "
          f"{args.output_tokens} output tokens, {args.seconds:g} s per level, {bench_serve.THREADS} threads, "
          f"{max(bench_serve.LLAMA_CLIENTS)} slots x {ctx} tokens; machine {os.cpu_count()} CPUs, load average "
          + ", ".join(f"{k} {v:.1f}" for k, v in load.items()))
    ratios = print_table(results)
    doc = {"guidellm": GUIDELLM_VERSION, "model": bench_serve.CACHED_MODEL,
           "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "seconds": args.seconds,
           "context_per_slot": ctx, "load_average": load,
           "levels": {n: [asdict(lv) for lv in levels] for n, levels in results.items()}, "ratios": ratios}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
