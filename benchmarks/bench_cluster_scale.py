"""The case a cluster exists for (issue 39): a model larger than one machine's memory, held in memory by the nodes
together, against one machine of the same memory streaming it from its disk. Every process runs on an emulated machine
(benchmarks/_machine.py: a cgroup v1/v2 memory cap that charges the page cache too, a read-bandwidth throttle on the
data disk, caches dropped).

The model: bench_seed's DeepSeek-V3 layout (examples/make_tiny_moe.py, no EOS) cut to 5 layers, the first dense, 4 MoE
layers of 120 routed experts (top-8, 8 groups, 4 chosen) plus a shared expert, hidden 2048, expert width 384, bf16:
4.5 MiB per expert, 2.11 GiB of routed experts, 2.28 GiB on disk; split and signed once, then reused.

Set-ups, each against the same reference, in interleaved rounds:
  single       one verify-and-run on a machine capped at M reading the model at B (--page-cache auto)
  N nodes, R   `shardtool plan` on N nodes with R copies; a Ray head on 127.0.0.1; each node's expert-holding process
               (its Ray actor's worker) moved into a machine of its own capped at the node's cap (2 nodes: M; 3 nodes,
               R = 2: the least cap that holds its two-thirds share), reading at B; the coordinator (verify-and-run
               --cluster) on a machine of its own capped at M. One warm-up run fills the nodes' caches.
Figures per run: tokens/s after the first WARMUP tokens (times each id reached stdout), device bytes per token over
the same tokens from the cgroups (the nodes' and the coordinator's summed), the greedy ids; medians over rounds.
Then `serve` on the single machine against `serve --cluster` (coordinator capped at M) with 8 concurrent clients,
`--serve-repeats` interleaved rounds, each server warmed up by one request first.
With M above the model (e.g. `--memory 8GiB --read-bps 1.5e9 --serve-clients 1`) the model fits one process: the
warm serving rounds then give "cluster decode / one process" at a batch of one.

Usage: python benchmarks/bench_cluster_scale.py [--workdir /work/scratch/scale39] [--memory 1.5GiB] [--read-bps 0.85e9]
       [--repeats 3] [--tokens 24] [--layouts 2x1,3x2,2x1p] [--serve-clients 8] [--serve-tokens 16]
       [--serve-repeats 1] [--cluster-graph] [--quick] [--json F]
`--quick`: bench_seed's small model (0.2 GiB of experts) under 512 MiB caps, to check the bench itself.
A layout NxRp (e.g. 2x1p) is a pipeline plan (`shardtool plan --pipeline`): each node runs a span of whole layers,
trunk and experts, so a token makes N rounds instead of one per MoE layer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

MIB = 2**20
GIB = 2**30
MODEL_ID = "bench/cluster-scale"
WARMUP = 4  # tokens left out of each run's rate: the first ones fill caches
# The part of a node's cap its --memory-budget does not get: the actor worker's interpreter, numpy and Ray's core
# worker (measured ~190 MiB resident before any expert is loaded).
ACTOR_OVERHEAD = 224 * MIB
# The part of the single machine's (and a coordinator's) cap its --memory-budget does not get: the interpreter and
# libraries, and a coordinator's Ray driver and proxy.
PROCESS_OVERHEAD = 384 * MIB
CAP_STEP = 64 * MIB  # a computed cap is rounded up to this


@dataclass(frozen=True)
class Layout:
    """N nodes holding R copies of each expert."""

    nodes: int
    replicas: int
    pipeline: bool = False  # each node holds a span of whole layers (`shardtool plan --pipeline`), not experts

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= self.nodes:
            raise ValueError(f"replicas must be in 1..nodes ({self.nodes}), got {self.replicas}")
        if self.pipeline and self.replicas != 1:
            raise ValueError("a pipeline layout has one copy of each span (R = 1)")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"n{i + 1}" for i in range(self.nodes))

    @property
    def label(self) -> str:
        return f"{self.nodes} nodes, " + ("pipeline" if self.pipeline else f"R = {self.replicas}")

    @property
    def key(self) -> str:
        return f"{self.nodes}x{self.replicas}{'p' if self.pipeline else ''}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """NxR, or NxRp for a pipeline plan ("2x1p")."""
        pipeline = text.endswith("p")
        nodes, _, replicas = text.removesuffix("p").partition("x")
        return cls(int(nodes), int(replicas or 1), pipeline)


def node_cap(planned: list[dict], *, memory: int | None, overhead: int = ACTOR_OVERHEAD) -> int:
    """The memory cap of each node from a plan's summary (`shardtool plan --json` "nodes": each its bytes_on_disk and
    memory_floor): `memory` (M) when given, else the least multiple of CAP_STEP that lets the largest node hold all
    its experts above its floor. Raises ValueError when M leaves some node less than that."""
    need = max(n["bytes_on_disk"] + n["memory_floor"] for n in planned) + overhead
    if memory is None:
        return math.ceil(need / CAP_STEP) * CAP_STEP
    if need > memory:
        raise ValueError(f"a node capped at {memory / MIB:.0f} MiB cannot hold its experts: it needs "
                         f"{need / MIB:.0f} MiB (experts + floor + {overhead / MIB:.0f} MiB of process)")
    return memory


def rate_after(stamps: list[float], warmup: int) -> float:
    """Tokens per second over the tokens after the first `warmup`: (n - 1 - warmup) intervals between stamps."""
    steps = len(stamps) - 1 - warmup
    if steps < 1:
        raise ValueError(f"{len(stamps)} tokens leave no interval after a warm-up of {warmup}")
    return steps / (stamps[-1] - stamps[warmup])


def per_token_after(readings: list[float], warmup: int) -> float:
    """A counter's growth per token over the tokens after the first `warmup` (readings taken at each token)."""
    steps = len(readings) - 1 - warmup
    if steps < 1:
        raise ValueError(f"{len(readings)} readings leave no interval after a warm-up of {warmup}")
    return (readings[-1] - readings[warmup]) / steps


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# ------------------------------------------------------------------------------------------------ the runs

import _machine  # noqa: E402
import _serve_load  # noqa: E402
import bench_cluster as bc  # noqa: E402
import bench_seed  # noqa: E402
from _harness import VENV_BIN, agreement, split_and_sign  # noqa: E402

SCALE = dict(bench_seed.SEED, layers=5, experts=120, moe_intermediate=384)
QUICK = dict(bench_seed.QUICK, layers=4)


def say(msg: str) -> None:
    print(f"bench_cluster_scale: {msg}", file=sys.stderr, flush=True)


def env(work: Path) -> dict:
    return {**os.environ, **bc.RAY_ENV, "XDG_STATE_HOME": str(work)}


def prepare(work: Path, knobs: dict) -> Path:
    """Keys, the checkpoint (bench_seed's generator), its signed split; made once while the knobs stay the same."""
    marker = work / "knobs.json"
    if not (marker.exists() and json.loads(marker.read_text()) == knobs):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        marker.write_text(json.dumps(knobs))
    for key in ("a", "op", "node-n1", "node-n2", "node-n3"):  # publisher, operator (signs plans), nodes
        if not (work / f"{key}.key").exists():
            bc.sh(VENV_BIN / "shardtool", "keygen", "--out", key, "--no-passphrase", cwd=work)
    full = work / "full"
    if not full.exists():
        bench_seed.checkpoint(work, knobs)
        say(f"split + sign -> {full}")
        split_and_sign(work / "ck", full, MODEL_ID, ["--version", "1"], work / "a.key")
    shutil.rmtree(work / "ck", ignore_errors=True)
    return full


def plan(work: Path, full: Path, layout: Layout, memory: int | None) -> tuple[Path, int, dict]:
    """A signed plan of `layout` in work/NxR (its coordinator's and nodes' directories hard-linked), with each node's
    budget its cap less ACTOR_OVERHEAD. Returns (that directory, the node cap, the plan's summary)."""
    out = work / layout.key
    out.mkdir(exist_ok=True)
    for f in work.glob("*.pub"):
        shutil.copy2(f, out / f.name)
    for f in work.glob("node-*.key"):
        shutil.copy2(f, out / f.name)

    def summary(budget: int) -> dict:
        r = bc.sh(VENV_BIN / "shardtool", "plan", full, "--trust", "a.pub", "--state-dir", out / "plan-state",
                  "--model-id", MODEL_ID, "--replicas", layout.replicas, *(["--pipeline"] if layout.pipeline else []),
                  *[x for n in layout.names for x in ("--node", f"{n}={budget},key=node-{n}.pub")],
                  "--out", out / "plan.json", "--sign-key", work / "op.key", "--json", cwd=out)
        return json.loads(r.stdout)

    cap = node_cap(summary(64 * GIB)["nodes"], memory=memory)  # what each node holds does not depend on the budget
    final = summary(cap - ACTOR_OVERHEAD)
    node_cap(final["nodes"], memory=cap)
    bc.lay_out(full, out / "plan.json", out / "a.pub", out)
    return out, cap, final


def run_argv(directory: Path, trust: Path, state: Path, tokens: int, budget: int, report: Path) -> list[str]:
    return [str(VENV_BIN / "verify-and-run"), str(directory), "--trust", str(trust), "--state-dir", str(state),
            "--model-id", MODEL_ID, "--prompt-ids", bench_seed.PROMPT, "--max-new-tokens", str(tokens),
            "--print-ids", "-q", "--memory-budget", str(budget), "--page-cache", "auto", "--json-report", str(report)]


def timed_run(argv: list[str], machine: _machine.Machine, data_dir: Path, log: Path, *, run_env: dict,
              others: list = ()) -> dict:
    """`argv` (verify-and-run --print-ids) on `machine`: each id's time, and the disk reads so far of its machine
    and of `others` (nodes' machines) at that moment; the figures after WARMUP tokens."""
    machines: list = []

    def probe() -> int:
        return sum(m.device_read_bytes() for m in machines)

    cpu0 = bc._children_cpu()
    with _machine.started(argv, machine, data_dir=data_dir, log=log, env=run_env, pipe_stdout=True) as m:
        machines[:] = [m, *others]
        ids, stamps, reads = bc.stamped_ids(m.proc.stdout, probe)
        code = m.proc.wait()
    if code != 0:
        raise RuntimeError(f"{Path(argv[0]).name} exited {code} (OOM kills {m.run.oom_kills}): {m.log_text()[-2000:]}")
    return {"ids": ids, "tokens_per_s": rate_after(stamps, WARMUP), "device_bytes_per_token":
            per_token_after(reads, WARMUP), "peak_memory_bytes": m.run.peak_memory_bytes, "oom_kills": m.run.oom_kills,
            "seconds": m.run.seconds, "cpu_seconds": bc._children_cpu() - cpu0}


def single_budget(machine: _machine.Machine, args) -> int:
    """The single machine's --memory-budget: --single-budget, or its cap less PROCESS_OVERHEAD."""
    return _machine.parse_size(args.single_budget) if args.single_budget else machine.memory_bytes - PROCESS_OVERHEAD


def single_run(work: Path, full: Path, machine: _machine.Machine, tokens: int, budget: int) -> dict:
    argv = run_argv(full, work / "a.pub", work / "state-single", tokens, budget, work / "report-single.json")
    return timed_run(argv, machine, full, work / "single.log", run_env=env(work))


def cluster_run(out: Path, address: str, machine: _machine.Machine, tokens: int, nodes: list) -> dict:
    argv = run_argv(out / "coordinator", out / "a.pub", out / "state-coordinator", tokens,
                    machine.memory_bytes - PROCESS_OVERHEAD, out / "report-cluster.json")
    argv += ["--cluster", address, "--plan", str(out / "plan.json"), "--plan-trust", str(out / "op.pub")]
    return timed_run(argv, machine, out, out / "coordinator.log", run_env=env(out), others=nodes)


def serve_rows(argv: list[str], machine: _machine.Machine, data_dir: Path, log: Path, run_env: dict,
               clients: int, tokens: int) -> dict:
    rows = _serve_load.measure_serving(argv, machine, data_dir, model=MODEL_ID,
                                       prompt=[int(x) for x in bench_seed.PROMPT.split(",")], max_tokens=tokens,
                                       clients=(clients,), log=log, env=run_env, ready_timeout=1200)
    r = rows[-1]
    return {"clients": r.clients, "tokens_per_s": r.tokens_per_s, "latency_p50_s": r.latency_p50_s,
            "device_bytes_per_token": r.device_bytes_per_token, "all_alike": r.agree, "errors": list(r.errors)}


def serve_argv(directory: Path, trust: Path, state: Path, budget: int, tokens: int, clients: int) -> list[str]:
    return [str(VENV_BIN / "shardtool"), "serve", str(directory), "--trust", str(trust), "--model-id", MODEL_ID,
            "--port", "0",
            "--memory-budget", str(budget), "--max-context", str(len(bench_seed.PROMPT.split(",")) + tokens + 4),
            "--max-batch", str(clients), "--state-dir", str(state)]


def serve_rounds(work: Path, full: Path, out: Path, address: str, machine: _machine.Machine, args) -> dict:
    """`serve` on the single machine and `serve --cluster` (coordinator capped at M), `args.serve_repeats` interleaved
    rounds, each server warmed up with one request first: {"single": median row, "cluster": median row, "rounds":
    [{"single": row, "cluster": row}, ...]} (a median row: the round whose tok/s is the median's)."""
    rounds = []
    for i in range(args.serve_repeats):
        single = serve_rows(serve_argv(full, work / "a.pub", work / "serve-state", single_budget(machine, args),
                                       args.serve_tokens, args.serve_clients), machine, full,
                            work / "serve-single.log", env(work), args.serve_clients, args.serve_tokens)
        argv = serve_argv(out / "coordinator", out / "a.pub", out / "serve-state",
                          machine.memory_bytes - PROCESS_OVERHEAD, args.serve_tokens, args.serve_clients)
        argv += ["--cluster", address, "--plan", str(out / "plan.json"), "--plan-trust", str(out / "op.pub")]
        argv += ["--cluster-graph"] if args.cluster_graph else []
        cluster = serve_rows(argv, machine, out, out / "serve-cluster.log", env(out), args.serve_clients,
                             args.serve_tokens)
        rounds.append({"single": single, "cluster": cluster})
        say(f"serving round {i + 1}, {args.serve_clients} clients: single {single['tokens_per_s']:.2f} tok/s, cluster "
            f"{cluster['tokens_per_s']:.2f} tok/s ({cluster['tokens_per_s'] / single['tokens_per_s']:.2f} x)")
    return {name: median_row([r[name] for r in rounds]) for name in ("single", "cluster")} | {"rounds": rounds}


def median_row(rows: list[dict]) -> dict:
    """The row whose tokens_per_s is the (lower) median of `rows`."""
    ordered = sorted(rows, key=lambda r: r["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def measure_layout(work: Path, full: Path, layout: Layout, machine: _machine.Machine, args) -> dict:
    """Interleaved rounds of the single machine and this layout's cluster (one Ray head, nodes on their machines),
    then serving at `args.serve_clients` clients; the cluster and the machines are ended whatever happens."""
    out, cap, summary = plan(work, full, layout, machine.memory_bytes if layout.replicas == 1 else None)
    node_machine = _machine.Machine(cap, machine.read_bps)
    say(f"{layout.label}: each node capped at {cap / MIB:.0f} MiB, budget {(cap - ACTOR_OVERHEAD) / MIB:.0f} MiB, "
        f"holding {max(n['bytes_on_disk'] for n in summary['nodes']) / MIB:.0f} MiB of experts")
    bc.ray_token(out)
    with contextlib.ExitStack() as stack:
        holds = {n: stack.enter_context(_machine.holding(node_machine, data_dir=out)) for n in layout.names}
        cluster = bc.LoopbackCluster(out, cap - ACTOR_OVERHEAD, names=layout.names,
                                     on_node=lambda name, pid: holds[name].adopt(pid))
        stack.callback(cluster.stop)
        nodes = list(holds.values())
        say(f"{layout.label}: up at {cluster.address}; warm-up run")
        warm = cluster_run(out, cluster.address, machine, args.tokens, nodes)
        rounds: dict[str, list[dict]] = {"single": [], "cluster": []}
        for i in range(args.repeats):
            rounds["single"].append(single_run(work, full, machine, args.tokens, single_budget(machine, args)))
            ray0 = bc.session_cpu(cluster.head.proc.pid)
            rounds["cluster"].append(cluster_run(out, cluster.address, machine, args.tokens, nodes))
            rounds["cluster"][-1]["ray_cpu_seconds"] = bc.session_cpu(cluster.head.proc.pid) - ray0
            say(f"{layout.label} round {i + 1}: single {rounds['single'][-1]['tokens_per_s']:.2f} tok/s, cluster "
                f"{rounds['cluster'][-1]['tokens_per_s']:.2f} tok/s")
        node_peaks = {n: h.readings()[0] for n, h in holds.items()}
        node_ooms = {n: h.readings()[2] for n, h in holds.items()}
        cpu = {"ray_session_cpu_seconds": bc.session_cpu(cluster.head.proc.pid)}
        serving = {}
        if args.serve_clients:
            serving = serve_rounds(work, full, out, cluster.address, machine, args)
    knobs = json.loads((work / "knobs.json").read_text())
    floor = max(n["memory_floor"] for n in summary["nodes"])
    single_cache = single_budget(machine, args) - summary["coordinator"]["bytes_on_disk"] - floor
    prediction = {"single": predicted(knobs, summary, 1, 1, single_cache, machine.read_bps),
                  "cluster": predicted(knobs, summary, layout.nodes, layout.replicas, cap - ACTOR_OVERHEAD - floor,
                                       machine.read_bps)}
    return {"layout": {"nodes": layout.nodes, "replicas": layout.replicas, "pipeline": layout.pipeline},
            "node_cap_bytes": cap,
            "predicted_seconds_per_token": prediction, "single_budget_bytes": single_budget(machine, args),
            "node_budget_bytes": cap - ACTOR_OVERHEAD, "plan": summary, "warmup_run": warm, "rounds": rounds,
            "node_peak_memory_bytes": node_peaks, "node_oom_kills": node_ooms, **cpu, "serve": serving}


def predicted(knobs: dict, summary: dict, nodes: int, replicas: int, cache_bytes: int, read_bps: int) -> float:
    """scale_model's seconds per token (docs/scaling.md: disk + network at 25 Gb/s; no compute, no round trips) for
    this model on `nodes` nodes with `replicas` copies, each keeping `cache_bytes` of experts, reading at `read_bps`.
    The expert size is the plan's: its nodes' bytes over the expert files they hold."""
    planned = summary["nodes"]
    expert_bytes = round(sum(n["bytes_on_disk"] for n in planned) / sum(n["files"] for n in planned))
    cfg = bc.ModelConfig("bench_cluster_scale", moe_layers=knobs["layers"] - knobs["dense_layers"],
                         experts=knobs["experts"], active=knobs["experts_per_tok"], expert_bytes=expert_bytes,
                         hidden=knobs["hidden"])
    return bc.scale_model(cfg, nodes, replicas, node_read_gbps=read_bps / 1e9, node_memory_bytes=cache_bytes,
                          samples=2000)["seconds_per_token"]


def report(results: dict, machine: _machine.Machine, model_bytes: int, expert_bytes: int) -> bool:
    """The table; True when every run of every set-up made the single machine's first run's ids."""
    print(f"\n## a {model_bytes / GIB:.2f} GiB model ({expert_bytes / GIB:.2f} GiB of routed experts), "
          f"{model_bytes / machine.memory_bytes:.2f} x M; M = {machine.memory_bytes / MIB:.0f} MiB, B = "
          f"{machine.read_bps / 1e9:.2f} GB/s; tokens/s after {WARMUP} tokens, medians of interleaved rounds")
    print(f"{'set-up':<28} {'node cap':>9} {'tok/s':>7} {'x single':>8} {'device/token':>13} {'runs tok/s':<24} "
          f"{'same ids':>8}")
    reference = None
    same = True
    for res in results.values():
        single = res["rounds"]["single"]
        reference = reference or single[0]["ids"]
        base = median_of(single, "tokens_per_s")
        label = Layout(**res["layout"]).label
        for name, rows, cap in (("single machine", single, machine.memory_bytes),
                                (label, res["rounds"]["cluster"], res["node_cap_bytes"])):
            alike = all(r["ids"] == reference for r in rows)
            same &= alike
            tps = median_of(rows, "tokens_per_s")
            print(f"{name:<28} {cap / MIB:>6.0f} Mi {tps:>7.2f} {tps / base:>8.2f} "
                  f"{median_of(rows, 'device_bytes_per_token') / MIB:>9.1f} MiB "
                  f"{', '.join(format(r['tokens_per_s'], '.2f') for r in rows):<24} {str(alike):>8}")
            if not alike:
                print(f"    ids: {agreement([int(x) for x in rows[0]['ids']], [int(x) for x in reference])}")
        for name in ("single", "cluster") if res["serve"] else ():
            s = res["serve"][name]
            runs = ", ".join(format(r[name]["tokens_per_s"], ".2f") for r in res["serve"]["rounds"])
            print(f"serve {name:<22} {s['clients']:>3} clients {s['tokens_per_s']:>7.2f} tok/s (median; rounds {runs}), "
                  f"device {s['device_bytes_per_token'] / MIB:.1f} MiB/token, all alike {s['all_alike']}, "
                  f"errors {len(s['errors'])}")
        if res["serve"]:
            ratios = [r["cluster"]["tokens_per_s"] / r["single"]["tokens_per_s"] for r in res["serve"]["rounds"]]
            print(f"serve --cluster / serve: median of rounds {statistics.median(ratios):.2f} x "
                  f"({', '.join(format(x, '.2f') for x in ratios)})")
        print(f"budgets: single machine {res['single_budget_bytes'] / MIB:.0f} MiB, coordinator "
              f"{(machine.memory_bytes - PROCESS_OVERHEAD) / MIB:.0f} MiB (both capped at M), each node "
              f"{res['node_budget_bytes'] / MIB:.0f} MiB")
        pred = res["predicted_seconds_per_token"]
        print(f"formula (disk + net, no compute or round trips): single {pred['single']:.3f} s/token, cluster "
              f"{pred['cluster']:.4f} s/token; measured {1 / median_of(single, 'tokens_per_s'):.3f} and "
              f"{1 / median_of(res['rounds']['cluster'], 'tokens_per_s'):.3f}")
        print(f"CPU s per run (whole run, start-up included): single machine {median_of(single, 'cpu_seconds'):.1f}; "
              f"coordinator with its proxy {median_of(res['rounds']['cluster'], 'cpu_seconds'):.1f}, Ray session "
              f"(head, raylet, the nodes' actors) {median_of(res['rounds']['cluster'], 'ray_cpu_seconds'):.1f}; wall s "
              f"{median_of(single, 'seconds'):.1f} and {median_of(res['rounds']['cluster'], 'seconds'):.1f}")
        print(f"node peaks (MiB): {', '.join(f'{n} {v / MIB:.0f}' for n, v in res['node_peak_memory_bytes'].items())};"
              f" node OOM kills {sum(res['node_oom_kills'].values())}; Ray session CPU s "
              f"{res['ray_session_cpu_seconds']:.1f}")
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/work/scratch/scale39"))
    ap.add_argument("--memory", default="1.5GiB", help="M: the single machine's, the coordinator's and (R = 1) each "
                                                       "node's memory cap")
    ap.add_argument("--read-bps", default="0.85e9")
    ap.add_argument("--single-budget", help="the single machine's --memory-budget (default: M less 384 MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--layouts", default="2x1,3x2", help="NODESxREPLICAS,...")
    ap.add_argument("--serve-clients", type=int, default=8, help="0: no serving")
    ap.add_argument("--serve-tokens", type=int, default=16)
    ap.add_argument("--serve-repeats", type=int, default=1, help="interleaved serving rounds (each server warmed up)")
    ap.add_argument("--cluster-graph", action="store_true", help="serve --cluster with --cluster-graph")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.quick:
        a.memory, a.workdir = "512MiB", a.workdir.with_name(a.workdir.name + "-quick")
    if a.tokens <= WARMUP + 1:
        ap.error(f"--tokens must exceed {WARMUP + 1}")
    machine = _machine.Machine(_machine.parse_size(a.memory), _machine.parse_size(a.read_bps))
    layouts = [Layout.parse(x) for x in a.layouts.split(",") if x]
    full = prepare(a.workdir, QUICK if a.quick else SCALE)
    results = {}
    started = time.time()
    try:
        for layout in layouts:
            results[layout.key] = measure_layout(a.workdir, full, layout, machine, a)
    except _machine.MachineUnavailableError as e:
        say(f"no emulated machine here: {e}")
        return 3
    model_bytes = bench_seed.dir_bytes(full)
    first = next(iter(results.values()))["plan"]
    expert_bytes = sum(n["bytes_on_disk"] for n in first["nodes"]) // max(first["replicas"], 1)
    same = report(results, machine, model_bytes, expert_bytes)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores; "
          f"{(time.time() - started) / 60:.1f} min")
    if a.json:
        a.json.write_text(json.dumps({"machine": {"memory_bytes": machine.memory_bytes, "read_bps": machine.read_bps},
                                      "model_bytes": model_bytes, "tokens": a.tokens, "warmup": WARMUP,
                                      "results": results, "load": load}, indent=1))
    if not same:
        print("bench_cluster_scale: some run's tokens differ from the single machine's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
