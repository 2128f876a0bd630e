"""The native kernels behind `_packed.matmul_t` against numpy's float32 product (OpenBLAS gemv), decode-shaped.

For each stored kind and each projection shape of issue 16's two models (hidden 512 / moe-intermediate 1024 and
hidden 1024 / moe-intermediate 2048: gate/up [inter, hidden], down [hidden, inter]), one row x [1, in] times W.T:
  kernel  `_packed.matmul_t(x, packed)` with the weight in its stored dtype, `set_threads(t)`
  numpy   `w_f32 @ x[0]`, the same shape in float32 (the reference path's product once a weight is float32)
Weights rotate through copies totalling >= --pool-mib so each product streams its weight from memory, as decode does
(one use of each expert per token), not from cache (default: twice the CPU's last-level cache, at least 96 MiB; a
96 MiB pool fits in a 105 MiB L3). Threads 1 and 2: each count runs in its own process with
OPENBLAS_NUM_THREADS set to it. Per round, kernel and numpy alternate; medians of --rounds rounds; ratio = numpy
time / kernel time (> 1: the kernel is faster), GB/s = stored bytes of the weight (data + scales) per second; at
1 thread also the ratio of the calling thread's CPU times (both run there), steadier on a shared machine.
Where the kernels run on AVX-512 (the one-row products of q8, q4, mxfp4, f32, f16 and bf16 weights), the same products
on the AVX2 kernels alternate with them too: "avx2 us" and "512 gain" = AVX2 time / AVX-512 time.
Also the Python cost of one `matmul_t` call on a tiny weight (what a decode step pays per product besides the math).

Usage: python benchmarks/bench_kernels.py [--rounds 5] [--pool-mib N] [--threads 1,2] [--kinds f32,bf16,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # (out, in)
    "512/1024 gate,up": (1024, 512),
    "512/1024 down": (512, 1024),
    "1024/2048 gate,up": (2048, 1024),
    "1024/2048 down": (1024, 2048),
}


def _packed_weight(kind: str, out: int, inp: int, rng):
    import numpy as np

    from shardtool.runtime.model import _packed

    return _packed.from_float(rng.standard_normal((out, inp)).astype(np.float32), kind)


def _copies(p, count: int):
    """`count` copies of a Packed weight in distinct memory (the contents do not matter to the time)."""
    import numpy as np

    from shardtool.runtime.model._packed import Packed

    return [Packed(p.kind, p.shape, np.array(p.data), None if p.scale is None else np.array(p.scale), p.block)
            for _ in range(count)]


def _time_per_call(fn, items, x) -> float:
    return _times_per_call(fn, items, x)[0]


def _times_per_call(fn, items, x) -> tuple[float, float]:
    """Wall seconds and this thread's CPU seconds per call."""
    start, cpu = time.perf_counter(), time.thread_time()
    for item in items:
        fn(x, item)
    return (time.perf_counter() - start) / len(items), (time.thread_time() - cpu) / len(items)


def child(args) -> None:
    """One thread count (OPENBLAS_NUM_THREADS already set): print one JSON line per (kind, shape)."""
    import numpy as np

    from shardtool.runtime.model import _packed

    if _packed.kernels() is None:
        sys.exit("bench_kernels: the _kernels extension is not built (run `make install`)")
    _packed.set_threads(args.threads_one)
    native = _packed._native
    best = _packed.kernels()
    rng = np.random.default_rng(0)
    pool = args.pool_mib * 2**20
    for shape_name, (out, inp) in SHAPES.items():
        f32 = rng.standard_normal((out, inp)).astype(np.float32)
        ref = [np.array(f32) for _ in range(max(2, -(-pool // f32.nbytes)))]
        x = rng.standard_normal((1, inp)).astype(np.float32)
        for kind in args.kinds:
            p = _packed_weight(kind, out, inp, rng)
            ws = _copies(p, max(2, -(-pool // p.nbytes)))
            kernel_t, numpy_t, avx2_t = [], [], []
            # AVX-512 and AVX2 kernels to compare
            both = best == "avx512" and kind in ("q8", "q4", "mxfp4", "f32", "f16", "bf16")
            _time_per_call(_packed.matmul_t, ws[:2], x)  # warm-up
            for _ in range(args.rounds):
                kernel_t.append(_times_per_call(_packed.matmul_t, ws, x))
                numpy_t.append(_times_per_call(lambda v, w: w @ v[0], ref, x))
                if both:
                    native.use_simd("avx2")
                    avx2_t.append(_time_per_call(_packed.matmul_t, ws, x))
                    native.use_simd(True)
            k, n = (statistics.median(t[0] for t in kernel_t), statistics.median(t[0] for t in numpy_t))
            kc, nc = (statistics.median(t[1] for t in kernel_t), statistics.median(t[1] for t in numpy_t))
            a = statistics.median(avx2_t) if avx2_t else float("nan")
            print(json.dumps(dict(threads=args.threads_one, shape=shape_name, kind=kind, kernel_us=k * 1e6,
                                  numpy_us=n * 1e6, ratio=n / k, gbs=p.nbytes / k / 1e9,
                                  numpy_gbs=f32.nbytes / n / 1e9, cpu_ratio=nc / kc, avx2_us=a * 1e6,
                                  avx512_gain=a / k, isa=best)), flush=True)
            del ws
    tiny = _packed_weight("f32", 8, 32, rng)
    xt = np.ones((1, 32), np.float32)
    calls = []
    for _ in range(args.rounds):
        calls.append(_time_per_call(_packed.matmul_t, [tiny] * 20000, xt))
    print(json.dumps(dict(threads=args.threads_one, call_us=statistics.median(calls) * 1e6)), flush=True)


def default_pool_mib() -> int:
    """Twice the largest CPU cache sysfs reports (the last level), at least 96 MiB: a pool that fits in the cache
    would time cache reads, not memory."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip()
        try:
            largest = max(largest, int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]])
        except (ValueError, KeyError, IndexError):
            continue
    return max(96, -(-2 * largest // 2**20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool-mib", type=int, default=None, help="default: twice the last-level cache, >= 96")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kinds", default="f32,f16,bf16,fp8,q8,q4,mxfp4")
    ap.add_argument("--threads-one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.kinds = args.kinds.split(",")
    if args.pool_mib is None:
        args.pool_mib = default_pool_mib()
    if args.threads_one:
        child(args)
        return
    rows = []
    for t in (int(v) for v in args.threads.split(",")):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(t), "OMP_NUM_THREADS": str(t)}
        argv = [sys.executable, __file__, "--threads-one", str(t), "--rounds", str(args.rounds), "--pool-mib",
                str(args.pool_mib), "--kinds", ",".join(args.kinds)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            sys.exit(f"bench_kernels: threads={t} failed: {done.stderr.strip()[-2000:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print(f"decode-shaped products x[1, in] @ W.T, medians of {args.rounds} interleaved rounds, weights streamed "
          f"from a {args.pool_mib} MiB pool; kernels: {next((r['isa'] for r in rows if 'isa' in r), '?')}")
    print("ratio = numpy wall / kernel wall; cpu ratio (1 thread only, where both run on the calling thread) = the "
          "same with this thread's CPU time, which a busy machine's scheduling does not inflate")
    print(f"{'thr':>3} {'shape (out x in)':<28} {'kind':<6} {'kernel us':>10} {'numpy f32 us':>13} "
          f"{'ratio':>6} {'GB/s':>6} {'numpy GB/s':>10} {'cpu ratio':>9} {'avx2 us':>8} {'512 gain':>8}")
    for r in rows:
        if "call_us" in r:
            continue
        out, inp = SHAPES[r["shape"]]
        print(f"{r['threads']:>3} {r['shape'] + f' ({out}x{inp})':<28} {r['kind']:<6} {r['kernel_us']:>10.1f} "
              f"{r['numpy_us']:>13.1f} {r['ratio']:>6.2f} {r['gbs']:>6.1f} {r['numpy_gbs']:>10.1f} "
              f"{r['cpu_ratio'] if r['threads'] == 1 else float('nan'):>9.2f} {r['avx2_us']:>8.1f} "
              f"{r['avx512_gain']:>8.2f}")
    for r in rows:
        if "call_us" in r:
            print(f"threads {r['threads']}: one matmul_t call on an [8, 32] f32 weight: {r['call_us']:.2f} us")


if __name__ == "__main__":
    main()
