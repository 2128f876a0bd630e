"""The seed's case on an emulated small machine (`make bench-seed`): a DeepSeek-V3-shaped MoE many times larger than
memory, streamed from a disk throttled to NVMe speed, verified shard by shard.

The model (examples/make_tiny_moe.py, deepseek_v3 layout, no EOS so every run makes the tokens asked for): 16 layers,
the first dense, 15 MoE layers of 128 routed experts (top-8, group-limited: 8 groups, 4 chosen) plus one shared
expert, hidden 2048, expert width 768, MLA attention (q_lora_rank 384, kv_lora_rank 256), bf16: 9 MiB per expert,
17.4 GiB in all (16.9 GiB of routed experts). Generated shard by shard (never whole in memory), split, signed; again
with `split --quantize int4`.

The machine (benchmarks/_machine.py): a cgroup whose memory cap M (default 2 GiB, 1/8 of the model) charges the
process's memory *and* the page cache it touches, and whose disk reads are throttled to B (default 0.85 GB/s, the
seed's NVMe); the page cache is dropped before every run. verify-and-run runs inside it with --memory-budget below M
(the interpreter and libraries take the rest).

What is measured. Each configuration runs twice per round: SHORT (2 new tokens) and LONG (--tokens) from the same
prompt. Differences between the two cancel start-up, the manifest check, the trunk and the prompt: per decode token,
seconds, bytes read from the throttled device (the cgroup's own counter), and expert bytes the runtime read (its
report). The disk-limit ratio is seconds per token / (device bytes per token / B): 1.0 is a runtime that is nothing
but its disk. Rounds interleave the configurations; the table gives medians.

Usage: python benchmarks/bench_seed.py [--workdir DIR] [--repeats 3] [--tokens 12] [--memory 2GiB] [--read-bps 0.85e9]
       [--budget 1536MiB] [--configs NAME,...] [--quick] [--json FILE] [--keep-checkpoint] [--prepare-only]
`--quick`: the same bench on a 0.4 GiB model with a 96 MiB budget under a 224 MiB cap, to check the bench itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _llamacpp  # noqa: E402
import _machine  # noqa: E402
import _serve_load  # noqa: E402
from _harness import VENV_BIN, agreement, make_without_eos, split_and_sign  # noqa: E402

SEED = dict(layers=16, dense_layers=1, experts=128, experts_per_tok=8, n_group=8, topk_group=4, hidden=2048,
            intermediate=4096, moe_intermediate=768, heads=16, q_lora_rank=384, kv_lora_rank=256, vocab=4096,
            mtp_layers=0, dtype="bf16", shard_size_mb=2000)
QUICK = dict(SEED, layers=6, experts=64, hidden=512, intermediate=1024, moe_intermediate=384, heads=4, q_lora_rank=96,
             kv_lora_rank=64, vocab=1024, shard_size_mb=200)
PROMPT = "5,17,300,42"
SHORT = 2
VARIANTS = {"bf16": [], "int4": ["--quantize", "int4"]}
# llama.cpp's GGUFs of the same checkpoint (its own converter; Q4_0 by its own quantizer from the BF16 GGUF), and the
# shardtool variant each is held against.
GGUFS = {"BF16": "bf16", "Q4_0": "int4"}


@dataclass(frozen=True)
class Config:
    """One way of running verify-and-run on the machine."""

    variant: str  # a key of VARIANTS, or of GGUFS for llama.cpp
    readers: int = 2
    lookahead: bool = False
    page_cache: str | None = None  # None: the runtime's default

    @property
    def llama(self) -> bool:
        return self.variant in GGUFS

    @property
    def name(self) -> str:
        if self.llama:
            return f"llama.cpp-{self.variant}"
        parts = [self.variant, f"r{self.readers}"]
        if self.lookahead:
            parts.append("lookahead")
        if self.page_cache:
            parts.append(self.page_cache)
        return "-".join(parts)


CONFIGS = [Config("bf16", readers=r) for r in (1, 2, 4)] + [
    Config("bf16", readers=2, lookahead=True), Config("bf16", readers=4, lookahead=True),
    Config("bf16", page_cache="keep"), Config("bf16", page_cache="drop"), Config("bf16", page_cache="direct"),
    Config("int4"), Config("int4", lookahead=True), Config("int4", page_cache="keep"),
    Config("BF16"), Config("Q4_0")]


def say(msg: str) -> None:
    print(f"bench_seed: {msg}", file=sys.stderr, flush=True)


def checkpoint(work: Path, knobs: dict) -> Path:
    """The generated HF checkpoint, made (again: its values are seeded, so it is the same) when it is not there."""
    ck = work / "ck"
    if not ck.exists():
        say(f"generating the checkpoint in {ck}")
        shutil.rmtree(work / "ck.tmp", ignore_errors=True)
        make_without_eos(work / "ck.tmp", knobs, "deepseek_v3")
        (work / "ck.tmp").rename(ck)
    return ck


def prepare(work: Path, knobs: dict, keep_checkpoint: bool) -> dict[str, Path]:
    """The signed splits of VARIANTS and the key, made once and reused while the knobs (kept in a marker) stay the
    same; each under a temporary name renamed when complete. The checkpoint is removed afterwards (disk space)."""
    marker = work / "knobs.json"
    if not (marker.exists() and json.loads(marker.read_text()) == knobs):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        marker.write_text(json.dumps(knobs))
    if not (work / "bench.key").exists():
        subprocess.run([str(VENV_BIN / "shardtool"), "keygen", "--out", str(work / "bench"), "--no-passphrase"],
                       check=True, capture_output=True)
    paths = {v: work / f"split-{v}" for v in VARIANTS}
    ck = work / "ck"
    for variant, extra in VARIANTS.items():
        if paths[variant].exists():
            continue
        checkpoint(work, knobs)
        say(f"split {' '.join(extra)} + sign -> {paths[variant]}")
        split_and_sign(ck, paths[variant], f"bench/seed-{variant}", extra, work / "bench.key")
    if ck.exists() and not keep_checkpoint:
        shutil.rmtree(ck)
    return paths


def prepare_ggufs(work: Path, knobs: dict) -> dict[str, Path]:
    """llama.cpp's GGUFs (GGUFS) of the same checkpoint, generated again (the values are seeded) when it was removed;
    the checkpoint is removed afterwards."""
    paths = {f: work / f"model-{f}.gguf" for f in GGUFS}
    ck = work / "ck"
    if not paths["BF16"].exists():
        checkpoint(work, knobs)
        say(f"llama.cpp's converter -> {paths['BF16']}")
        _llamacpp.convert(ck, "bf16", paths["BF16"])
    shutil.rmtree(ck, ignore_errors=True)
    if not paths["Q4_0"].exists():
        say(f"llama.cpp's quantizer -> {paths['Q4_0']}")
        _llamacpp.quantize(paths["BF16"], paths["Q4_0"], "Q4_0")
    return paths


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def llama_argv(gguf: Path, tokens: int, report: Path) -> list[str]:
    """llama.cpp greedy on the machine: the GGUF mmap'd (its default; the cap cannot hold a copy), every weight used
    from the mapping (no repacking into private memory, which would not fit either), 2 threads, no warm-up, an F32 KV
    cache (verify-and-run's arithmetic: with llama.cpp's F16 default the first greedy token of the --quick model
    already differed)."""
    return _llamacpp.greedy_argv(gguf, [int(x) for x in PROMPT.split(",")], tokens, report, threads=2, warmup=0,
                                 repack=False, f32_kv=True)


def run_once(work: Path, model: Path, config: Config, tokens: int, machine: _machine.Machine, budget: str) -> dict:
    """verify-and-run (or llama.cpp) of `tokens` new tokens on the machine: the MachineRun's figures and the run's
    JSON report."""
    report = work / "report.json"
    report.unlink(missing_ok=True)
    argv = llama_argv(model, tokens, report) if config.llama else [
        str(VENV_BIN / "verify-and-run"), str(model), "--trust", str(work / "bench.pub"), "--prompt-ids", PROMPT,
        "--max-new-tokens", str(tokens), "--print-ids", "-q", "--memory-budget", budget,
        "--readers", str(config.readers), "--json-report", str(report),
        "--lookahead" if config.lookahead else "--no-lookahead",
        *(["--page-cache", config.page_cache] if config.page_cache else [])]
    run = _machine.run(argv, machine, data_dir=model, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"{config.name}: exit {run.returncode} (OOM kills {run.oom_kills}):\n{run.stderr[-2000:]}")
    return {"seconds": run.seconds, "device_read_bytes": run.device_read_bytes, "peak_memory_bytes":
            run.peak_memory_bytes, "oom_kills": run.oom_kills, "report": json.loads(report.read_text())}


def per_token(short: dict, long: dict, tokens: int, machine: _machine.Machine) -> dict:
    """One configuration's figures per decode token, from its SHORT and LONG runs of one round: every figure is the
    difference between the two over the extra tokens (start-up, trunk and prompt cancel)."""
    steps = tokens - SHORT
    rep, srep = long["report"], short["report"]
    seconds = (long["seconds"] - short["seconds"]) / steps
    device = (long["device_read_bytes"] - short["device_read_bytes"]) / steps
    machine_figures = {
        "seconds_per_token": seconds,
        "tokens_per_s": 1 / seconds if seconds > 0 else None,
        "device_bytes_per_token": device,
        "disk_limit_ratio": seconds / (device / machine.read_bps) if device > 0 else None,
        "peak_memory_bytes": max(short["peak_memory_bytes"], long["peak_memory_bytes"]),
        "oom_kills": short["oom_kills"] + long["oom_kills"],
        "report_decode_tokens_per_s": rep["decode_tokens_per_s"],
        "generated_ids": rep["generated_ids"],
    }
    if "bytes_read" not in rep:  # llama.cpp: its own decode counter and the machine's figures only
        return {**machine_figures, "runtime_bytes_per_token": None, "contract_cold_bytes_per_token": None}

    def thread(key: str) -> float:  # seconds the run's report gives for one kind of work
        return (rep["seconds"][key] - srep["seconds"][key]) / steps

    runtime_bytes = (rep["bytes_read"] - srep["bytes_read"]) / steps
    return {
        **machine_figures,
        "runtime_bytes_per_token": runtime_bytes,
        "contract_cold_bytes_per_token": rep["contract_expert_bytes_per_token_cold"],
        "runtime_disk_ratio": seconds / (runtime_bytes / machine.read_bps) if runtime_bytes > 0 else None,
        "expert_hit_rate": rep["cache"]["expert_hit_rate"],
        "wait_s_per_token": thread("waiting_for_shards"),
        "verify_s_per_token": thread("verify_thread"),
        "read_s_per_token": thread("read_thread"),
        "compute_s_per_token": thread("compute"),
        "page_cache": rep["cache"].get("page_cache"),
        "lookahead_recall": (rep.get("lookahead") or {}).get("recall"),
    }


def median_row(rows: list[dict]) -> dict:
    out = {}
    for key, value in rows[0].items():
        values = [r[key] for r in rows if r[key] is not None]
        numeric = values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        out[key] = statistics.median(values) if numeric else value
    out["rounds"] = len(rows)
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _cell(value, fmt: str, width: int) -> str:
    return f"{'-' if value is None else format(value, fmt):>{width}}"


def print_table(results: dict[str, dict], machine: _machine.Machine) -> None:
    print(f"\nverify-and-run and llama.cpp on the emulated machine: M = {mib(machine.memory_bytes)}, B = "
          f"{machine.read_bps / 1e9:.2f} GB/s; medians of {next(iter(results.values()))['rounds']} interleaved rounds, "
          "per decode token. device: read from the throttled disk; runtime: what the shard store read; disk ratio: "
          "seconds / (device bytes / B); wait, read, verify, compute: seconds (read and verify on the reader threads)")
    print(f"{'config':<22} {'tok/s':>6} {'s/tok':>6} {'device':>9} {'runtime':>9} {'cold':>9} {'dev/rt':>6} "
          f"{'disk':>5} {'hit':>4} {'wait':>5} {'read':>5} {'verify':>6} {'compute':>7} {'peak/M':>6} {'OOM':>3}")
    for name, r in results.items():
        get = r.get
        rt = get("runtime_bytes_per_token")
        print(f"{name:<22} {r['tokens_per_s']:>6.3f} {r['seconds_per_token']:>6.2f} "
              f"{mib(r['device_bytes_per_token']):>9} {mib(rt) if rt else '-':>9} "
              f"{mib(get('contract_cold_bytes_per_token')) if get('contract_cold_bytes_per_token') else '-':>9} "
              f"{_cell(r['device_bytes_per_token'] / rt if rt else None, '.2f', 6)} "
              f"{_cell(get('disk_limit_ratio'), '.2f', 5)} {_cell(get('expert_hit_rate'), '.0%', 4)} "
              f"{_cell(get('wait_s_per_token'), '.2f', 5)} {_cell(get('read_s_per_token'), '.2f', 5)} "
              f"{_cell(get('verify_s_per_token'), '.2f', 6)} {_cell(get('compute_s_per_token'), '.2f', 7)} "
              f"{r['peak_memory_bytes'] / machine.memory_bytes:>6.2f} {r['oom_kills']:>3}")


def ratios(results: dict[str, dict]) -> list[str]:
    """The issue's targets that one run of this bench decides, as lines."""
    lines = []
    for variant in VARIANTS:
        base, look = results.get(f"{variant}-r2"), results.get(f"{variant}-r2-lookahead")
        if base and look:
            gain = base["seconds_per_token"] / look["seconds_per_token"] - 1
            lines.append(f"{variant}: --lookahead vs off, 2 readers: {gain:+.0%} tokens/s "
                         f"(recall {look.get('lookahead_recall') or 0:.0%}, device bytes/token "
                         f"{look['device_bytes_per_token'] / base['device_bytes_per_token']:.2f} x)")
    for fmt, variant in GGUFS.items():
        ours, theirs = results.get(f"{variant}-r2"), results.get(f"llama.cpp-{fmt}")
        if ours and theirs:
            lines.append(f"{variant} / llama.cpp {fmt} mmap: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f} x "
                         f"tokens/s; {agreement(ours['generated_ids'], theirs['generated_ids'])}")
    for name, r in results.items():
        if name.startswith("bf16") and "bf16-r2" in results \
                and r["generated_ids"] != results["bf16-r2"]["generated_ids"]:
            lines.append(f"{name}: tokens differ from bf16-r2's")
    return lines


def serve_argv(work: Path, model: Path, budget: str, tokens: int, clients: tuple[int, ...]) -> list[str]:
    """`shardtool serve` on the bf16 model, the runtime's defaults, a batch for the most clients."""
    return [str(VENV_BIN / "shardtool"), "serve", str(model), "--trust", str(work / "bench.pub"), "--port", "0",
            "--memory-budget", budget, "--max-context", str(len(PROMPT.split(",")) + tokens + 4),
            "--max-batch", str(max(clients)), "--state-dir", str(work / "serve-state")]


def llama_server_argv(gguf: Path, tokens: int, clients: tuple[int, ...]) -> tuple[list[str], str]:
    """llama.cpp's own server on the BF16 GGUF, one slot per client (`-np`), 2 threads; its argv and base URL."""
    import socket

    with socket.socket() as s:  # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = max(clients) * (len(PROMPT.split(",")) + tokens + 8)
    return _llamacpp.server_argv(gguf, port, parallel=max(clients), ctx_size=ctx, threads=2), \
        f"http://127.0.0.1:{port}"


def measure_serve(work: Path, argv: list[str], data_dir: Path, machine: _machine.Machine, tokens: int,
                  clients: tuple[int, ...], url: str | None = None) -> list[dict]:
    """A server (`argv`) on the machine, 1, 4 and 8 concurrent `openai` clients each asking for the same greedy
    completion of PROMPT: one row per client count."""
    rows = _serve_load.measure_serving(argv, machine, data_dir, model="bench/seed-bf16",
                                       prompt=[int(x) for x in PROMPT.split(",")], max_tokens=tokens,
                                       clients=clients, log=work / "serve.log", ready_timeout=1800, url=url)
    out = []
    for r in rows:
        out.append({"clients": r.clients, "tokens": r.tokens, "seconds": r.seconds, "tokens_per_s": r.tokens_per_s,
                    "latency_p50_s": r.latency_p50_s, "expert_bytes_per_token": r.expert_bytes_per_token,
                    "device_bytes_per_token": r.device_bytes_per_token, "peak_memory_bytes": r.peak_memory_bytes,
                    "server_rss_peak_bytes": r.server_rss_peak_bytes, "oom_kills": r.oom_kills,
                    "all_alike": r.agree, "errors": list(r.errors)})
        say(f"{Path(argv[0]).name}, {r.clients} clients: {r.tokens_per_s:.2f} tok/s, "
            f"{mib(r.device_bytes_per_token)} device/token")
    return out


def print_serve(title: str, rounds: list[list[dict]]) -> None:
    print(f"\n{title} on the same machine, bf16, medians of {len(rounds)} rounds (aggregate over the clients)")
    print(f"{'clients':>7} {'tok/s':>7} {'vs 1':>5} {'device/tok':>10} {'expert/tok':>10} {'p50 s':>6} {'alike':>5}")
    by = {r["clients"]: [x for rs in rounds for x in rs if x["clients"] == r["clients"]] for r in rounds[0]}
    one = statistics.median(x["tokens_per_s"] for x in by[min(by)])
    for n, xs in by.items():
        tps = statistics.median(x["tokens_per_s"] for x in xs)
        expert = [x["expert_bytes_per_token"] for x in xs if x["expert_bytes_per_token"] is not None]
        print(f"{n:>7} {tps:>7.2f} {tps / one:>5.2f} {mib(statistics.median(x['device_bytes_per_token'] for x in xs)):>10} "
              f"{mib(statistics.median(expert)) if expert else '-':>10} "
              f"{statistics.median(x['latency_p50_s'] for x in xs):>6.1f} {str(all(x['all_alike'] for x in xs)):>5}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/shardtool-bench-seed"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--memory", default="2GiB")
    ap.add_argument("--read-bps", default="0.85e9")
    ap.add_argument("--budget", default="1536MiB")
    ap.add_argument("--configs", default="", help="comma-separated config names (default: all; none: serving only)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep-checkpoint", action="store_true", help="keep the generated HF checkpoint (GGUF conversion)")
    ap.add_argument("--prepare-only", action="store_true", help="make the signed splits and stop")
    ap.add_argument("--serve", default="1,4,8", help="client counts for serve on the bf16 model ('' : no serving)")
    ap.add_argument("--serve-tokens", type=int, default=16)
    ap.add_argument("--serve-llama", action="store_true", help="llama.cpp's llama-server -np N on the BF16 GGUF too")
    a = ap.parse_args()
    if a.quick:
        a.memory, a.budget, a.workdir = "224MiB", "96MiB", a.workdir.with_name(a.workdir.name + "-quick")
    machine = _machine.Machine(_machine.parse_size(a.memory), _machine.parse_size(a.read_bps))
    configs = [] if a.configs == "none" else [c for c in CONFIGS if not a.configs or c.name in a.configs.split(",")]
    if a.tokens <= SHORT or not (configs or a.configs == "none"):
        ap.error(f"--tokens must exceed {SHORT} and --configs must be none or name at least one of "
                 f"{', '.join(c.name for c in CONFIGS)}")
    knobs = QUICK if a.quick else SEED
    built = _llamacpp.available()
    if any(c.llama for c in configs) and not built:
        say(f"llama.cpp is not built ({built.reason}): its rows are left out")
        configs = [c for c in configs if not c.llama]
    paths = prepare(a.workdir, knobs, a.keep_checkpoint or any(c.llama for c in configs))
    if any(c.llama for c in configs):
        paths.update(prepare_ggufs(a.workdir, knobs))
    say(", ".join(f"{v}: {dir_bytes(p) / 2**30:.2f} GiB" for v, p in paths.items()))
    if a.prepare_only:
        return 0
    rows: dict[str, list[dict]] = {c.name: [] for c in configs}
    try:
        for round_ in range(a.repeats):
            for c in configs:
                short = run_once(a.workdir, paths[c.variant], c, SHORT, machine, a.budget)
                long = run_once(a.workdir, paths[c.variant], c, a.tokens, machine, a.budget)
                rows[c.name].append(per_token(short, long, a.tokens, machine))
                r = rows[c.name][-1]
                say(f"round {round_ + 1}: {c.name}: {r['seconds_per_token']:.2f} s/token, "
                    f"{mib(r['device_bytes_per_token'])} device/token, disk ratio "
                    f"{_cell(r['disk_limit_ratio'], '.2f', 0)}")
    except _machine.MachineUnavailableError as e:
        say(f"no emulated machine here: {e}")
        return 3
    results = {name: median_row(rs) for name, rs in rows.items() if rs}
    if results:
        print_table(results, machine)
        for line in ratios(results):
            print(line)
    clients = tuple(int(x) for x in a.serve.split(",") if x)
    servers = {"serve": lambda: (serve_argv(a.workdir, paths["bf16"], a.budget, a.serve_tokens, clients), None)}
    if clients and a.serve_llama and not _llamacpp.available(server=True):
        say(f"llama-server is not built ({_llamacpp.available(server=True).reason}): its rows are left out")
    elif clients and a.serve_llama:
        gguf = prepare_ggufs(a.workdir, knobs)["BF16"]
        servers["llama-server"] = lambda: llama_server_argv(gguf, a.serve_tokens, clients)
    serving: dict[str, list[list[dict]]] = {name: [] for name in servers} if clients else {}
    for _ in range(a.repeats if clients else 0):
        for name, start in servers.items():  # interleaved, a fresh server each round
            argv, url = start()
            serving[name].append(measure_serve(a.workdir, argv, paths["bf16"], machine, a.serve_tokens, clients,
                                               url))
    for name, rounds in serving.items():
        print_serve(name, rounds)
    if a.json:
        a.json.write_text(json.dumps({"machine": {"memory_bytes": machine.memory_bytes, "read_bps": machine.read_bps},
                                      "budget": a.budget, "tokens": a.tokens, "results": results, "rounds": rows,
                                      "serve": serving}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
