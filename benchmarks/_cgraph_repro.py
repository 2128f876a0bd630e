"""Why a Ray Compiled Graph over `shardtool node` actors hung or killed the nodes, reproduced (issue 39).

Starts bench_cluster's loopback cluster (a Ray head and two `shardtool node`s), then runs `--drivers` drivers one
after the other, each compiling a graph over both node actors (`info` bound to the input, `MultiOutputNode`),
executing it `--calls` times and leaving as `--teardown` says; then checks that both node processes still run (a
node whose actor stops answering its health check leaves). Prints one line per try.
  shutdown  ray.shutdown() only: Ray tears its graphs down with kill_actors=True, killing the node actors
  explicit  teardown(kill_actors=False) first: the nodes live on
  exit      no teardown (a SIGKILLed driver): its loop keeps a `_ray_system` thread of each node actor; with one
            such thread (Ray's default) the next driver's first execution hangs

Usage: python benchmarks/_cgraph_repro.py [--tries 3] [--calls 200] [--teardown exit --drivers 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cluster as bc  # noqa: E402

MIB = 2**20

_DRIVER = r'''
import json, sys, time, statistics
import ray
from ray.dag import InputNode, MultiOutputNode
from shardtool.runtime.engine._cluster_node import NAMESPACE, actor_name, new_nonce
address, calls, teardown = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
out = {}
nodes = [ray.get_actor(actor_name(n), namespace=NAMESPACE) for n in ("n1", "n2")]
with InputNode() as inp:
    dag = MultiOutputNode([n.info.bind(inp) for n in nodes])
t0 = time.perf_counter()
compiled = dag.experimental_compile()
out["compile_s"] = time.perf_counter() - t0
t = []
try:
    for i in range(calls + 10):
        t0 = time.perf_counter(); ray.get(compiled.execute(new_nonce()), timeout=20); t.append(time.perf_counter() - t0)
    out["median_ms"] = statistics.median(t[10:]) * 1e3
except Exception as e:
    out["error"] = f"after {len(t)} executions: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
print("RESULT " + json.dumps(out), flush=True)
if teardown == "explicit":
    compiled.teardown(kill_actors=False)
elif teardown == "exit":  # a driver that dies (SIGKILL, os._exit): no teardown at all
    import os; os._exit(0)
ray.shutdown()
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--teardown", choices=("explicit", "shutdown", "exit"), default="shutdown",
                    help="explicit: teardown(kill_actors=False) before ray.shutdown; shutdown: Ray's atexit teardown; exit: "
                         "the driver exits without teardown")
    ap.add_argument("--drivers", type=int, default=1, help="drivers run one after the other on the same nodes")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "shardtool-cgraph-repro")
    args = ap.parse_args()
    work = args.workdir
    bc.build_loopback(work)
    os.environ.update(bc.RAY_ENV)
    for n in range(args.tries):
        cluster = bc.LoopbackCluster(work, 128 * MIB)
        try:
            result = {}
            for d in range(args.drivers):
                proc = subprocess.run([sys.executable, "-c", _DRIVER, cluster.address, str(args.calls), args.teardown],
                                      capture_output=True, text=True, cwd=work, timeout=300,
                                      env={**os.environ, "XDG_STATE_HOME": str(work)})
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                result[f"driver {d}"] = json.loads(line[7:]) if line else {"driver_failed": proc.stderr[-1500:]}
            time.sleep(12)  # two of the nodes' health checks (every 5 s)
            result["nodes_alive_after"] = [node.proc.poll() is None for node in cluster.nodes]
            print(f"try {n}: " + json.dumps(result), flush=True)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
