"""verify-and-run decode speed against llama.cpp on the same weights (`make bench-llamacpp`; not in `make bench`).

The model: examples/make_tiny_moe.py's Mixtral layout with no EOS in its config; `small` is 54 M params in f32
(hidden 512, 4 layers x 8 experts, moe-intermediate 1024, vocab 1024); `--big` adds 829 M params in bf16 (hidden
1024, 8 layers x 16 experts, moe-intermediate 2048). Both runtimes get the same 8-token prompt as token ids and
decode 128 tokens greedily; EOS ends neither run (the config names none, and llama.cpp's tokens are taken by our
own argmax loop, which never stops early).

llama.cpp: llama-cpp-python built from its PyPI sdist with GGML_NATIVE=ON (`make bench-llamacpp` builds it into
.venv-bench once; `_llamacpp.py` holds the paths, conversion, quantization and the greedy command). The checkpoint
is converted with the sdist's own vendored convert_hf_to_gguf.py and gguf-py (run by .venv-bench's python) to F32,
F16, BF16 and Q8_0 GGUFs; Q4_0 is llama.cpp's own quantizer
(llama_model_quantize) applied to the F32 GGUF, the reference for `split --quantize int4`. F32 weights run with
an F32 KV cache (type_k = type_v = f32, so that the arithmetic is the one verify-and-run does); the other formats
with llama.cpp's default F16 KV cache.

The tokenizer: `_llamacpp.py` registers our per-model tokenizer's hash as GPT-2's pre-tokenizer for the converter
(its docstring says why and how); everything else is the unmodified converter.

Decode only, for both runtimes (neither counts load, verification of the manifest, or prefill):
- verify-and-run ("shardtool X" rows): its --json-report's `decode_tokens_per_s` = (new tokens - 1) / the wall
  seconds of the forward steps that fed generated tokens (the prompt's steps are prefill; the first new token
  comes from prefill). The page cache is warm (every model runs once before the timed rounds), but an expert first
  routed to after the prompt is read and verified inside a decode step: the rows say how many MiB per token.
- "shardtool X cached" rows: the same Session verify-and-run builds, in a process of our own, with every expert
  read and verified into its cache before generating: the decode steps are compute only (0 MiB read).
- llama.cpp: after loading, one throw-away generation (graphs allocated), then the KV cache is cleared and
  llama.cpp's own performance counters reset; the prompt is evaluated in one batch, then 127 single-token
  llama_decode calls; tok/s = n_eval / t_eval from llama_perf_context (the time inside llama_decode).
Runs are interleaved (every runtime and format, then the next round) and the table gives medians.
shardtool's variants: float (the checkpoint's dtype), int8 / int4 (`split --quantize`: routed experts only) and
int8-trunk (`--quantize int8 --quantize-trunk`: the trunk's linear weights too, the tensors llama.cpp's Q8_0
quantizes), each against the llama.cpp format of PAIRS.

Usage: python benchmarks/bench_llamacpp.py [--repeats 3] [--tokens 128] [--big] [--threads 1,2]
       [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _llamacpp  # noqa: E402  (benchmarks/ is not a package)
from _harness import agreement, make_mixtral_without_eos, split_and_sign  # noqa: E402
from _llamacpp import LLAMA_CPP_VERSION  # noqa: E402

PROMPT = [5, 17, 300, 42, 9, 100, 7, 250]
MODELS = {
    "small": dict(layers=4, experts=8, hidden=512, moe_intermediate=1024, heads=8, kv_heads=2, vocab=1024,
                  dtype="f32"),
    "big": dict(layers=8, experts=16, hidden=1024, moe_intermediate=2048, heads=8, kv_heads=2, vocab=1024,
                dtype="bf16"),
}
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")  # Q4_0: llama.cpp's quantizer, from the F32 GGUF
# split's arguments of each quantized variant: int8 / int4 experts, and int8 experts and trunk (what Q8_0 quantizes)
QUANT_ARGS = {"int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"],
              "int8-trunk": ["--quantize", "int8", "--quantize-trunk"]}
QUANTS = tuple(QUANT_ARGS)
# Which llama.cpp format each shardtool variant is compared with (ratio and token agreement).
PAIRS = [("float", "F32"), ("float", "F16"), ("float", "BF16"), ("float", "Q8_0"), ("int8", "Q8_0"),
         ("int8-trunk", "Q8_0"),
         ("int4", "Q4_0")]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def say(msg: str) -> None:
    print(msg, flush=True)


# --- the repo venv side -------------------------------------------------------------------------------------------

def shardtool_bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def quant_variants() -> list[str]:
    """The quantized variants this shardtool's split can make (older ones have no --quantize or --quantize-trunk)."""
    out = subprocess.run([shardtool_bin("shardtool"), "split", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"}).stdout
    return [q for q, args in QUANT_ARGS.items() if all(a in out for a in args if a.startswith("--"))]


def build(work: Path, name: str, quants: list[str], formats: list[str]) -> dict[str, Path]:
    """Checkpoint, the GGUFs of `formats` (and F32, Q4_0's source) and signed splits of model `name`. Each is made
    once, under a temporary name renamed when complete, and reused while the knobs (kept in a marker) stay the
    same."""
    base = work / name
    marker = base / "knobs.json"
    want = {"knobs": MODELS[name], "llama_cpp": LLAMA_CPP_VERSION}
    if not (marker.exists() and json.loads(marker.read_text()) == want):
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        marker.write_text(json.dumps(want))
    ggufs = [t for t in GGUF_TYPES if t in formats or (t == "F32" and "Q4_0" in formats)]
    paths = {f"gguf-{t}": base / f"model-{t}.gguf" for t in ggufs}
    paths.update({"float": base / "split-float", **{q: base / f"split-{q}" for q in quants}})
    ck = base / "ck"
    if all(p.exists() for p in paths.values()):
        shutil.rmtree(ck, ignore_errors=True)
        return paths
    if not ck.exists():
        say(f"[{name}] generating the checkpoint ({MODELS[name]})")
        shutil.rmtree(base / "ck.tmp", ignore_errors=True)
        make_mixtral_without_eos(base / "ck.tmp", MODELS[name])
        (base / "ck.tmp").rename(ck)
    for t in ggufs:
        out = paths[f"gguf-{t}"]
        if out.exists():
            continue
        say(f"[{name}] llama.cpp {t} GGUF")
        if t == "Q4_0":
            _llamacpp.quantize(paths["gguf-F32"], out, t)
        else:
            _llamacpp.convert(ck, t.lower(), out)
    for variant in ["float", *quants]:
        out = paths[variant]
        if out.exists():
            continue
        extra = [] if variant == "float" else QUANT_ARGS[variant]
        say(f"[{name}] shardtool split {' '.join(extra)} + sign")
        split_and_sign(ck, out, f"bench/{name}-{variant}", extra, work / "bench.key")
    shutil.rmtree(ck)
    return paths


def run_shardtool(work: Path, model: Path, threads: int, tokens: int) -> dict:
    report = work / "report.json"
    report.unlink(missing_ok=True)
    proc = subprocess.run([shardtool_bin("verify-and-run"), str(model), "--trust", str(work / "bench.pub"),
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(tokens),
                           "--memory-budget", "8GiB", "--print-ids", "--state-dir", str(model.parent / "state"),
                           "--threads", str(threads), "--readers", str(threads), "--json-report", str(report), "-q"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_llamacpp: verify-and-run {model} exited {proc.returncode}: {proc.stderr[-2000:]}")
    rep = json.loads(report.read_text())
    return {"tok_s": rep["decode_tokens_per_s"], "ids": rep["generated_ids"],
            "expert_bytes_per_token": rep.get("decode_expert_bytes_per_token") or 0}


def _cached(model: str, pub: str, threads: str, tokens: str, out: str) -> None:
    """Repo venv: verify-and-run's Session in-process, every expert read and verified into its cache first, so
    that the decode steps timed are compute only (verify-and-run's own figure includes first-use reads)."""
    from shardtool.cli import _common

    # What verify-and-run --threads N --readers N does before numpy loads (the helper's name differs by version).
    (getattr(_common, "set_compute_threads", None) or _common.set_blas_threads)(int(threads), int(threads))
    _common.keep_freed_memory()
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_verified_manifest
    from shardtool.runtime import Session

    verified = load_verified_manifest(Path(model) / "manifest.msgpack", [load_public_key(Path(pub))], 1)
    session = Session(Path(model), verified, budget=8 << 30, max_tokens=len(PROMPT) + int(tokens),
                      readers=int(threads))
    try:
        session.store.get_many([e for e in verified.entries if e.kind == "expert"])
        report = session.generate(PROMPT, int(tokens), temperature=0.0, top_p=1.0, seed=None, on_token=lambda t: None)
    finally:
        session.close()
    Path(out).write_text(json.dumps({"decode_tokens_per_s": (report.new_tokens - 1) / report.decode_seconds,
                                     "generated_ids": report.generated,
                                     "decode_expert_bytes": report.decode_expert_bytes}))


def run_cached(work: Path, model: Path, threads: int, tokens: int) -> dict:
    out = work / "cached.json"
    out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, __file__, "--_run", "cached", str(model), str(work / "bench.pub"),
                           str(threads), str(tokens), str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_llamacpp: cached decode of {model} exited {proc.returncode}: {proc.stderr[-2000:]}")
    rep = json.loads(out.read_text())
    return {"tok_s": rep["decode_tokens_per_s"], "ids": rep["generated_ids"],
            "expert_bytes_per_token": rep["decode_expert_bytes"] / max(tokens - 1, 1)}


def run_llama(work: Path, gguf: Path, threads: int, tokens: int) -> dict:
    rep = _llamacpp.greedy(gguf, PROMPT, tokens, work / "llama.json", threads=threads,
                           f32_kv=gguf.name.endswith("-F32.gguf"))
    return {"tok_s": rep["decode_tokens_per_s"], "ids": rep["generated_ids"], "system_info": rep["system_info"]}


def bench_model(work: Path, name: str, paths: dict[str, Path], quants: list[str], threads: list[int], repeats: int,
                tokens: int, formats: list[str], modes: list[str]) -> dict:
    variants = ["float", *quants]
    candidates = {f"llama.cpp {t}": (run_llama, paths[f"gguf-{t}"]) for t in formats}
    if "report" in modes:
        candidates.update({f"shardtool {v}": (run_shardtool, paths[v]) for v in variants})
    if "cached" in modes:
        candidates.update({f"shardtool {v} cached": (run_cached, paths[v]) for v in variants})
    for run, path in candidates.values():  # page cache warm, and every model loads once before the timed rounds
        run(work, path, threads[0], 2)
    runs: dict[tuple[str, int], list[dict]] = {(c, t): [] for c in candidates for t in threads}
    for r in range(repeats):
        for t in threads:
            for label, (run, path) in candidates.items():
                runs[(label, t)].append(run(work, path, t, tokens))
        say(f"[{name}] round {r + 1}/{repeats} done")
    med = {k: median([x["tok_s"] for x in v]) for k, v in runs.items()}
    ids = {label: runs[(label, threads[0])][-1]["ids"] for label in candidates}
    for label in candidates:  # greedy decoding of the same weights gives the same tokens run after run
        if any(x["ids"] != ids[label] for t in threads for x in runs[(label, t)]):
            say(f"note: {label} gave different tokens in different runs or thread counts")
    knobs = MODELS[name]
    thr = " / ".join(str(t) for t in threads)
    say(f"\n## {name} model: {knobs['layers']} layers x {knobs['experts']} experts, hidden {knobs['hidden']}, "
        f"moe-intermediate {knobs['moe_intermediate']}, {knobs['dtype']}; {len(PROMPT)}-token prompt, {tokens} greedy "
        f"tokens; decode tok/s at {thr} threads, medians of {repeats} interleaved runs")
    say("(shardtool X: verify-and-run's report, first-use expert reads included; X cached: the same Session with "
        "every expert verified into its cache first)")
    say(f"{'runtime, weights':<24} {'tok/s':>15}   runs")
    for label in candidates:
        cells = " / ".join(f"{med[(label, t)]:.1f}" for t in threads)
        detail = " | ".join(" ".join(f"{x['tok_s']:.0f}" for x in runs[(label, t)]) for t in threads)
        if label.startswith("shardtool"):
            b = median([x["expert_bytes_per_token"] for t in threads for x in runs[(label, t)]])
            detail += f"   (expert MiB read+verified per decode token: {b / 2**20:.2f})"
        say(f"{label:<24} {cells:>15}   {detail}")
    say(f"\n{'shardtool / llama.cpp':<18} {'ratio':>13} {'ratio cached':>14}   same greedy tokens (of {tokens})")
    pairs = {}
    for ours, ref in PAIRS:
        a, b = f"shardtool {ours}", f"llama.cpp {ref}"
        if ours not in variants:
            say(f"{ours + ' / ' + ref:<18} {'skipped':>13}   (this shardtool's split has no --quantize {ours})")
            continue
        if b not in candidates:
            continue

        def ratios(label: str) -> list[float | None]:  # None: that mode was not run (--modes)
            return [med[(label, t)] / med[(b, t)] if label in candidates else None for t in threads]

        def ratio_cells(values: list[float | None]) -> str:
            return " / ".join("-" if x is None else f"{x:.2f}" for x in values)

        ratio, cached = ratios(a), ratios(a + " cached")
        agree = agreement(ids.get(a) or ids[a + " cached"], ids[b])
        say(f"{ours + ' / ' + ref:<18} {ratio_cells(ratio):>13} {ratio_cells(cached):>14}   {agree}")
        pairs[f"{ours}/{ref}"] = {"ratio": dict(zip(map(str, threads), ratio)),
                                  "ratio_cached": dict(zip(map(str, threads), cached)), "agreement": agree}
    for q in quants:
        mode = "" if "report" in modes else " cached"
        agree = agreement(ids[f"shardtool {q}{mode}"], ids[f"shardtool float{mode}"])
        say(f"shardtool {q} vs shardtool float: same greedy tokens {agree}")
    return {"tok_s": {f"{k[0]} @{k[1]}": v for k, v in med.items()}, "pairs": pairs, "knobs": knobs,
            "ids": ids, "llama_cpp_system_info": runs[(f"llama.cpp {formats[0]}", threads[0])][0].get("system_info")}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_run":
        mode, *rest = sys.argv[2:]
        {"cached": _cached}[mode](*rest)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts for both runtimes")
    ap.add_argument("--formats", default=",".join(GGUF_TYPES), help="llama.cpp GGUF formats to run")
    ap.add_argument("--modes", default="report,cached",
                    help="shardtool rows: report (verify-and-run's own figure), cached (experts cached first)")
    ap.add_argument("--big", action="store_true", help="also the 829 M-parameter bf16 model (~1.7 GB, slow)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-llamacpp"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        threads = []
    formats, modes = args.formats.split(","), args.modes.split(",")
    if (not threads or min(threads) < 1 or args.repeats < 1 or args.tokens < 2 or not formats
            or not set(formats) <= set(GGUF_TYPES) or not modes or not set(modes) <= {"report", "cached"}):
        print(f"bench_llamacpp: --threads wants positive integers like 1,2; --repeats >= 1; --tokens >= 2; --formats "
              f"some of {','.join(GGUF_TYPES)}; --modes some of report,cached", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so that subprocess.run ends the child it is waiting for: none is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not (ready := _llamacpp.available()):
        print(f"bench_llamacpp: {ready.reason}", file=sys.stderr)
        return 2
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "bench.key").exists():
        subprocess.run([shardtool_bin("shardtool"), "keygen", "--out", str(work / "bench"), "--no-passphrase"],
                       check=True, capture_output=True)
    quants = quant_variants()
    if not quants:
        say("note: this shardtool's split has no --quantize: the quantized rows are skipped")
    say(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: trust ratios, not times)")
    results = {}
    for name in ["small", *(["big"] if args.big else [])]:
        paths = build(work, name, quants, formats)
        results[name] = bench_model(work, name, paths, quants, threads, args.repeats, args.tokens, formats, modes)
    say(f"\nllama.cpp: {results['small']['llama_cpp_system_info']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
