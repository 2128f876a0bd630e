"""Benchmark harness: run commands alternately, take medians, print ratios against a reference
measured in the same run. The machine is shared and noisy: trust the ratios, not the absolute times.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

VENV_BIN = Path(sys.executable).parent


@dataclass
class Sample:
    seconds: float
    peak_rss_mib: float


@dataclass
class Series:
    name: str
    samples: list[Sample] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(s.seconds for s in self.samples)

    @property
    def peak_rss_mib(self) -> float:
        return max(s.peak_rss_mib for s in self.samples)


TIME = "/usr/bin/time"


def command_env(extra: dict | None = None) -> dict:
    """The environment a timed command runs in: ours, without PYTHONDONTWRITEBYTECODE, so our commands run from
    cached bytecode as an installed tool does (the warm-up run writes it); with that variable set, every run
    of an editable install compiles the modules changed since the last write again (~0.1 CPU-s a start)."""
    env = {**os.environ, **(extra or {})}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_command(argv: Sequence[str], *, env: dict | None = None, check: bool = True) -> Sample:
    """Wall time and peak RSS of one command.

    Peak RSS comes from GNU time's %M where it exists: Linux carries a parent's high-water RSS across
    fork and exec, so wait4() on a child of this (large) Python process would report our own size.
    """
    wrapped = [TIME, "-f", "shardtool-bench-maxrss-kib=%M", *argv] if os.path.exists(TIME) else list(argv)
    start = time.perf_counter()
    proc = subprocess.run(wrapped, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=command_env(env))
    seconds = time.perf_counter() - start
    err = proc.stderr.decode(errors="replace")
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {err[-2000:]}")
    rss_kib = 0.0
    for line in err.splitlines():
        if line.startswith("shardtool-bench-maxrss-kib="):
            rss_kib = float(line.split("=", 1)[1])
    return Sample(seconds, rss_kib / 1024)


def compare(candidates: dict[str, Callable[[], Sample]], repeats: int, *, before_each: Callable[[], None] | None = None
            ) -> dict[str, Series]:
    """Run each candidate `repeats` times, interleaved, so drift in machine load hits all of them alike."""
    series = {name: Series(name) for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            if before_each:
                before_each()
            series[name].samples.append(fn())
    return series


def print_table(title: str, series: dict[str, Series], reference: str, *, bytes_total: int | None = None) -> dict:
    ref = series[reference].median
    print(f"\n## {title}")
    print(f"{'what':<28} {'median s':>9} {'ratio':>7} {'GB/s':>7} {'peak RSS MiB':>13}  runs")
    result = {}
    for name, s in series.items():
        gbps = f"{bytes_total / s.median / 1e9:7.2f}" if bytes_total else "      -"
        ratio = s.median / ref
        print(f"{name:<28} {s.median:9.3f} {ratio:7.3f} {gbps} {s.peak_rss_mib:13.1f}  "
              + " ".join(f"{x.seconds:.3f}" for x in s.samples))
        result[name] = {"median_s": s.median, "ratio_vs_" + reference: ratio, "peak_rss_mib": s.peak_rss_mib}
    sys.stdout.flush()
    return result


def drop_caches() -> bool:
    """Cold-cache runs need root and a writable /proc/sys/vm/drop_caches; say so when we cannot."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def make_mixtral_without_eos(ck: Path, knobs: dict) -> None:
    """A tiny Mixtral checkpoint (examples/make_tiny_moe.py with `knobs`) whose config names no EOS token, so
    every run, ours and any reference, generates exactly the tokens asked for."""
    make_without_eos(ck, knobs, "mixtral")


def make_without_eos(ck: Path, knobs: dict, family: str) -> None:
    """`make_mixtral_without_eos` for any family make_tiny_moe.py generates."""
    import json

    repo = Path(__file__).resolve().parents[1]
    args = [x for k, v in knobs.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    subprocess.run([sys.executable, str(repo / "examples" / "make_tiny_moe.py"), str(ck), "--family", family,
                    *args], check=True, capture_output=True)
    config = json.loads((ck / "config.json").read_text())
    config["eos_token_id"] = None
    (ck / "config.json").write_text(json.dumps(config, indent=2))
    gen = ck / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g.pop("eos_token_id", None)
        gen.write_text(json.dumps(g, indent=2))


def split_and_sign(ck: Path, out: Path, model_id: str, extra: Sequence[str], key: Path) -> Path:
    """`shardtool split` of checkpoint `ck` (with `extra` options, e.g. --quantize int4) and `sign` with `key`, made
    under a temporary name and renamed to `out` when complete."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([str(VENV_BIN / "shardtool"), "split", "-q", str(ck), str(tmp), "--model-id", model_id, *extra],
                   check=True, capture_output=True)
    subprocess.run([str(VENV_BIN / "shardtool"), "sign", str(tmp), "--key", str(key)], check=True, capture_output=True)
    tmp.rename(out)
    return out


def agreement(a: list[int], b: list[int]) -> str:
    """How two greedy runs' tokens agree: how many positions hold the same token, and the first that differs."""
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return f"{same}/{len(a)}" + ("" if first is None else f" (first difference at token {first})")
