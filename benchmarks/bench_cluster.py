"""Expert-parallel serving at scale (issue 13): the paper model of seconds per token against the number of nodes,
fed by one input measured here (a node's read+verify throughput), printed as the tables of docs/scaling.md.

Parts:
  read+verify   a generated model is split, signed and planned on two nodes; node a's planned subset (hard links)
                is audited with --present-only semantics (manifest/audit.py) 5 times; GB/s, median.
  scale model   `scale_model(...)`: seconds per token for 1-64 nodes, R = 1 and 2, for the seed's 2.78 T / 896-expert
                / 16-active configuration and for DeepSeek-V3; disk and network terms and which one limits.
  loopback      measured (not with --scale-only): 1 process vs a coordinator + 2 `shardtool node` processes on a
                local Ray head, same model, every process holding what it serves in memory (the model fits one
                process): decode tok/s, p50 s/token, wire bytes per token, share of time in Ray calls, CPU seconds
                per run of the coordinator (with its proxy) and of the Ray session (head, raylet, the nodes' actors),
                and the round trip of one MoE layer at batch 1 (`_cluster_rtt.coordinator_rounds`), each run
                interleaved with the decode runs (`measure_loopback`).
The case a cluster exists for (a model larger than any node's memory, nodes and one streaming machine on emulated
machines): bench_cluster_scale.py, which reuses this module's cluster, layout and token stamps.

Usage: python benchmarks/bench_cluster.py [--scale-only] [--verify-gbps G] [--disk-gbps 2] [--net-gbit 25]
                                          [--node-memory-gb 128] [--repeats 5] [--workdir DIR] [--json OUT]
                                          [--tokens 32] [--loopback-repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
NODES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ModelConfig:
    """What the scale model needs of a model: routed experts and their bytes, the hidden size on the wire."""

    name: str
    moe_layers: int
    experts: int  # routed experts per MoE layer
    active: int  # routed experts per token (top-k)
    expert_bytes: int  # one routed expert on disk
    hidden: int  # hidden size: the length of one token's hidden state sent to a node

    @property
    def expert_bytes_total(self) -> int:
        return self.moe_layers * self.experts * self.expert_bytes


# The seed's 2.78 T-parameter model, 896 experts per layer, 16 active: no config is published; like
# docs/resource-contract.md we take Kimi-K2's shapes (hidden 7168, expert width 2048, first layer dense) with 71
# layers (70 MoE) at 4 bits per weight: one expert 3 x 7168 x 2048 / 2 bytes = 22.0 MB, 1.38 TB of experts.
SEED = ModelConfig("seed 2.78T (Kimi-K2 shapes, 71 layers, 4-bit)", moe_layers=70, experts=896, active=16,
                   expert_bytes=3 * 7168 * 2048 // 2, hidden=7168)
# DeepSeek-V3 from its config.json: hidden 7168, moe_intermediate_size 2048, 61 layers of which the first 3 are
# dense (58 MoE), 256 routed experts, 8 per token, FP8 weights (1 byte) plus 128x128 block scales (float32).
DEEPSEEK_V3 = ModelConfig("DeepSeek-V3 (671B, FP8)", moe_layers=58, experts=256, active=8,
                          expert_bytes=3 * 7168 * 2048 + 3 * (7168 // 128) * (2048 // 128) * 4, hidden=7168)


def _placement(experts: int, nodes: int, replicas: int) -> np.ndarray:
    """[experts, replicas] node ids: copy r of expert e on node (e + r * stride) mod n, distinct for r < n (what
    make_plan yields for equal budgets and equal experts, up to renaming)."""
    stride = max(nodes // replicas, 1)
    e = np.arange(experts)[:, None]
    return (e + np.arange(replicas)[None, :] * stride) % nodes


@functools.lru_cache(maxsize=None)
def routing_stats(experts: int, active: int, nodes: int, replicas: int, samples: int = 4000,
                  seed: int = 0) -> tuple[float, float]:
    """(E[experts read by the busiest node], E[distinct nodes contacted]) for one token at one layer, by sampling
    uniform routing (top-k distinct experts). With R copies the coordinator sends each selected expert to the
    least-loaded of its holders so far (ties: the first), the choice a replica gives it."""
    rng = np.random.default_rng(seed)
    place = _placement(experts, nodes, replicas)
    busiest, contacted = 0.0, 0.0
    for _ in range(samples):
        chosen = rng.choice(experts, size=active, replace=False)
        load = np.zeros(nodes, dtype=np.int64)
        for e in chosen:
            holders = place[e]
            load[holders[np.argmin(load[holders])]] += 1
        busiest += load.max()
        contacted += np.count_nonzero(load)
    return busiest / samples, contacted / samples


def scale_model(cfg: ModelConfig, nodes: int, replicas: int, *, node_read_gbps: float, net_gbit: float = 25.0,
                node_memory_bytes: float = 0.0, wire_bytes_per_element: int = 4, samples: int = 4000) -> dict:
    """Seconds per token (batch of one, decode) on `nodes` expert nodes holding `replicas` copies of each expert.

        held per node  = R * L * E * B / N
        hit            = min(1, M / held)              share of a node's experts its memory M keeps (uniform routing)
        disk s/token   = L * busiest(N, R) * B * (1 - hit) / T
        net  s/token   = L * 2 * H * w * contacted(N, R) / G
        s/token        = disk + net                    (a layer's reads wait for its hidden states and vice versa)

    L MoE layers, E experts per layer, B bytes per expert, T a node's read+verify throughput (the smaller of its
    disk and its verifier), H hidden size, w bytes per element on the wire (float32: 4), G the coordinator's
    network bandwidth; busiest/contacted from `routing_stats`. Compute, attention and per-call latency are left
    out: this is the floor the bytes set."""
    if replicas > nodes:
        raise ValueError(f"{replicas} replicas need at least as many nodes, got {nodes}")
    busiest, contacted = routing_stats(cfg.experts, cfg.active, nodes, replicas, samples)
    held = replicas * cfg.expert_bytes_total / nodes
    hit = min(1.0, node_memory_bytes / held) if held else 1.0
    disk = cfg.moe_layers * busiest * cfg.expert_bytes * (1 - hit) / (node_read_gbps * 1e9)
    wire = cfg.moe_layers * 2 * cfg.hidden * wire_bytes_per_element * contacted
    net = wire / (net_gbit * 1e9 / 8)
    return {"model": cfg.name, "nodes": nodes, "replicas": replicas, "held_bytes_per_node": held,
            "busiest_experts_per_layer": busiest, "nodes_contacted_per_layer": contacted, "cache_hit": hit,
            "disk_seconds_per_token": disk, "wire_bytes_per_token": wire, "net_seconds_per_token": net,
            "seconds_per_token": disk + net, "limit": "network" if net > disk else "disk"}


def network_crossover(cfg: ModelConfig, replicas: int, **kw) -> int | None:
    """The fewest nodes (of NODES) at which the network term exceeds the disk term, None if none does."""
    for n in NODES:
        if n >= replicas and scale_model(cfg, n, replicas, **kw)["limit"] == "network":
            return n
    return None


# ------------------------------------------------------------------------------------------- measured input

def measure_read_verify(work: Path, repeats: int) -> dict:
    """GB/s of one node's read+verify (audit of its planned subset, --present-only semantics), median of
    `repeats` runs after a warm-up run: page cache warm, so the figure is the verifier's, not a disk's."""
    sys.path.insert(0, str(REPO))
    from examples import make_tiny_moe
    from shardtool import keys
    from shardtool.checkpoint import split_checkpoint
    from shardtool.manifest import load_manifest, load_trusted_manifest, save_manifest
    from shardtool.manifest.audit import audit_directory
    from shardtool.runtime import make_plan

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ckpt = make_tiny_moe.make_checkpoint(work / "hf", "mixtral", layers=4, experts=16, hidden=1024,
                                         moe_intermediate=1024, intermediate=1536, vocab=1000, heads=8, kv_heads=4)
    model = work / "model"
    split_checkpoint(ckpt, model, model_id="bench/cluster", version=1)
    key = keys.generate()
    keys.write_keypair(work / "k", key, None, force=False)
    manifest = load_manifest(model / "manifest.msgpack")
    save_manifest(model / "manifest.msgpack", manifest.with_envelope(manifest.envelope.signed_by(key)))
    verified = load_trusted_manifest(model / "manifest.msgpack", [keys.load_public_key(work / "k.pub")], 1,
                                     work / "state")
    plan = make_plan(verified, [("a", 2**34, None), ("b", 2**34, None)], replicas=1)
    node = work / "node-a"
    for rel in plan.node("a").files():
        (node / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(model / rel, node / rel)
    shutil.copy(model / "manifest.msgpack", node / "manifest.msgpack")
    planned = sum(verified.by_path()[p].size for p in plan.node("a").files())
    rates = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        report = audit_directory(node, verified, ignore=["manifest.msgpack"], present_only=True)
        seconds = time.perf_counter() - started
        assert report.ok and report.bytes_hashed == planned, report.findings[:3]
        if i:
            rates.append(planned / seconds / 1e9)
    shutil.rmtree(work)
    return {"bytes": planned, "files": len(plan.node("a").files()), "gbps_runs": rates,
            "gbps_median": statistics.median(rates), "cpus": os.cpu_count()}


# ------------------------------------------------------------------------------------------- output

def _fmt_s(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 else f"{x * 1e3:.3g} ms" if x > 0 else "0"


def print_scale(cfg: ModelConfig, *, node_read_gbps: float, net_gbit: float, node_memory_bytes: float,
                samples: int) -> list[dict]:
    kw = dict(node_read_gbps=node_read_gbps, net_gbit=net_gbit, samples=samples)
    print(f"\n## {cfg.name}: L={cfg.moe_layers} MoE layers, E={cfg.experts}, k={cfg.active}, "
          f"B={cfg.expert_bytes / 1e6:.1f} MB, experts {cfg.expert_bytes_total / 1e12:.2f} TB; T={node_read_gbps:g} "
          f"GB/s per node, G={net_gbit:g} Gb/s, M={node_memory_bytes / 1e9:g} GB per node")
    print("| N | R | held per node | busiest node, experts/layer | nodes contacted/layer | disk s/token cold "
          "| hit at M | disk s/token at M | wire per token | net s/token | s/token at M | limit at M |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for replicas in (1, 2):
        for n in NODES:
            if replicas > n:
                continue
            cold = scale_model(cfg, n, replicas, **kw)
            warm = scale_model(cfg, n, replicas, node_memory_bytes=node_memory_bytes, **kw)
            rows.append({"cold": cold, "at_memory": warm})
            print(f"| {n} | {replicas} | {cold['held_bytes_per_node'] / 1e9:,.0f} GB | {cold['busiest_experts_per_layer']:.2f} "
                  f"| {cold['nodes_contacted_per_layer']:.2f} | {_fmt_s(cold['disk_seconds_per_token'])} "
                  f"| {warm['cache_hit']:.0%} | {_fmt_s(warm['disk_seconds_per_token'])} "
                  f"| {cold['wire_bytes_per_token'] / 1e6:.1f} MB | {_fmt_s(cold['net_seconds_per_token'])} "
                  f"| {_fmt_s(warm['seconds_per_token'])} | {warm['limit']} |")
    for replicas in (1, 2):
        cold_x = network_crossover(cfg, replicas, **kw)
        warm_x = network_crossover(cfg, replicas, node_memory_bytes=node_memory_bytes, **kw)
        print(f"R={replicas}: the network outweighs the disk from N = {cold_x or 'never (to 64)'} with a cold cache, "
              f"from N = {warm_x or 'never (to 64)'} with {node_memory_bytes / 1e9:g} GB of expert cache per node")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Measured on loopback: one process versus a coordinator and 2 `shardtool node` processes on a local Ray head, the
# same model and the same total memory budget, in the same run (medians over repeats):
#   - decode tokens/s and the p50 time per generated token (gaps between tokens streamed on stdout),
#   - wire bytes per fed token (hidden-state rows and row indices sent to nodes + expert outputs received),
#   - the share of the run's wall time the coordinator spent starting and waiting for node calls.
#   - CPU seconds of the run's coordinator (with its cluster proxy) and of the Ray session (head, raylet, workers:
#     the nodes' actors among them), so the share of each figure that is CPU contention on this machine shows,
#   - the round trip of one MoE layer at batch 1, coordinator -> nodes -> coordinator, between decode runs.
# The model is Mixtral-shaped (examples/make_tiny_moe.py) with no EOS, so every run makes exactly --tokens tokens;
# every process holds the experts it serves in memory (after their first verified read): the case where the model
# fits one process, which isolates the cost of the round trips. The Ray head runs on 127.0.0.1 in its own process
# group and temp dir, and is stopped by that group's id.

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VENV_BIN, make_mixtral_without_eos  # noqa: E402

MIB = 2**20
LOOP_MODEL_ID = "bench/cluster"
# 8 experts of 3 x 256 x 512 f32 = 1.5 MiB each, top-2, 4 layers: 48 MiB of experts.
LOOP_MODEL = dict(layers=4, experts=8, experts_per_tok=2, hidden=256, moe_intermediate=512, heads=4, kv_heads=2,
             vocab=1024, dtype="f32")
LOOP_NODES = ("n1", "n2")
# One process holds every expert (48 MiB) in its cache; each node holds its 16 (24 MiB) above its floor of 52.5 MiB.
LOOP_TOTAL_BUDGET = 180 * MIB
LOOP_COORDINATOR_BUDGET = 72 * MIB
LOOP_NODE_BUDGET = 96 * MIB
LOOP_ROUND_CALLS = 200  # layer round trips timed between decode runs
LOOP_PROMPT_IDS = "5,77,300,12,9,41,600,8"
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "OPENBLAS_NUM_THREADS": "1", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def sh(*argv, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, **RAY_ENV, "XDG_STATE_HOME": str(cwd)}, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def build_loopback(work: Path, *, pipeline: bool = False) -> None:
    """Model, split, signature, plan (R = 1 over the two nodes; `pipeline`: each node a span of whole layers), and the
    per-node and coordinator directories."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ray_token(work)
    for key in ("a", "op", *(f"node-{n}" for n in LOOP_NODES)):  # publisher, operator (signs the plan), nodes
        sh(VENV_BIN / "shardtool", "keygen", "--out", key, "--no-passphrase", cwd=work)
    make_mixtral_without_eos(work / "hf", LOOP_MODEL)
    sh(VENV_BIN / "shardtool", "split", "-q", work / "hf", work / "full", "--model-id", LOOP_MODEL_ID, "--version", "1",
       cwd=work)
    sh(VENV_BIN / "shardtool", "sign", work / "full", "--key", "a.key", cwd=work)
    sh(VENV_BIN / "shardtool", "plan", work / "full", "--trust", "a.pub", "--state-dir", work / "plan-state",
       *[x for n in LOOP_NODES for x in ("--node", f"{n}={LOOP_NODE_BUDGET},key=node-{n}.pub")], "--out",
       work / "plan.json", "--sign-key", "op.key", *(["--pipeline"] if pipeline else []), cwd=work)
    lay_out(work / "full", work / "plan.json", work / "a.pub", work, copy=shutil.copyfile)


def ray_token(work: Path) -> None:
    """The head enforces Ray's token (RAY_AUTH_MODE=token), as the commands require; every process here gives it."""
    token = work / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    RAY_ENV.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))


def lay_out(full: Path, plan_path: Path, trust: Path, out: Path, *, copy=os.link) -> None:
    """The coordinator's directory (out/coordinator) and each node's (out/node-NAME) as the plan at `plan_path`
    places the split model `full`: its files, config.json and the manifest, copied or (default) hard-linked."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import load_plan

    verified = load_trusted_manifest(full / "manifest.msgpack", [load_public_key(trust)], 1, out / "plan-state")
    plan = load_plan(plan_path, verified)
    for name, files in [("coordinator", plan.coordinator_files),
                        *((f"node-{n.name}", ["config.json", *n.files()]) for n in plan.nodes)]:
        shutil.rmtree(out / name, ignore_errors=True)
        for rel in [*files, "manifest.msgpack"]:
            (out / name / rel).parent.mkdir(parents=True, exist_ok=True)
            copy(full / rel, out / name / rel)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """A process in its own session, ended by its process group id only."""

    def __init__(self, argv, log: Path, cwd: Path):
        self.log = log
        self.handle = open(log, "w")
        self.proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=self.handle,
                                     stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                     env={**os.environ, **RAY_ENV, "XDG_STATE_HOME": str(cwd)})

    def wait_for(self, text: str, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if text in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"no {text!r} within {seconds}s")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what of the group outlived its leader
        except ProcessLookupError:
            pass
        self.handle.close()


def one_run(work: Path, directory: str, tokens: int, *, cluster: str | None, budget: int, graph: bool = False) -> dict:
    """verify-and-run with --print-ids: the time each token reached stdout, and its JSON report; `graph`: with
    --cluster-graph."""
    report = work / f"report-{time.monotonic_ns()}.json"
    argv = [VENV_BIN / "verify-and-run", work / directory, "--trust", work / "a.pub", "--state-dir", work / "state",
            "--model-id", LOOP_MODEL_ID, "--prompt-ids", LOOP_PROMPT_IDS, "--max-new-tokens", str(tokens), "--print-ids", "-q",
            "--memory-budget", str(budget), "--readers", "1", "--json-report", report]
    if cluster:
        argv += ["--cluster", cluster, "--plan", work / "plan.json", "--plan-trust", work / "op.pub"]
        argv += ["--cluster-graph"] if graph else []
    proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work,
                            env={**os.environ, **RAY_ENV, "XDG_STATE_HOME": str(work)}, stdin=subprocess.DEVNULL)
    cpu0 = _children_cpu()
    ids, stamps, _ = stamped_ids(proc.stdout)
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise RuntimeError(f"verify-and-run exited {proc.returncode}: {err[-2000:]}")
    summary = json.loads(report.read_text())
    report.unlink()
    return {"ids": ids, "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "report": summary,
            "cpu": _children_cpu() - cpu0, "stderr": err[-4000:]}


def stamped_ids(stream, probe=None) -> tuple[list[str], list[float], list]:
    """The token ids `verify-and-run --print-ids` writes to `stream` (bytes), the time each one began to appear (its
    first character: the command writes a token's separator and id at once, and ends with a newline that is no
    token), and `probe()` taken at that moment (e.g. a cgroup's disk reads so far; None without a probe)."""
    stamps, probes, text = [], [], ""
    previous = b" "
    while True:
        ch = stream.read(1)
        if not ch:
            break
        text += ch.decode()
        if previous.isspace() and not ch.isspace():
            stamps.append(time.perf_counter())
            probes.append(probe() if probe else None)
        previous = ch
    return text.split(), stamps, probes


def _children_cpu() -> float:
    """User + system CPU seconds of this process's waited-for children (a run's coordinator and its proxy)."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def session_processes(sid: int):
    """(pid, the fields of /proc/PID/stat after the command name) of each live process of session `sid`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid:
            yield int(entry), fields


def stat_cpu_seconds(fields) -> float:
    """User + system CPU seconds of a process, from its /proc/PID/stat fields after the command name."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def session_cpu(sid: int) -> float:
    """User + system CPU seconds so far of the live processes of session `sid` (a Ray head started in its own
    session: its GCS, raylet and workers, the nodes' actors among them), from /proc."""
    return sum(stat_cpu_seconds(f) for _, f in session_processes(sid))


class LoopbackCluster:
    """A Ray head on 127.0.0.1 (own session, temp dir and free ports) and the `shardtool node`s of a built loopback
    work directory (`build_loopback`, or `lay_out`), each with `node_budget` bytes (one for all, or by name);
    `stop` ends them by their process groups. `actor_pids[name]` is the Ray worker process that holds and computes
    a node's experts (the raylet's child, not the `shardtool node` process); `on_node(name, pid)` is called with it
    as soon as that node is ready, before the next one starts (e.g. to move it into a capped machine)."""

    def __init__(self, work: Path, node_budget: int | dict[str, int], *, names: tuple[str, ...] = LOOP_NODES,
                 readers: int = 1, on_node=None):
        self.temp = Path(tempfile.mkdtemp(prefix="st-ray-", dir="/tmp"))
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.head = Group([VENV_BIN / "ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", port,
                           "--block", "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", self.temp,
                           "--disable-usage-stats", "--object-store-memory", 96 * MIB, "--ray-client-server-port",
                           free_port(), "--dashboard-agent-listen-port", free_port(), "--metrics-export-port",
                           free_port(), "--runtime-env-agent-port", free_port(), "--dashboard-agent-grpc-port",
                           free_port()], work / "head.log", work)
        self.nodes: list[Group] = []
        self.actor_pids: dict[str, int] = {}
        budgets = node_budget if isinstance(node_budget, dict) else dict.fromkeys(names, node_budget)
        try:
            self.head.wait_for("Ray runtime started")
            for name in names:
                before = self._actors()
                self.nodes.append(Group([VENV_BIN / "shardtool", "node", work / f"node-{name}", "--trust",
                                         work / "a.pub", "--state-dir", work / f"state-{name}", "--plan",
                                         work / "plan.json", "--name", name, "--plan-trust", work / "op.pub",
                                         "--node-key", work / f"node-{name}.key", "--memory-budget", budgets[name],
                                         "--address", self.address, "--readers", readers], work / f"node-{name}.log",
                                        work))
                if on_node is None:
                    continue
                self.nodes[-1].wait_for(f"node {name} ready")
                new = self._actors() - before
                if len(new) != 1:
                    raise RuntimeError(f"node {name}: expected one new NodeActor process, found {sorted(new)}")
                self.actor_pids[name] = new.pop()
                on_node(name, self.actor_pids[name])
            for name, node in zip(names, self.nodes):
                node.wait_for(f"node {name} ready")
        except BaseException:
            self.stop()
            raise

    def _actors(self) -> set[int]:
        """The pids of this head's session whose title is a NodeActor's (Ray names an actor's worker after it)."""
        found = set()
        for pid, _ in session_processes(self.head.proc.pid):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::NodeActor"):
                    found.add(pid)
            except OSError:
                continue
        return found

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.head.stop()
        shutil.rmtree(self.temp, ignore_errors=True)


def measure_loopback(work: Path, repeats: int, tokens: int, *, graph: bool = False, pipeline: bool = False) -> dict:
    """The measured part: 1 process vs coordinator + 2 nodes on loopback (same model, each process holding what it
    serves), and the layer round trip between the decode runs; `graph`: a third set-up, the cluster's rounds
    through a Ray Compiled Graph (--cluster-graph), and its round trips timed beside the plain ones; `pipeline`: the
    nodes run spans of whole layers (`shardtool plan --pipeline`; the round trips timed are still expert calls)."""
    build_loopback(work, pipeline=pipeline)
    # a span node also keeps its layers' trunk and the keys and values of `shardtool node --max-sequences` sequences
    node_budget = LOOP_NODE_BUDGET + (192 * MIB if pipeline else 0)
    cluster = LoopbackCluster(work, node_budget)
    address, head = cluster.address, cluster.head
    try:
        runs = {"1 process": [], "coordinator + 2 nodes": [], **({"2 nodes, compiled graph": []} if graph else {})}
        rounds, graph_rounds = [], []
        from _cluster_rtt import coordinator_rounds
        os.environ.update(RAY_ENV)  # the round trips' proxy is this process's child: Ray's token, by file
        for _ in range(repeats):  # interleaved: drift in the machine's load hits both alike
            runs["1 process"].append(one_run(work, "full", tokens, cluster=None, budget=LOOP_TOTAL_BUDGET))
            ray0 = session_cpu(head.proc.pid)
            run = one_run(work, "coordinator", tokens, cluster=address, budget=LOOP_COORDINATOR_BUDGET)
            run["ray_cpu"] = session_cpu(head.proc.pid) - ray0
            runs["coordinator + 2 nodes"].append(run)
            rounds.append(coordinator_rounds(work, address, LOOP_ROUND_CALLS))
            if graph:
                ray0 = session_cpu(head.proc.pid)
                run = one_run(work, "coordinator", tokens, cluster=address, budget=LOOP_COORDINATOR_BUDGET,
                              graph=True)
                run["ray_cpu"] = session_cpu(head.proc.pid) - ray0
                runs["2 nodes, compiled graph"].append(run)
                graph_rounds.append(coordinator_rounds(work, address, LOOP_ROUND_CALLS, graph=True))
    finally:
        cluster.stop()
    local = runs["1 process"]
    same = all(r["ids"] == local[0]["ids"] for rs in runs.values() for r in rs)
    fell_back = sum("plain actor calls from now on" in r["stderr"] for r in runs.get("2 nodes, compiled graph", []))
    if fell_back:
        print(f"(the compiled graph fell back to plain calls in {fell_back} of the graph runs)")
    rows = {}
    for name, rs in runs.items():
        decode = [r["report"]["decode_tokens_per_s"] for r in rs]
        gaps = [statistics.median(r["gaps"]) for r in rs]
        fed = [r["report"]["prompt_tokens"] + r["report"]["new_tokens"] - 1 for r in rs]
        wall = [r["report"]["seconds"]["prefill"] + r["report"]["seconds"]["decode"] for r in rs]
        cl = [r["report"].get("cluster") for r in rs]
        rows[name] = {
            "decode_tokens_per_s": statistics.median(decode),
            "p50_seconds_per_token": statistics.median(gaps),
            "wire_bytes_per_fed_token": statistics.median(c["wire_bytes"] / f for c, f in zip(cl, fed)) if cl[0] else 0,
            "ray_call_share": statistics.median(c["remote_seconds"] / w for c, w in zip(cl, wall)) if cl[0] else 0.0,
            "node_calls_per_fed_token": statistics.median(c["calls"] / f for c, f in zip(cl, fed)) if cl[0] else 0,
            # wall time per layer round (the calls of one layer run in parallel): what a round trip costs here
            "ms_per_layer_round": statistics.median(1e3 * c["remote_seconds"] / (f * LOOP_MODEL["layers"])
                                                    for c, f in zip(cl, fed)) if cl[0] else 0.0,
            "coordinator_cpu_seconds": statistics.median(r["cpu"] for r in rs),
            "ray_session_cpu_seconds": statistics.median(r.get("ray_cpu", 0.0) for r in rs),
            "wall_seconds": statistics.median(wall),
        }
    ref = rows["1 process"]["decode_tokens_per_s"]
    print(f"\n## coordinator + {len(LOOP_NODES)} nodes vs 1 process on loopback ({tokens} new tokens, "
          f"{repeats} runs each; budgets: 1 process {LOOP_TOTAL_BUDGET // MIB} MiB, coordinator "
          f"{LOOP_COORDINATOR_BUDGET // MIB} MiB, each node {node_budget // MIB} MiB"
          f"{', whole layers (pipeline)' if pipeline else ''}; same tokens: {same})")
    print(f"{'set-up':<24} {'decode tok/s':>12} {'ratio':>6} {'p50 s/token':>12} {'wire B/token':>13} "
          f"{'in Ray calls':>13} {'calls/token':>12} {'ms/layer round':>15} {'wall s':>7} {'coord CPU s':>12} "
          f"{'Ray CPU s':>10}")
    for name, row in rows.items():
        print(f"{name:<24} {row['decode_tokens_per_s']:12.2f} {row['decode_tokens_per_s'] / ref:6.2f} "
              f"{row['p50_seconds_per_token']:12.4f} {row['wire_bytes_per_fed_token']:13.0f} "
              f"{row['ray_call_share']:13.1%} {row['node_calls_per_fed_token']:12.2f} "
              f"{row['ms_per_layer_round']:15.2f} {row['wall_seconds']:7.3f} {row['coordinator_cpu_seconds']:12.3f} "
              f"{row['ray_session_cpu_seconds']:10.3f}")
    trip = _round_trips(rounds, "plain actor calls")
    result = {"same_tokens": same, "rows": rows, "tokens": tokens, "repeats": repeats, "round_trip": trip}
    if graph:
        result["round_trip_graph"] = _round_trips(graph_rounds, "compiled graph")
    return result


def _round_trips(rounds: list[dict], how: str) -> dict:
    """The layer round trips timed between the decode runs (`coordinator_rounds`), medians printed and returned."""
    trip = {"median_ms_per_run": [statistics.median(r["round"]) * 1e3 for r in rounds],
            "node_work_ms_per_run": [statistics.median(r["node_work"]) * 1e3 for r in rounds],
            "coordinator_cpu_ms": statistics.median(r["cpu"] for r in rounds) * 1e3,
            "proxy_cpu_ms": statistics.median(r["proxy_cpu"] for r in rounds) * 1e3,
            "node_calls_per_round": statistics.median(r["calls_per_round"] for r in rounds)}
    trip["median_ms"] = statistics.median(trip["median_ms_per_run"])
    print(f"one MoE layer's round trip at batch 1, {how} (coordinator -> nodes -> coordinator, {LOOP_ROUND_CALLS} "
          f"calls a run, {trip['node_calls_per_round']:.2f} node calls a round): median {trip['median_ms']:.2f} ms (runs: "
          f"{', '.join(f'{v:.2f}' for v in trip['median_ms_per_run'])}); of it the nodes' own work "
          f"{statistics.median(trip['node_work_ms_per_run']):.2f} ms; CPU per round: coordinator "
          f"{trip['coordinator_cpu_ms']:.2f} ms, its proxy {trip['proxy_cpu_ms']:.2f} ms")
    return trip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale-only", action="store_true", help="Only the paper model (no Ray cluster).")
    ap.add_argument("--verify-gbps", type=float, help="Use this read+verify GB/s instead of measuring it.")
    ap.add_argument("--disk-gbps", type=float, default=2.0, help="A node's disk (NVMe) GB/s; T = min(disk, verify).")
    ap.add_argument("--net-gbit", type=float, default=25.0, help="Coordinator network, Gb/s.")
    ap.add_argument("--node-memory-gb", type=float, default=128.0, help="Expert cache per node, GB.")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=4000, help="Routing samples per (N, R).")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-cluster"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", type=int, default=32, help="New tokens per loopback run.")
    ap.add_argument("--loopback-repeats", type=int, default=3, help="Runs of each loopback set-up.")
    ap.add_argument("--graph", action="store_true", help="Also the cluster through a Ray Compiled Graph "
                                                          "(verify-and-run --cluster-graph), interleaved.")
    ap.add_argument("--pipeline", action="store_true", help="The loopback cluster's plan places whole layers "
                                                             "(shardtool plan --pipeline).")
    args = ap.parse_args()

    results: dict = {}
    if args.verify_gbps is None:
        measured = measure_read_verify(args.workdir, args.repeats)
        results["read_verify"] = measured
        verify = measured["gbps_median"]
        print(f"## read+verify of one node's planned subset ({measured['files']} files, "
              f"{measured['bytes'] / 2**20:.0f} MiB, warm page cache, {measured['cpus']} shared cores): "
              f"median {verify:.2f} GB/s of {len(measured['gbps_runs'])} runs "
              f"({', '.join(f'{r:.2f}' for r in measured['gbps_runs'])})")
    else:
        verify = args.verify_gbps
    node_read = min(args.disk_gbps, verify)
    print(f"T = min(disk {args.disk_gbps:g} GB/s, read+verify {verify:.2f} GB/s) = {node_read:.2f} GB/s per node")
    results["inputs"] = {"verify_gbps": verify, "disk_gbps": args.disk_gbps, "node_read_gbps": node_read,
                         "net_gbit": args.net_gbit, "node_memory_gb": args.node_memory_gb}
    results["scale"] = {}
    for cfg in (SEED, DEEPSEEK_V3):
        results["scale"][cfg.name] = {
            "config": asdict(cfg),
            "rows": print_scale(cfg, node_read_gbps=node_read, net_gbit=args.net_gbit,
                                node_memory_bytes=args.node_memory_gb * 1e9, samples=args.samples)}
    if not args.scale_only:
        results["loopback"] = measure_loopback(args.workdir / ("loopback-pipeline" if args.pipeline else "loopback"),
                                               args.loopback_repeats, args.tokens, graph=args.graph,
                                               pipeline=args.pipeline)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, allow_nan=False))
    if not results.get("loopback", {"same_tokens": True})["same_tokens"]:
        sys.exit("bench_cluster: the cluster's tokens differ from one process's")
    if not math.isfinite(node_read):
        sys.exit("bench_cluster: read throughput is not finite")


if __name__ == "__main__":
    main()
