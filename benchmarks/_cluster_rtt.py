"""Where a cluster's layer round trip goes (issue 39): a coordinator -> nodes -> coordinator round at batch one,
timed whole and in its parts, on a local Ray head with bench_cluster's loopback model and two `shardtool node`s.

Parts, each a median over `--calls` calls (layers and top-k experts drawn at random, fixed seed):
  round          RemoteExperts.run(layer, x[1, H], rows): what one MoE layer costs the coordinator
  node work      the `seconds` each node signs into its reply (checks, store, expert, digests)
  proxy + Ray    the coordinator's pipe to its proxy and the proxy's Ray calls (round less node work)
  ray info()     a bare Ray driver calling a node's info() (Ray's round trip plus one signature), from a child
  ray echo       a bare Ray driver calling an actor of its own that returns its [1, H] argument (Ray's floor);
                 also without Ray's task events (`enable_task_events=False`), and as a Compiled Graph

Also the CPU seconds per round of the coordinator and of its proxy (on a machine whose cores the nodes, Ray and
other jobs share, CPU turns into latency). bench_cluster.py prints the round from `coordinator_rounds` beside its
decode figures.

With --graph the coordinator's rounds go through a Ray Compiled Graph (`connect_cluster(graph=True)`).
With --compare plain,graph --repeats 3 the given modes run interleaved on one cluster (plain, graph, plain, graph,
...), each run a fresh coordinator, and a table gives each run's median and the median of the runs, with the CPU
seconds per round of the coordinator, its proxy and the Ray session (GCS, raylet, the nodes' actor workers).
--pin puts the Ray session (the nodes) on CPU 1 and this process and its proxy on CPU 0: a separate row for
"what separate machines would give", never in place of the plain figure.

--scale-dir WORKDIR/2x1 times the rounds of bench_cluster_scale's model (top-8 of 120, hidden 2048) on that layout's
nodes and plan, every node holding its share (made by a bench_cluster_scale run first).

Usage: python benchmarks/_cluster_rtt.py [--calls 300] [--graph | --compare plain,graph --repeats 3] [--pin]
                                         [--workdir DIR] [--node-budget MIB] [--skip-bare] [--scale-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cluster as bc  # noqa: E402

MIB = 2**20


def _ms(values) -> str:
    return f"{statistics.median(values) * 1e3:.3f} ms (p10 {np.percentile(values, 10) * 1e3:.3f}, " \
           f"p90 {np.percentile(values, 90) * 1e3:.3f})"


@dataclass(frozen=True)
class RoundModel:
    """What a round asks: a MoE layer, `top_k` of `experts`, a [1, hidden] row; the manifest the plan is for."""

    moe_layers: tuple[int, ...]
    experts: int
    top_k: int
    hidden: int
    manifest: str  # relative to the work directory
    warmup: int = 20  # rounds left out: the first calls load and verify the experts


LOOP = RoundModel(tuple(range(bc.LOOP_MODEL["layers"])), bc.LOOP_MODEL["experts"], bc.LOOP_MODEL["experts_per_tok"],
                  bc.LOOP_MODEL["hidden"], "full/manifest.msgpack")


def scale_model(work: Path) -> RoundModel:
    """The rounds of a bench_cluster_scale layout directory (its NxR folder): the model's config.json decides."""
    cfg = json.loads((work / "coordinator" / "config.json").read_text())
    dense = cfg.get("first_k_dense_replace", 0)
    return RoundModel(tuple(range(dense, cfg["num_hidden_layers"])), cfg["n_routed_experts"],
                      cfg["num_experts_per_tok"], cfg["hidden_size"], "coordinator/manifest.msgpack",
                      warmup=400)  # 480 experts of 4.5 MiB: loaded and verified once, before any round counts


def coordinator_rounds(work: Path, address: str, calls: int, *, graph: bool = False, session: int | None = None,
                       on_proxy=None, model: RoundModel = LOOP, on_timed=None) -> dict:
    """Timed RemoteExperts.run at batch one, through the proxy, as `--cluster` runs it; CPU seconds per timed round
    of this process, of the proxy and (given the Ray head's session id `session`) of the Ray session; `on_proxy(pid)`
    is called with the proxy's pid before the first round (e.g. to pin it), `on_timed()` when the timed rounds
    start (after `model.warmup` rounds)."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import connect_cluster, load_signed_plan

    verified = load_trusted_manifest(work / model.manifest, [load_public_key(work / "a.pub")], 1,
                                     work / "probe-state")
    plan = load_signed_plan(work / "plan.json", verified, [load_public_key(work / "op.pub")])
    remote = connect_cluster(address, plan, graph=graph)
    if on_proxy is not None:
        on_proxy(remote.transport.pid)
    rng = np.random.default_rng(0)
    node_bodies: list[bytes] = []  # parsed after the round's clock stops: the bench's own JSON is not the round's
    transport = remote.transport
    submit, result = transport.submit, transport.result

    def timed_result(pending, timeout):
        reply = result(pending, timeout)
        node_bodies.append(reply["body"])
        return reply

    transport.result = timed_result
    rounds, node_work = [], []
    total = calls + model.warmup
    try:
        for i in range(total):
            if i == model.warmup:
                ray_cpu = bc.session_cpu(session) if session is not None else 0.0
                proxy_cpu, cpu = _cpu_seconds(transport.pid), time.process_time()
                if on_timed is not None:
                    on_timed()
            layer = model.moe_layers[int(rng.integers(len(model.moe_layers)))]
            experts = sorted(int(e) for e in rng.choice(model.experts, size=model.top_k, replace=False))
            x = rng.standard_normal((1, model.hidden), dtype=np.float32)
            rows = {e: np.zeros(1, dtype=np.int64) for e in experts}
            node_bodies.clear()
            t0 = time.perf_counter()
            outputs, missing = remote.run(layer, x, rows)
            dt = time.perf_counter() - t0
            assert not missing and set(outputs) == set(experts), missing
            if i >= model.warmup:  # the first calls load and verify the experts: not a round trip's cost
                rounds.append(dt)
                node_work.append(max(json.loads(body)["seconds"] for body in node_bodies))
        proxy_cpu, cpu = _cpu_seconds(transport.pid) - proxy_cpu, time.process_time() - cpu
        ray_cpu = bc.session_cpu(session) - ray_cpu if session is not None else float("nan")
    finally:
        transport.submit, transport.result = submit, result
        remote.close()
    return {"round": rounds, "node_work": node_work, "calls_per_round": remote.stats.calls / total,
            "proxy_cpu": proxy_cpu / calls, "cpu": cpu / calls, "ray_cpu": ray_cpu / calls}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return bc.stat_cpu_seconds(stat[stat.rindex(")") + 2:].split())


_RAY_CHILD = r'''
import json, sys, time, statistics
import numpy as np
import ray
from shardtool.runtime.engine._cluster_node import NAMESPACE, actor_name, new_nonce
address, calls, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
out = {}
node = ray.get_actor(actor_name("n1"), namespace=NAMESPACE)
t = []
for i in range(calls + 10):
    t0 = time.perf_counter(); ray.get(node.info.remote(new_nonce())); t.append(time.perf_counter() - t0)
out["ray_info"] = t[10:]

@ray.remote(num_cpus=0, max_concurrency=1)
class Echo:
    def echo(self, x):
        return x
echo = Echo.remote()
x = np.ones((1, hidden), dtype=np.float32)
t = []
for i in range(calls + 10):
    t0 = time.perf_counter(); ray.get(echo.echo.remote(x)); t.append(time.perf_counter() - t0)
out["ray_echo"] = t[10:]
t = []
quiet = echo.echo.options(enable_task_events=False)
for i in range(calls + 10):
    t0 = time.perf_counter(); ray.get(quiet.remote(x)); t.append(time.perf_counter() - t0)
out["ray_echo_without_task_events"] = t[10:]
t = []
for i in range(calls + 10):
    t0 = time.perf_counter(); ray.get(node.info.options(enable_task_events=False).remote(new_nonce())); t.append(time.perf_counter() - t0)
out["ray_info_without_task_events"] = t[10:]
try:
    from ray.dag import InputNode
    with InputNode() as inp:
        dag = echo.echo.bind(inp)
    compiled = dag.experimental_compile()
    t = []
    for i in range(calls + 10):
        t0 = time.perf_counter(); ray.get(compiled.execute(x)); t.append(time.perf_counter() - t0)
    out["ray_echo_compiled"] = t[10:]
    compiled.teardown()
except Exception as e:
    out["compiled_error"] = f"{type(e).__name__}: {str(e)[:300]}"
print("RESULT " + json.dumps(out))
ray.kill(echo)
'''


def bare_ray(work: Path, address: str, calls: int, hidden: int = LOOP.hidden) -> dict:
    proc = subprocess.run([sys.executable, "-c", _RAY_CHILD, address, str(calls), str(hidden)],
                          capture_output=True, text=True, cwd=work, timeout=600,
                          env={**os.environ, **bc.RAY_ENV, "XDG_STATE_HOME": str(work)})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the bare Ray driver failed: {proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def session_by_process(sid: int) -> dict[str, float]:
    """CPU seconds so far of the Ray session's live processes, by what they are (the command's first word: raylet,
    gcs_server, ray::NodeActor, ray::IDLE, the Python agents, ...)."""
    out: dict[str, float] = {}
    for pid, fields in bc.session_processes(sid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        kind = cmd.rsplit("/", 1)[-1] if "/" in cmd.split(" ")[0] else cmd.split(" ")[0]
        out[kind] = out.get(kind, 0.0) + bc.stat_cpu_seconds(fields)
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def pin(pid: int, cpu: int) -> None:
    """Every thread of process `pid` on CPU `cpu` (sched_setaffinity of one pid moves only its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # the thread ended meanwhile
            pass


def compare(work: Path, cluster, modes: list[str], repeats: int, calls: int, pinned: bool,
            model: RoundModel = LOOP) -> None:
    """The modes' rounds interleaved on one cluster, `repeats` runs each; a table of medians."""
    session = cluster.head.proc.pid
    if pinned:
        for pid, _ in bc.session_processes(session):
            pin(pid, 1)
        pin(os.getpid(), 0)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    idle0, t0 = session_by_process(session), time.perf_counter()
    time.sleep(5.0)
    idle_rate = {k: v / (time.perf_counter() - t0) for k, v in _delta(session_by_process(session), idle0).items()}
    parts: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(repeats):
        for mode in modes:
            before: dict[str, float] = {}
            r = coordinator_rounds(work, cluster.address, calls, graph=mode == "graph", session=session,
                                   on_proxy=(lambda p: pin(p, 0)) if pinned else None, model=model,
                                   on_timed=lambda: before.update(session_by_process(session)))
            parts[mode].append({k: v / calls for k, v in _delta(session_by_process(session), before).items()})
            runs[mode].append(r)
    where = "nodes on CPU 1, coordinator + proxy on CPU 0" if pinned else "unpinned"
    print(f"## interleaved, {calls} rounds a run, {repeats} runs a mode, {where}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'mode':<6} {'round ms, median of runs':>24}  {'runs (p10, median, p90)':<60} {'coord':>6} {'proxy':>6} "
          f"{'Ray':>6} CPU ms per round")
    for mode, rs in runs.items():
        per = [f"({np.percentile(r['round'], 10) * 1e3:.2f}, {statistics.median(r['round']) * 1e3:.2f}, "
               f"{np.percentile(r['round'], 90) * 1e3:.2f})" for r in rs]
        print(f"{mode:<6} {statistics.median(statistics.median(r['round']) for r in rs) * 1e3:24.3f}  "
              f"{' '.join(per):<60} {statistics.median(r['cpu'] for r in rs) * 1e3:6.3f} "
              f"{statistics.median(r['proxy_cpu'] for r in rs) * 1e3:6.3f} "
              f"{statistics.median(r['ray_cpu'] for r in rs) * 1e3:6.3f}")
    print("the Ray session idle (5 s, no rounds), CPU ms per second: "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(idle_rate.items(), key=lambda kv: -kv[1]) if v > 0))
    for mode in modes:
        kinds = sorted({k for p in parts[mode] for k in p}, key=lambda k: -statistics.median(p.get(k, 0.0)
                                                                                           for p in parts[mode]))
        print(f"the Ray session per round ({mode}), CPU ms, median of runs (wall and idle share included): "
              + ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in parts[mode]) * 1e3:.3f}" for k in kinds
                          if statistics.median(p.get(k, 0.0) for p in parts[mode]) > 0))
    print("RESULT " + json.dumps({m: [{k: (v if not isinstance(v, list) else statistics.median(v))
                                       for k, v in r.items()} for r in rs] for m, rs in runs.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "shardtool-cluster-rtt")
    ap.add_argument("--graph", action="store_true", help="rounds through a Ray Compiled Graph (connect_cluster)")
    ap.add_argument("--compare", help="modes to interleave, e.g. plain,graph")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each --compare mode")
    ap.add_argument("--pin", action="store_true", help="with --compare: nodes on CPU 1, coordinator on CPU 0")
    ap.add_argument("--skip-bare", action="store_true", help="no bare Ray driver figures")
    ap.add_argument("--node-budget", type=int, default=128, help="MiB per node (its experts fit: the round trip only)")
    ap.add_argument("--scale-dir", type=Path, help="a bench_cluster_scale layout directory (e.g. WORKDIR/2x1): its "
                                                   "model, plan and nodes instead of the loopback model")
    args = ap.parse_args()
    if args.scale_dir:
        work, model = args.scale_dir, scale_model(args.scale_dir)
        names = tuple(node["name"] for node in json.loads((work / "plan.json").read_text())["nodes"])
        budget = max(args.node_budget, 4096) * MIB  # every node holds its share
        bc.ray_token(work)
    else:
        work, model, names, budget = args.workdir, LOOP, bc.LOOP_NODES, args.node_budget * MIB
        bc.build_loopback(work)
    os.environ.update(bc.RAY_ENV)
    cluster = bc.LoopbackCluster(work, budget, names=names)
    try:
        if args.compare:
            compare(work, cluster, args.compare.split(","), args.repeats, args.calls, args.pin, model)
            if not args.skip_bare:
                for key, values in bare_ray(work, cluster.address, args.calls, model.hidden).items():
                    print(f"{key:<32} {_ms(values) if isinstance(values, list) else values}")
            return
        co = coordinator_rounds(work, cluster.address, args.calls, graph=args.graph, session=cluster.head.proc.pid,
                                model=model)
        bare = {} if args.skip_bare else bare_ray(work, cluster.address, args.calls, model.hidden)
    finally:
        cluster.stop()
    print(f"## one MoE layer's round at batch 1, {args.calls} calls, {co['calls_per_round']:.2f} node calls a round")
    print(f"round (RemoteExperts.run)        {_ms(co['round'])}")
    print(f"  node work (signed 'seconds')   {_ms(co['node_work'])}")
    print(f"  the rest: proxy, Ray, checks   {_ms([r - w for r, w in zip(co['round'], co['node_work'])])}")
    print(f"coordinator CPU per round        {co['cpu'] * 1e3:.3f} ms")
    print(f"proxy CPU per round              {co['proxy_cpu'] * 1e3:.3f} ms")
    print(f"Ray session CPU per round        {co['ray_cpu'] * 1e3:.3f} ms (GCS, raylet, the nodes' actor workers)")
    for key, values in bare.items():
        print(f"{key:<32} {_ms(values) if isinstance(values, list) else values}")


if __name__ == "__main__":
    main()
