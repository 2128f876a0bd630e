"""`make bench`: every benchmark, one after the other (each prints medians and ratios vs its reference)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["bench_audit.py", "bench_split.py", "bench_runtime.py", "bench_serve.py", "bench_receipts.py",
              "bench_cluster.py", "bench_pull.py", "bench_cache_policy.py"]


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        path = HERE / name
        if not path.exists():
            print(f"(skipping {name}: not present)")
            continue
        print(f"\n# {name}", flush=True)
        if subprocess.run([sys.executable, str(path)]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
