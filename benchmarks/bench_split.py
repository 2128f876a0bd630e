"""Benchmark `shardtool split` against `cp -r` of the same checkpoint, alternately, in one run; and the peak
memory of `shardtool join` on a checkpoint with one 2 GiB trunk file.

Generates (or reuses) a Hugging Face-layout checkpoint of at least --size-gib under --dir with
examples/make_tiny_moe.py, then times N rounds of `cp -r` and `shardtool split`, alternating which goes
first. Before every timed command the previous output is deleted and `sync` flushes dirty pages (untimed), so
neither tool pays for the other's writeback. Prints medians of wall and CPU seconds, the split/cp ratio of
each (target <= 1.15) and split's peak RSS (bound: largest tensor + 256 MiB). With --sync it also times
`split --fsync` against `cp -r && sync`, the like-for-like durable pair.

Then (unless --no-join) it generates a second checkpoint whose embedding, tied to the output head, is one
2 GiB tensor (so `trunk/embed.safetensors` is a 2 GiB shard), splits it once (untimed) and runs `shardtool
join` on it N times under GNU time: peak RSS median, bound 256 MiB (join streams every shard).

    python benchmarks/bench_split.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1024 * 1024
GiB = 1024 * MiB
RSS_SLACK = 256 * MiB
TARGET_RATIO = 1.15
JOIN_RSS_BOUND = 256 * MiB

# Mixtral-shaped: 16 MiB BF16 expert matrices, 48 MiB per expert file; about 2.6 GiB at the defaults.
KNOBS = {"layers": 6, "experts": 8, "hidden": 2048, "moe_intermediate": 4096, "intermediate": 4096, "heads": 16,
         "kv_heads": 4, "vocab": 32000, "dtype": "bf16", "shard_size_mb": 1000.0}


def checkpoint(base: Path, family: str, size_gib: float) -> Path:
    """Reuse or generate a checkpoint of at least `size_gib` (scaled by layer count).

    Generated in a child process: a child's ru_maxrss starts from its parent's RSS at fork, so this
    process stays small to keep the RSS measured for `split` honest.
    """
    knobs = dict(KNOBS)
    per_layer = knobs["experts"] * 3 * knobs["hidden"] * knobs["moe_intermediate"] * 2
    knobs["layers"] = max(2, -(-int(size_gib * GiB - 300 * MiB) // per_layer))
    path = base / f"ckpt-{family}-{knobs['layers']}L"
    if not (path / "config.json").exists():
        print(f"generating {path} ...", file=sys.stderr)
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_moe.py"), str(path), "--family", family,
                        "--overwrite", *flags], check=True, stdout=subprocess.DEVNULL)
    return path


# One 2 GiB tensor: the embedding, 262,144 x 4,096 BF16, tied to the head; everything else small.
BIG_TRUNK_KNOBS = {"layers": 2, "experts": 2, "hidden": 4096, "moe_intermediate": 64, "intermediate": 64,
                   "heads": 32, "kv_heads": 8, "vocab": 262144, "dtype": "bf16", "shard_size_mb": 5000.0}


def big_trunk_checkpoint(base: Path) -> Path:
    path = base / "ckpt-big-trunk"
    if not (path / "config.json").exists():
        print(f"generating {path} ...", file=sys.stderr)
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in BIG_TRUNK_KNOBS.items()]
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_moe.py"), str(path), "--family",
                        "mixtral", "--tie-word-embeddings", "--overwrite", *flags], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def join_rss(base: Path, runs: int) -> dict:
    """Split the big-trunk checkpoint once, then join it `runs` times: peak RSS of each join."""
    src = big_trunk_checkpoint(base)
    split_out, rebuilt = base / "big-trunk-split", base / "big-trunk-rebuilt"
    clean(split_out)
    timed([*shardtool_cmd(), "split", str(src), str(split_out), "-q", "--model-id", "bench", "--no-fsync"])
    largest = max(p.stat().st_size for p in split_out.rglob("*.safetensors"))
    peaks, walls = [], []
    for i in range(runs):
        clean(rebuilt)
        wall, peak, _ = timed([*shardtool_cmd(), "join", str(split_out), str(rebuilt), "-q", "--insecure-no-verify"])
        peaks.append(peak)
        walls.append(wall)
        print(f"run {i + 1} join           {wall:7.2f} s  peak RSS {peak / MiB:7.1f} MiB", file=sys.stderr)
    clean(rebuilt)
    clean(split_out)
    return {"largest_shard_bytes": largest, "join_peak_rss_bytes": statistics.median(peaks),
            "join_peak_rss_max_bytes": max(peaks), "join_median_seconds": statistics.median(walls),
            "join_rss_bound_bytes": JOIN_RSS_BOUND, "join_rss_ok": max(peaks) <= JOIN_RSS_BOUND}


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def largest_tensor(path: Path) -> int:
    from shardtool.checkpoint import read_header

    return max(t.nbytes for f in path.glob("*.safetensors") for t in read_header(f).tensors)


def shardtool_cmd() -> list[str]:
    script = Path(sys.executable).parent / "shardtool"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from shardtool.cli import main; sys.argv[0] = 'shardtool'; main()"]


TIME = Path("/usr/bin/time")


def timed(cmd: list[str], *, shell_sync: bool = False) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, CPU seconds) of one command; `shell_sync` adds a sync inside the timing.

    Peak RSS comes from GNU time (%M) when installed: its child starts from time's own small RSS.
    Otherwise from wait4(), which also counts this process's RSS at fork (an upper bound). CPU seconds
    (user + system) are the work done, which other load on the machine does not inflate as it does wall time.
    """
    use_time = TIME.exists()
    full = [str(TIME), "-f", "%M %U %S", *cmd] if use_time else cmd
    start = time.perf_counter()
    # Without PYTHONDONTWRITEBYTECODE: split runs from cached bytecode, as an installed tool does.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    if shell_sync:
        os.sync()
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {code}:\n{err}")
    if use_time:
        rss_kib, user, system = err.strip().splitlines()[-1].split()
        return wall, int(rss_kib) * 1024, float(user) + float(system)
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime  # Linux reports KiB


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # untimed: flush the deleted tree and the previous run's dirty pages
    time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardtool-bench"), help="work directory (reused)")
    ap.add_argument("--family", default="mixtral", help="make_tiny_moe family (mixtral: per-expert; fused: 3-D)")
    ap.add_argument("--size-gib", type=float, default=2.5, help="checkpoint size to generate (>= 2)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="also time split --fsync vs cp -r && sync")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    ap.add_argument("--no-join", action="store_true", help="skip join's peak RSS on a 2 GiB trunk file")
    ap.add_argument("--no-split", action="store_true", help="skip split against cp -r")
    args = ap.parse_args(argv)
    if args.size_gib < 2:
        ap.error("--size-gib must be at least 2")

    args.dir.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    ok = True
    if not args.no_split:
        result.update(split_vs_cp(args))
        ok = ok and result["rss_ok"]
    if not args.no_join:
        joined = join_rss(args.dir, args.runs)
        result.update(joined)
        print(f"\njoin of a split with a {joined['largest_shard_bytes'] / GiB:.2f} GiB trunk file, {args.runs} runs: "
              f"median peak RSS {joined['join_peak_rss_bytes'] / MiB:.1f} MiB, max "
              f"{joined['join_peak_rss_max_bytes'] / MiB:.1f} MiB (bound {JOIN_RSS_BOUND / MiB:.0f} MiB: "
              f"{'ok' if joined['join_rss_ok'] else 'EXCEEDED'})", file=sys.stderr)
        ok = ok and joined["join_rss_ok"]
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if ok else 1


def split_vs_cp(args: argparse.Namespace) -> dict:
    src = checkpoint(args.dir, args.family, args.size_gib)
    size = tree_bytes(src)
    biggest = largest_tensor(src)
    subprocess.run(["cat", *map(str, sorted(src.iterdir()))], stdout=subprocess.DEVNULL, check=True)  # warm cache

    variants = {
        "cp": lambda dst: (["cp", "-r", str(src), str(dst)], False),
        # cp -r does not flush; compare like with like (split's default --fsync is timed against cp+sync).
        "split": lambda dst: ([*shardtool_cmd(), "split", str(src), str(dst), "-q", "--model-id", "bench",
                               "--no-fsync"], False),
    }
    if args.sync:
        variants["cp+sync"] = lambda dst: (["cp", "-r", str(src), str(dst)], True)
        variants["split --fsync"] = lambda dst: (
            [*shardtool_cmd(), "split", str(src), str(dst), "-q", "--model-id", "bench", "--fsync"], False)
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    rss: dict[str, list[int]] = {k: [] for k in variants}
    names = list(variants)
    for i in range(args.runs):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            dst = args.dir / "out"
            clean(dst)
            cmd, sync_inside = variants[name](dst)
            wall, peak, seconds = timed(cmd, shell_sync=sync_inside)
            times[name].append(wall)
            cpu[name].append(seconds)
            rss[name].append(peak)
            print(f"run {i + 1} {name:14s} {wall:7.2f} s  {size / wall / 1e9:5.2f} GB/s  CPU {seconds:5.2f} s  "
                  f"peak RSS {peak / MiB:7.1f} MiB", file=sys.stderr)
    clean(args.dir / "out")

    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    ratio = med["split"] / med["cp"]
    paired = statistics.median(s / c for s, c in zip(times["split"], times["cp"]))  # each round's own ratio
    cpu_ratio = med_cpu["split"] / med_cpu["cp"]
    peak = max(rss["split"])
    bound = biggest + RSS_SLACK
    result = {
        "checkpoint": str(src), "bytes": size, "runs": args.runs, "median_seconds": med,
        "median_cpu_seconds": med_cpu,
        "ratio_split_over_cp": round(ratio, 3), "median_paired_ratio": round(paired, 3),
        "cpu_ratio_split_over_cp": round(cpu_ratio, 3), "target_ratio": TARGET_RATIO,
        "split_peak_rss_bytes": peak, "largest_tensor_bytes": biggest, "rss_bound_bytes": bound,
        "ratio_ok": ratio <= TARGET_RATIO, "rss_ok": peak < bound,
    }
    if args.sync:
        result["ratio_fsync_over_cp_sync"] = round(med["split --fsync"] / med["cp+sync"], 3)
    load = os.getloadavg()
    result["load_average"] = [round(x, 2) for x in load]
    print(f"\ncheckpoint {src} ({size / GiB:.2f} GiB, largest tensor {biggest / MiB:.0f} MiB), {args.runs} runs, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.2f} (hashing needs a core of its own)", file=sys.stderr)
    for k, v in med.items():
        print(f"  median {k:14s} {v:6.2f} s ({size / v / 1e9:.2f} GB/s), CPU {med_cpu[k]:.2f} s", file=sys.stderr)
    print(f"  ratio split/cp        {ratio:6.2f}  (target <= {TARGET_RATIO}: {'ok' if ratio <= TARGET_RATIO else 'MISSED'})",
          file=sys.stderr)
    print(f"  median of the rounds' own split/cp ratios {paired:.2f}; CPU seconds split/cp {cpu_ratio:.2f}",
          file=sys.stderr)
    if args.sync:
        print(f"  ratio split --fsync / cp+sync {result['ratio_fsync_over_cp_sync']:6.2f}", file=sys.stderr)
    print(f"  split peak RSS        {peak / MiB:6.1f} MiB (bound {bound / MiB:.0f} MiB: "
          f"{'ok' if peak < bound else 'EXCEEDED'})", file=sys.stderr)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
