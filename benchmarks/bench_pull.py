"""Pull speed: `shardtool pull` (the real CLI) vs fsspec's own unverified copy of the same files, in one run.

Two stores on 127.0.0.1, both started here in their own process group and killed by it at the end:
  s3    moto's server mode (`python -m moto.server`), the files uploaded with `shardtool push`;
        reference: `fsspec.filesystem("s3").get(prefix, dir, recursive=True)`
  http  aiohttp's static file handler (sendfile, range requests; not the bottleneck, unlike `python -m
        http.server`, which copies through 64 KiB Python reads);
        reference: `fsspec.filesystem("http").get(urls, paths)` of the listed files (an HTTP store has no
        listing an operator could rely on)
Two data sets, signed (`shardtool manifest` + `sign`):
  big    --gib GiB in 32 MiB shards (64 at the default 2 GiB)
  small  --small files of 16 KiB (5,000 by default)
moto is slow per request (each costs it milliseconds of Python, and every ranged GET reads the whole object):
uploading 5,000 small files into it and reading them 8 times would take a full run well past ~15 minutes on two
shared cores, so from it the small set is --s3-small files (1,000); the big set is --s3-gib GiB (2, as for http).
Both sides run as a fresh process (the reference is a short Python script), so both pay interpreter start-up;
before every timed run DEST is removed and `sync` flushes dirty pages (untimed), so no run pays for another's
writeback. pull's own flush before the manifest (one syncfs) is inside its time; the reference never syncs,
so the big sets also time "fsspec get + sync" (the like-for-like durable copy) for comparison.
Prints medians, throughput and the ratio pull/reference (time; the throughput ratio is its inverse). Target:
pull's throughput >= 0.9x the reference's on both sets and both stores.
Usage: python benchmarks/bench_pull.py [--gib 2] [--small 5000] [--s3-gib 2] [--s3-small 1000] [--repeats 3]
                                       [--stores s3,http] [--sets big,small] [--jobs 4]
                                       [--workdir /tmp/shardtool-bench-pull] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VENV_BIN, compare, print_table, run_command  # noqa: E402
from bench_audit import signed_dir  # noqa: E402

PY = str(VENV_BIN / "python")
SHARDTOOL = str(VENV_BIN / "shardtool")
BUCKET = "shardtool-bench"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

HTTP_SERVER = """
import sys
from aiohttp import web
app = web.Application()
app.router.add_static("/", sys.argv[1], show_index=False, follow_symlinks=False)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""

# fsspec's unverified copy: what an operator would type without shardtool.
REFERENCE = """
import json, os, sys
import fsspec
kind, src, dest, listing = sys.argv[1:5]
if kind == "s3":
    fsspec.filesystem("s3").get(src.rstrip("/") + "/", dest, recursive=True)
else:
    rel = json.load(open(listing))
    fsspec.filesystem("http").get([src + r for r in rel], [os.path.join(dest, r) for r in rel])
if len(sys.argv) > 5 and sys.argv[5] == "sync":
    os.sync()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], port: int, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode} (log: {log})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"{' '.join(argv)} did not listen on port {port} within 60 s")


def stop_server(proc: subprocess.Popen) -> None:
    """End the server's whole process group (it was started in its own session), and nothing else."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def listed(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def reset(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    os.sync()


def bench_case(store: str, name: str, root: Path, url: str, ref_src: str, env: dict, work: Path, repeats: int,
               jobs: int, with_sync: bool) -> dict:
    files = listed(root)
    total = sum((root / f).stat().st_size for f in files)
    listing = work / f"{root.name}.files.json"
    listing.write_text(json.dumps(files))
    dest = work / "dest"
    pull = [SHARDTOOL, "pull", url, str(dest), "--trust", str(work / "bench.pub"), "--model-id", f"bench/{root.name}",
            "--state-dir", str(work / "state"), "--quiet", "--jobs", str(jobs)]
    ref = [PY, "-c", REFERENCE, store, ref_src, str(dest), str(listing)]
    candidates = {
        "fsspec get (unverified)": lambda: run_command(ref, env=env),
        "shardtool pull": lambda: run_command(pull, env=env),
    }
    if with_sync:
        candidates["fsspec get + sync"] = lambda: run_command([*ref, "sync"], env=env)
    for what, fn in candidates.items():  # warm up and check that each works and copies every file
        reset(dest)
        fn()
        got = listed(dest)
        if got != files:
            raise RuntimeError(f"{store}/{name}: {what} copied {len(got)} files, expected {len(files)}")
        if what == "shardtool pull":
            audit = subprocess.run([SHARDTOOL, "audit", str(dest), "--trust", str(work / "bench.pub"), "--quiet",
                                    "--state-dir", str(work / "state-audit")], capture_output=True, text=True)
            if audit.returncode != 0:
                raise RuntimeError(f"{store}/{name}: audit of the pulled copy failed: {audit.stderr[-500:]}")
    series = compare(candidates, repeats, before_each=lambda: reset(dest))
    reset(dest)
    result = print_table(f"{store} {name}: {len(files)} files, {total / 2**20:.1f} MiB", series,
                         "fsspec get (unverified)", bytes_total=total)
    ratio = series["fsspec get (unverified)"].median / series["shardtool pull"].median
    print(f"pull throughput / unverified throughput: {ratio:.3f}  (target >= 0.9)")
    result["throughput_ratio"] = ratio
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--small", type=int, default=5_000)
    ap.add_argument("--s3-gib", type=float, default=2.0)
    ap.add_argument("--s3-small", type=int, default=1_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stores", default="s3,http")
    ap.add_argument("--sets", default="big,small")
    ap.add_argument("--jobs", type=int, default=16, help="shardtool pull --jobs (its default is 16)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-pull"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "bench.key").exists():
        subprocess.run([SHARDTOOL, "keygen", "--out", str(work / "bench"), "--no-passphrase"], check=True,
                       capture_output=True)
    src = work / "src"
    src.mkdir(exist_ok=True)
    sets = [s for s in args.sets.split(",") if s]
    big_size = 32 * 2**20
    stores = [s for s in args.stores.split(",") if s]
    # (store, set) -> the directory of that size: sets of other sizes get their own name (and model ID)
    dirs = {}
    for store in stores:
        gib, small = (args.s3_gib, args.s3_small) if store == "s3" else (args.gib, args.small)
        if "big" in sets:
            dirs[store, "big"] = src / f"big-{gib:g}gib"
            signed_dir(dirs[store, "big"], int(gib * 2**30 // big_size), big_size, work / "bench.key", 1)
        if "small" in sets:
            dirs[store, "small"] = src / f"small-{small}"
            signed_dir(dirs[store, "small"], small, 16 * 1024, work / "bench.key", 2)
    results: dict = {}
    for store in stores:
        port = free_port()
        if store == "s3":
            env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
            server = start_server([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, env,
                                  work / "moto.log")
        elif store == "http":
            env = {}
            server = start_server([PY, "-c", HTTP_SERVER, str(src), str(port)], port, log=work / "http.log")
        else:
            sys.exit(f"bench_pull: unknown store {store!r} (s3, http)")
        try:
            if store == "s3":
                import boto3

                boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], **{
                    "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                    "region_name": "us-east-1"}).create_bucket(Bucket=BUCKET)
            for name in sets:
                root = dirs[store, name]
                if store == "s3":
                    url = f"s3://{BUCKET}/{root.name}"
                    t0 = time.perf_counter()
                    subprocess.run([SHARDTOOL, "push", str(root), url, "--quiet", "--jobs", "8"], check=True,
                                   env={**os.environ, **env})
                    print(f"(uploaded {root.name} to moto in {time.perf_counter() - t0:.1f} s)", flush=True)
                    ref_src = f"{BUCKET}/{root.name}"
                else:
                    url = f"http://127.0.0.1:{port}/{root.name}/"
                    ref_src = url
                results[f"{store}/{name}"] = bench_case(store, name, root, url, ref_src, env, work,
                                                        args.repeats, args.jobs, name == "big")
        finally:
            stop_server(server)
    print("\n## summary: pull throughput / fsspec unverified throughput (target >= 0.9)")
    for case, r in results.items():
        print(f"{case:<12} {r['throughput_ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
