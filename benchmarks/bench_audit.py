"""Audit speed: `shardtool audit` vs b3sum, sha256sum and sigstore's model_signing on the same files.

Two data sets, warm page cache (plus a cold-cache round where the machine allows dropping caches):
  big    >= 2 GiB in 64 shard-sized files
  small  20,000 small files
Prints medians and ratios against b3sum measured in the same run, then the four audit / b3sum ratios
(warm big, warm small, cold big, cold small). Thread counts: b3sum's default (all cores) against audit's
default --workers (all cores); the summary names the count.
Usage: python benchmarks/bench_audit.py [--gib 2] [--small 20000] [--repeats 5] [--workdir /tmp/shardtool-bench]
       [--no-cold] [--b3sum-only] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VENV_BIN, compare, drop_caches, print_table, run_command  # noqa: E402


def make_files(root: Path, count: int, size: int, seed: int) -> None:
    """Files under the split layout's names, random content (incompressible, no dedup shortcuts)."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=max(size, 1), dtype=np.uint8).tobytes()
    for i in range(count):
        layer, expert = divmod(i, 256)
        p = root / f"experts/layer-{layer:03d}/expert-{expert:04d}.safetensors"
        p.parent.mkdir(parents=True, exist_ok=True)
        # Vary each file so no two are alike.
        p.write_bytes(i.to_bytes(8, "little") + block[8:size])


def signed_dir(root: Path, count: int, size: int, key: Path, seed: int) -> None:
    if (root / "manifest.msgpack").exists():
        return
    if root.exists():
        shutil.rmtree(root)
    make_files(root, count, size, seed)
    shardtool = str(VENV_BIN / "shardtool")
    subprocess.run([shardtool, "manifest", str(root), "--model-id", f"bench/{root.name}"], check=True)
    subprocess.run([shardtool, "sign", str(root), "--key", str(key)], check=True)


def file_list(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.safetensors"))


def model_signing_available() -> str | None:
    """sigstore's model_signing CLI: $MODEL_SIGNING_BIN (make bench installs it into .venv-bench, apart from
    our own environment, since it pins its own cryptography stack), else PATH."""
    exe = os.environ.get("MODEL_SIGNING_BIN") or shutil.which("model_signing")
    return exe if exe and os.path.exists(exe) else None


def bench_set(name: str, root: Path, key_pub: Path, state: Path, repeats: int, cold: bool, others: bool = True) -> dict:
    files = file_list(root)
    total = sum(Path(f).stat().st_size for f in files)
    shardtool = str(VENV_BIN / "shardtool")
    candidates = {
        "b3sum": lambda: run_command(["b3sum", *files]),
        "shardtool audit": lambda: run_command([shardtool, "audit", str(root), "--trust", str(key_pub), "--quiet",
                                                "--state-dir", str(state)]),
    }
    if others:
        candidates["sha256sum"] = lambda: run_command(["sha256sum", *files])
    ms = model_signing_available() if others else None
    if ms:
        sig = root.parent / f"{root.name}.sig"
        priv, pub = root.parent / "ms_key.pem", root.parent / "ms_pub.pem"
        if not priv.exists():
            subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(priv)], check=True)
            subprocess.run(["openssl", "ec", "-in", str(priv), "-pubout", "-out", str(pub)], check=True,
                           capture_output=True)
        if not sig.exists():
            subprocess.run([ms, "sign", "key", str(root), "--private_key", str(priv), "--signature", str(sig),
                            "--ignore-paths", str(root / "manifest.msgpack")], check=True, capture_output=True)
        candidates["model_signing verify"] = lambda: run_command(
            [ms, "verify", "key", str(root), "--signature", str(sig), "--public_key", str(pub),
             "--ignore-paths", str(root / "manifest.msgpack")])
    for fn in candidates.values():  # warm the page cache and check every tool works
        fn()
    series = compare(candidates, repeats)
    out = {"warm": print_table(f"{name}: {len(files)} files, {total / 2**30:.2f} GiB, warm cache", series, "b3sum",
                               bytes_total=total)}
    if cold:
        if drop_caches():
            cold_series = compare({k: candidates[k] for k in ("b3sum", "shardtool audit")}, repeats,
                                  before_each=drop_caches)
            out["cold"] = print_table(f"{name}: cold cache", cold_series, "b3sum", bytes_total=total)
        else:
            print(f"\n## {name}: cold cache not measured (cannot write /proc/sys/vm/drop_caches here)")
    return out


def print_summary(results: dict, repeats: int) -> None:
    """The four figures the README quotes: audit's median over b3sum's median, each pair measured interleaved."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\n## audit / b3sum (medians of {repeats} interleaved runs; both on all {cores} cores: b3sum's default "
          f"threads, audit's default --workers)")
    for cache in ("warm", "cold"):
        for name in ("big", "small"):
            table = results[name].get(cache)
            figure = f"{table['shardtool audit']['ratio_vs_b3sum']:.2f}" if table else "not measured"
            print(f"{cache:<5} {name:<6} {figure}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--small", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench"))
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--b3sum-only", action="store_true", help="skip sha256sum and model_signing (the slow references)")
    args = ap.parse_args()
    if not shutil.which("b3sum"):
        sys.exit("bench_audit: b3sum not found (Debian: apt-get install b3sum)")
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    key = work / "bench"
    if not (work / "bench.key").exists():
        subprocess.run([str(VENV_BIN / "shardtool"), "keygen", "--out", str(key), "--no-passphrase"], check=True,
                       capture_output=True)
    big_size = 32 * 2**20
    big_count = int(args.gib * 2**30 // big_size)
    signed_dir(work / "big", big_count, big_size, work / "bench.key", 1)
    signed_dir(work / "small", args.small, 16 * 1024, work / "bench.key", 2)
    state = work / "state"
    others = not args.b3sum_only
    results = {"big": bench_set("big", work / "big", work / "bench.pub", state, args.repeats, not args.no_cold, others),
               "small": bench_set("small", work / "small", work / "bench.pub", state, args.repeats, not args.no_cold,
                                  others)}
    print_summary(results, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
