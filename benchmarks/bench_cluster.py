"""Expert-parallel serving on Ray, measured here: one process versus a coordinator and 2 `shardtool node`
processes on loopback, the same model and the same total memory budget, in the same run (medians over repeats).
  - decode tokens/s and the p50 time per generated token (gaps between tokens streamed on stdout),
  - wire bytes per fed token (hidden-state rows and row indices sent to nodes + expert outputs received),
  - the share of the run's wall time the coordinator spent starting and waiting for node calls.
The model is a Mixtral-shaped checkpoint from examples/make_tiny_moe.py with no EOS (every run makes exactly
--tokens tokens); its experts exceed the one process's shard cache, so both set-ups read and verify experts
again as they go. A Ray head is started on 127.0.0.1 in its own process group and temp dir, and stopped by it.
Usage: python benchmarks/bench_cluster.py [--repeats 3] [--tokens 32] [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VENV_BIN, make_mixtral_without_eos  # noqa: E402

MIB = 2**20
MODEL_ID = "bench/cluster"
# 8 experts of 3 x 256 x 512 f32 = 1.5 MiB each, top-2, 4 layers: 48 MiB of experts.
MODEL = dict(layers=4, experts=8, experts_per_tok=2, hidden=256, moe_intermediate=512, heads=4, kv_heads=2,
             vocab=1024, dtype="f32")
NODES = ("n1", "n2")
# The same total: one process gets all of it; the coordinator (trunk, KV cache, working buffers) and each node
# (its experts' cache and working buffers) share it.
TOTAL_BUDGET = 176 * MIB
COORDINATOR_BUDGET = 72 * MIB
NODE_BUDGET = (TOTAL_BUDGET - COORDINATOR_BUDGET) // len(NODES)
PROMPT_IDS = "5,77,300,12,9,41,600,8"
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "OPENBLAS_NUM_THREADS": "1", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def sh(*argv, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, **ENV, "XDG_STATE_HOME": str(cwd)}, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def build(work: Path) -> None:
    """Model, split, signature, plan (R = 1 over the two nodes), and the per-node and coordinator directories."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest
    from shardtool.runtime import encode_plan, make_plan

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sh(VENV_BIN / "shardtool", "keygen", "--out", "a", "--no-passphrase", cwd=work)
    make_mixtral_without_eos(work / "hf", MODEL)
    sh(VENV_BIN / "shardtool", "split", "-q", work / "hf", work / "full", "--model-id", MODEL_ID, "--version", "1",
       cwd=work)
    sh(VENV_BIN / "shardtool", "sign", work / "full", "--key", "a.key", cwd=work)
    verified = load_trusted_manifest(work / "full" / "manifest.msgpack", [load_public_key(work / "a.pub")], 1,
                                     work / "plan-state")
    plan = make_plan(verified, [(n, NODE_BUDGET, None) for n in NODES], 1)
    (work / "plan.json").write_bytes(encode_plan(plan))
    for name, files in [("coordinator", plan.coordinator_files),
                        *((f"node-{n.name}", ["config.json", *n.files()]) for n in plan.nodes)]:
        for rel in [*files, "manifest.msgpack"]:
            (work / name / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(work / "full" / rel, work / name / rel)


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
                                     env={**os.environ, **ENV, "XDG_STATE_HOME": str(cwd)})

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


def one_run(work: Path, directory: str, tokens: int, *, cluster: str | None, budget: int) -> dict:
    """verify-and-run with --print-ids: the time each token reached stdout, and its JSON report."""
    report = work / f"report-{time.monotonic_ns()}.json"
    argv = [VENV_BIN / "verify-and-run", work / directory, "--trust", work / "a.pub", "--state-dir", work / "state",
            "--model-id", MODEL_ID, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", str(tokens), "--print-ids", "-q",
            "--memory-budget", str(budget), "--readers", "1", "--json-report", report]
    if cluster:
        argv += ["--cluster", cluster, "--plan", work / "plan.json"]
    proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work,
                            env={**os.environ, **ENV, "XDG_STATE_HOME": str(work)}, stdin=subprocess.DEVNULL)
    stamps, text = [], ""
    while True:
        ch = proc.stdout.read(1)
        if not ch:
            break
        text += ch.decode()
        if ch in (b" ", b"\n"):
            stamps.append(time.perf_counter())
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise RuntimeError(f"verify-and-run exited {proc.returncode}: {err[-2000:]}")
    summary = json.loads(report.read_text())
    report.unlink()
    return {"ids": text.split(), "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "report": summary}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    build(work)
    temp = Path(tempfile.mkdtemp(prefix="st-ray-", dir="/tmp"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = Group([VENV_BIN / "ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", port, "--block",
                  "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", temp, "--disable-usage-stats",
                  "--object-store-memory", 96 * MIB, "--ray-client-server-port", free_port(),
                  "--dashboard-agent-listen-port", free_port(), "--metrics-export-port", free_port(),
                  "--runtime-env-agent-port", free_port(), "--dashboard-agent-grpc-port", free_port()],
                 work / "head.log", work)
    nodes = []
    try:
        head.wait_for("Ray runtime started")
        for name in NODES:
            nodes.append(Group([VENV_BIN / "shardtool", "node", work / f"node-{name}", "--trust", work / "a.pub",
                                "--state-dir", work / f"state-{name}", "--plan", work / "plan.json", "--name", name,
                                "--memory-budget", NODE_BUDGET, "--address", address, "--readers", "1"],
                               work / f"node-{name}.log", work))
        for name, node in zip(NODES, nodes):
            node.wait_for(f"node {name} ready")
        runs = {"1 process": [], "coordinator + 2 nodes": []}
        for _ in range(args.repeats):  # interleaved: drift in the machine's load hits both alike
            runs["1 process"].append(one_run(work, "full", args.tokens, cluster=None, budget=TOTAL_BUDGET))
            runs["coordinator + 2 nodes"].append(one_run(work, "coordinator", args.tokens, cluster=address,
                                                         budget=COORDINATOR_BUDGET))
    finally:
        for node in nodes:
            node.stop()
        head.stop()
        shutil.rmtree(temp, ignore_errors=True)
    local, remote = runs["1 process"], runs["coordinator + 2 nodes"]
    same = all(r["ids"] == local[0]["ids"] for r in local + remote)
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
        }
    ref = rows["1 process"]["decode_tokens_per_s"]
    print(f"\n## coordinator + {len(NODES)} nodes vs 1 process on loopback ({args.tokens} new tokens, "
          f"{args.repeats} runs each, total budget {TOTAL_BUDGET // MIB} MiB; same tokens: {same})")
    print(f"{'set-up':<24} {'decode tok/s':>12} {'ratio':>6} {'p50 s/token':>12} {'wire B/token':>13} "
          f"{'in Ray calls':>13} {'calls/token':>12}")
    for name, row in rows.items():
        print(f"{name:<24} {row['decode_tokens_per_s']:12.2f} {row['decode_tokens_per_s'] / ref:6.2f} "
              f"{row['p50_seconds_per_token']:12.4f} {row['wire_bytes_per_fed_token']:13.0f} "
              f"{row['ray_call_share']:13.1%} {row['node_calls_per_fed_token']:12.2f}")
    if args.json:
        args.json.write_text(json.dumps({"same_tokens": same, "rows": rows}, indent=2) + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
