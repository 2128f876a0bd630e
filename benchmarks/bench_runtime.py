"""verify-and-run benchmarks, each against a reference measured in the same run (medians, interleaved runs):
  (a) memory: expert shards >= 4x the memory budget; peak RSS must stay <= budget + 150 MiB
  (b) decode tokens/s versus transformers on the CPU, same model and prompt, 1 thread and default threads; and
      versus the runtime's own numpy reference (SHARDTOOL_KERNELS=0) in the same run
  (c) streaming with a budget that forces expert misses: read+verify throughput on misses versus b3sum over
      the same expert files (the store's N reader threads against `b3sum --num-threads N`, wall clock), and
      the share of token time verification costs
  (d) budgets under attack: a signed DeepSeek FP8 config claiming 8192x8192 scale blocks under 64 MiB, and a
      3,000-token prompt under 40 MiB; peak RSS must stay <= budget + 150 MiB
  (e) lookahead prefetch, every family, float and `split --quantize int8` experts: a shard cache of the trunk + a
      quarter of the experts, verify-and-run with --lookahead against --no-lookahead (interleaved): time waiting for
      shards per new token (target: at least halved), prediction recall, expert cache hit rate; and decode speed
      against warm decode (the same Session with every expert verified into its cache first, so its decode steps
      are compute only): streaming / warm (target >= 0.8 with lookahead)
Usage: python benchmarks/bench_runtime.py [--parts abcde] [--repeats 3] [--tokens 32] [--speed-tokens 128]
       [--budget-mib 256] [--workdir DIR] [--json FILE]   (part e: --parts e --repeats 5)
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import command_env, VENV_BIN, make_mixtral_without_eos, Sample, run_command  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 300, 42, 9, 100, 7, 250]
MIB = 2**20
RSS_SLACK_MIB = 150

# make_tiny_moe.py knobs. The speed models: transformers runs them in float32 (its CPU bf16 matmuls are not what an
# operator would choose), the runtime multiplies each weight in its stored dtype and accumulates in float32, so f32
# compares like with like and small-bf16 shows what a bf16 checkpoint gains over its f32 twin. The streaming models
# come in f32 (verification against the cheapest possible compute) and bf16 (what Mixtral/Qwen checkpoints ship).
MODELS = {
    "tiny": dict(layers=2, experts=4, hidden=64, moe_intermediate=40, heads=4, kv_heads=2, vocab=512, dtype="f32"),
    "small": dict(layers=4, experts=8, hidden=512, moe_intermediate=1024, heads=8, kv_heads=2, vocab=1024,
                  dtype="f32"),
    "small-bf16": dict(layers=4, experts=8, hidden=512, moe_intermediate=1024, heads=8, kv_heads=2, vocab=1024,
                       dtype="bf16"),
    # 8 layers x 24 experts x 6.3 MB = 1.2 GB of experts: > 4x a 256 MiB budget.
    "stream": dict(layers=8, experts=24, hidden=512, moe_intermediate=1024, heads=8, kv_heads=2, vocab=1024,
                   dtype="f32"),
    # 8 layers x 48 experts x 3.1 MB = 1.2 GB of experts.
    "stream-bf16": dict(layers=8, experts=48, hidden=512, moe_intermediate=1024, heads=8, kv_heads=2, vocab=1024,
                        dtype="bf16"),
}
STREAM_MODELS = ("stream", "stream-bf16")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(xs, spec=".2f"):
    return " ".join(format(x, spec) for x in xs)


# --- building the models ------------------------------------------------------------------------------

def build(work: Path, name: str) -> Path:
    """Generate, split and sign model `name` once (reused across runs); returns the split directory."""
    out, marker = work / name / "model", work / name / "signed.json"
    if marker.exists() and json.loads(marker.read_text()) == MODELS[name]:
        return out
    shutil.rmtree(work / name, ignore_errors=True)
    ck = work / name / "ck"
    make_mixtral_without_eos(ck, MODELS[name])
    shardtool = str(VENV_BIN / "shardtool")
    subprocess.run([shardtool, "split", "-q", str(ck), str(out), "--model-id", f"bench/{name}"], check=True,
                   capture_output=True)
    subprocess.run([shardtool, "sign", str(out), "--key", str(work / "bench.key")], check=True, capture_output=True)
    if name in STREAM_MODELS:
        shutil.rmtree(ck)  # 1.2 GB; only the speed models' checkpoints are read again (by transformers)
    marker.write_text(json.dumps(MODELS[name]))
    return out


def expert_files(model: Path) -> list[Path]:
    return sorted(model.glob("experts/*/*.safetensors"))


def verify_and_run(work: Path, model: Path, budget: str, tokens: int, env: dict | None = None,
                   extra: tuple = ()) -> tuple[Sample, dict]:
    report = work / "report.json"
    report.unlink(missing_ok=True)
    sample = run_command([str(VENV_BIN / "verify-and-run"), str(model), "--trust", str(work / "bench.pub"),
                          "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(tokens),
                          "--memory-budget", budget, "--print-ids", "--state-dir", str(model.parent / "state"),
                          "--json-report", str(report), "-q", *extra], env=env)
    return sample, json.loads(report.read_text())


def in_subprocess(mode: str, *args, env: dict | None = None) -> dict:
    """Run one of this file's `--_run` helpers in a fresh process and return the JSON it writes."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-runtime-{os.getpid()}.json"
    proc = subprocess.run([sys.executable, __file__, "--_run", mode, str(out), *map(str, args)], capture_output=True,
                          text=True, env=command_env(env))
    if proc.returncode != 0:
        raise RuntimeError(f"bench_runtime --_run {mode} exited {proc.returncode}: {proc.stderr[-3000:]}")
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


# --- (a) memory ---------------------------------------------------------------------------------------

def part_a(work: Path, repeats: int, tokens: int, budget_mib: int) -> dict:
    out = {}
    for name in STREAM_MODELS:
        model = build(work, name)
        experts = sum(p.stat().st_size for p in expert_files(model))
        runs = [verify_and_run(work, model, f"{budget_mib}MiB", tokens) for _ in range(repeats)]
        peak = max(s.peak_rss_mib for s, _ in runs)
        limit = budget_mib + RSS_SLACK_MIB
        r = runs[-1][1]
        print(f"\n## (a) memory, {name}: {experts / 2**30:.2f} GiB of {MODELS[name]['dtype']} expert shards = "
              f"{experts / (budget_mib * MIB):.1f}x the {budget_mib} MiB budget, {tokens} new tokens")
        print(f"peak RSS {peak:.1f} MiB (runs: {fmt([s.peak_rss_mib for s, _ in runs], '.1f')}) vs limit "
              f"{limit} MiB (budget + {RSS_SLACK_MIB}): {'OK' if peak <= limit else 'OVER'}")
        print(f"plan: shard cache {r['budget']['shard_cache'] / MIB:.1f} MiB, KV {r['budget']['kv_cache'] / MIB:.1f} "
              f"MiB, working {r['budget']['working'] / MIB:.1f} MiB; peak cached "
              f"{r['cache']['peak_cached_bytes'] / MIB:.1f} MiB; {r['cache']['misses']} misses, "
              f"{r['cache']['evictions']} evictions; read {r['bytes_read'] / 2**30:.2f} GiB")
        out[name] = {"expert_bytes": experts, "budget_mib": budget_mib, "peak_rss_mib": peak, "limit_mib": limit,
                     "ok": peak <= limit, "runs_peak_rss_mib": [s.peak_rss_mib for s, _ in runs],
                     "all_tokens": all(len(rep["generated_ids"]) == tokens for _, rep in runs)}
    return out


# --- (d) budgets under attack ------------------------------------------------------------------------------

# The attack suite's tiny shapes (tests/attacks/_attackkit.py); DeepSeek's quantised dimensions all <= 128, so
# each weight has one scale and a config claiming bigger blocks still fits the shards' scale shapes.
ATTACK_KNOBS = dict(layers=2, experts=4, hidden=32, moe_intermediate=16, intermediate=48, vocab=300, heads=4)
LONG_PROMPT = [3 + i % 290 for i in range(3000)]


def build_attack(work: Path, name: str) -> Path:
    """'fp8-block-8192': DeepSeek-V3 FP8 whose signed config.json says weight_block_size [8192, 8192];
    'long-prompt': the attack suite's Mixtral."""
    out = work / name / "model"
    if (work / name / "signed.json").exists():
        return out
    shutil.rmtree(work / name, ignore_errors=True)
    ck = work / name / "ck"
    family, extra = (("deepseek_v3", ["--fp8", "--kv-heads", "4"]) if name == "fp8-block-8192"
                     else ("mixtral", ["--kv-heads", "2", "--experts-per-tok", "2"]))
    knobs = [x for k, v in ATTACK_KNOBS.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_moe.py"), str(ck), "--family", family, *knobs,
                    *extra], check=True, capture_output=True)
    if name == "fp8-block-8192":
        config = json.loads((ck / "config.json").read_text())
        config["quantization_config"]["weight_block_size"] = [8192, 8192]
        (ck / "config.json").write_text(json.dumps(config, indent=2))
    shardtool = str(VENV_BIN / "shardtool")
    subprocess.run([shardtool, "split", "-q", str(ck), str(out), "--model-id", f"bench/{name}"], check=True,
                   capture_output=True)
    subprocess.run([shardtool, "sign", str(out), "--key", str(work / "bench.key")], check=True, capture_output=True)
    (work / name / "signed.json").write_text("{}")
    return out


def part_d(work: Path, repeats: int) -> dict:
    cases = {"fp8-block-8192": (64, [5, 6, 7], 4), "long-prompt": (40, LONG_PROMPT, 4)}
    out = {}
    print("\n## (d) budgets under attack: peak RSS of verify-and-run (GNU time %M)")
    for name, (budget_mib, prompt, tokens) in cases.items():
        model = build_attack(work, name)
        report = work / "report.json"
        argv = [str(VENV_BIN / "verify-and-run"), str(model), "--trust", str(work / "bench.pub"), "--prompt-ids",
                ",".join(map(str, prompt)), "--max-new-tokens", str(tokens), "--memory-budget", f"{budget_mib}MiB",
                "--print-ids", "--state-dir", str(model.parent / "state"), "--json-report", str(report), "-q"]
        runs = []
        for _ in range(repeats):
            report.unlink(missing_ok=True)
            sample = run_command(argv, check=False)
            runs.append((sample, json.loads(report.read_text()) if report.exists() else None))
        peak = max(s.peak_rss_mib for s, _ in runs)
        limit = budget_mib + RSS_SLACK_MIB
        rep = runs[-1][1]
        verdict = "refused up front" if rep is None else ("OK" if peak <= limit else "OVER")
        print(f"{name}: {len(prompt)}-token prompt, {budget_mib} MiB budget: peak RSS {peak:.1f} MiB (runs: "
              f"{fmt([s.peak_rss_mib for s, _ in runs], '.1f')}) vs limit {limit} MiB: {verdict}"
              + ("" if rep is None else f"; prefill {rep['prefill_tokens_per_s']:.0f} tok/s, activations "
                                        f"{rep['budget'].get('activations', 0) / MIB:.1f} MiB"))
        out[name] = {"budget_mib": budget_mib, "peak_rss_mib": peak, "limit_mib": limit, "ok": peak <= limit,
                     "ran": rep is not None, "runs_peak_rss_mib": [s.peak_rss_mib for s, _ in runs]}
    return out


# --- (b) decode speed versus transformers ---------------------------------------------------------------

def part_b(work: Path, repeats: int, tokens: int, models: list[str]) -> dict:
    out = {}
    for name in models:
        model = build(work, name)
        ck = work / name / "ck"
        cores = str(len(os.sched_getaffinity(0)))
        # ours by default: the cores its 2 reader threads leave free (verify-and-run --threads 0). "numpy": the same
        # run without the native kernels (SHARDTOOL_KERNELS=0: each weight expanded to float32 for one BLAS product)
        settings = {"1 thread": ({"OPENBLAS_NUM_THREADS": "1"}, 1, ("--threads", "1")), "default threads": ({}, 0, ()),
                    f"{cores} threads": ({"OPENBLAS_NUM_THREADS": cores}, int(cores), ("--threads", cores))}
        results: dict[str, dict[str, list]] = {s: {"ours": [], "numpy": [], "transformers": []} for s in settings}
        ours_ids, hf_ids = None, None
        for _ in range(repeats):
            for setting, (env, torch_threads, threads) in settings.items():
                _, rep = verify_and_run(work, model, "8GiB", tokens, env=env, extra=threads)
                results[setting]["ours"].append(rep["decode_tokens_per_s"])
                ours_ids = rep["generated_ids"]
                _, rep = verify_and_run(work, model, "8GiB", tokens, env={**env, "SHARDTOOL_KERNELS": "0"},
                                        extra=threads)
                results[setting]["numpy"].append(rep["decode_tokens_per_s"])
                hf = in_subprocess("hf", ck, tokens, torch_threads, env=env)
                results[setting]["transformers"].append(hf["decode_tokens_per_s"])
                hf_ids = hf["generated_ids"]
        print(f"\n## (b) decode tokens/s vs transformers: {name} model ({MODELS[name]}), {len(PROMPT)}-token prompt, "
              f"{tokens} new tokens; same greedy tokens: {ours_ids == hf_ids}")
        print(f"{'threads':<16} {'ours tok/s':>11} {'numpy':>6} {'hf tok/s':>9} {'ratio':>6} {'/numpy':>6}   "
              f"runs (ours | numpy | hf)")
        out[name] = {"same_tokens": ours_ids == hf_ids}
        for setting, r in results.items():
            ratio = median(r["ours"]) / median(r["transformers"])
            gain = median(r["ours"]) / median(r["numpy"])
            print(f"{setting:<16} {median(r['ours']):11.1f} {median(r['numpy']):6.1f} {median(r['transformers']):9.1f} "
                  f"{ratio:6.2f} {gain:6.2f}   {fmt(r['ours'], '.1f')} | {fmt(r['numpy'], '.1f')} | "
                  f"{fmt(r['transformers'], '.1f')}")
            out[name][setting] = {"ours": median(r["ours"]), "numpy": median(r["numpy"]),
                                  "transformers": median(r["transformers"]), "ratio": ratio, "vs_numpy": gain}
    return out


def run_hf(out: Path, ck: str, tokens: str, threads: str) -> None:
    """Subprocess: transformers greedy decode speed = (N - 1) / (t(N new tokens) - t(1 new token))."""
    import torch
    from transformers import AutoModelForCausalLM

    if int(threads):
        torch.set_num_threads(int(threads))
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([PROMPT])
    mask = torch.ones_like(ids)
    n = int(tokens)

    def gen(k):
        with torch.no_grad():
            t = time.perf_counter()
            got = model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False)
            return time.perf_counter() - t, got[0, len(PROMPT):].tolist()

    gen(2)  # warm-up
    one = min(gen(1)[0] for _ in range(3))
    full, generated = gen(n)
    out.write_text(json.dumps({"decode_tokens_per_s": (n - 1) / (full - one), "generated_ids": generated,
                               "threads": torch.get_num_threads()}))


# --- (c) streaming: read + verify on misses --------------------------------------------------------------

def part_c(work: Path, repeats: int, tokens: int, budget_mib: int) -> dict:
    return {name: stream_one(work, name, repeats, tokens, budget_mib) for name in STREAM_MODELS}


STORE_READERS = 2  # the store's reader threads in the sweep: Session's default


def stream_one(work: Path, name: str, repeats: int, tokens: int, budget_mib: int) -> dict:
    model = build(work, name)
    files = [str(p) for p in expert_files(model)]
    total = sum(Path(f).stat().st_size for f in files)
    pub = work / "bench.pub"
    m = {k: [] for k in ("b3sum", "b3sum_1t", "b3sum_nt", "cli", "cli_cpu", "cli_share", "sweep_thread",
                         "sweep_wall", "with", "without")}
    run_command(["b3sum", *files])  # warm the page cache: every run below reads from it
    for _ in range(repeats):  # interleaved, so load on the shared machine hits every candidate alike
        m["b3sum"].append(total / run_command(["b3sum", *files]).seconds)
        m["b3sum_1t"].append(total / run_command(["b3sum", "--num-threads", "1", *files]).seconds)
        m["b3sum_nt"].append(total / run_command(["b3sum", "--num-threads", str(STORE_READERS), *files]).seconds)
        _, rep = verify_and_run(work, model, f"{budget_mib}MiB", tokens)
        sec = rep["seconds"]
        m["cli"].append(rep["bytes_read"] / (sec["read_thread"] + sec["verify_thread"]))
        m["cli_cpu"].append(rep["bytes_read"] / (sec["read_thread_cpu"] + sec["verify_thread_cpu"]))
        m["cli_share"].append(rep["verify_share_of_time"])
        sweep = in_subprocess("sweep", model, pub, budget_mib)
        m["sweep_thread"].append(sweep["per_thread_bytes_per_s"])
        m["sweep_wall"].append(sweep["wall_bytes_per_s"])
        m["with"].append(in_subprocess("decode", model, pub, budget_mib, tokens, "verify")["decode_s"])
        m["without"].append(in_subprocess("decode", model, pub, budget_mib, tokens, "skip-hash")["decode_s"])
    med = {k: median(v) for k, v in m.items()}
    ratio = med["cli"] / med["b3sum"]
    share = 1 - med["without"] / med["with"]
    gb = lambda k: f"{med[k] / 1e9:5.2f} GB/s  runs {fmt([x / 1e9 for x in m[k]])}"  # noqa: E731
    print(f"\n## (c) streaming, {name}: budget {budget_mib} MiB over {total / 2**30:.2f} GiB of "
          f"{MODELS[name]['dtype']} experts, {tokens} new tokens; per run {rep['cache']['misses']} misses, "
          f"{rep['cache']['hits']} hits, {rep['decode_expert_bytes_per_token'] / MIB:.1f} MiB of experts read per "
          f"decode token, decode {rep['decode_tokens_per_s']:.1f} tok/s")
    print(f"b3sum (default threads), warm cache:          {gb('b3sum')}")
    print(f"b3sum --num-threads 1:                         {gb('b3sum_1t')}")
    print(f"verify-and-run read+verify per thread-second:  {gb('cli')}  ratio {ratio:.2f} (target >= 0.7); "
          f"vs b3sum with 1 thread {med['cli'] / med['b3sum_1t']:.2f}")
    print(f"  the same per CPU-second (no waiting for a core): {gb('cli_cpu')}  ratio "
          f"{med['cli_cpu'] / med['b3sum']:.2f}")
    print(f"  store alone, no compute, per thread-second:  {gb('sweep_thread')}  ratio "
          f"{med['sweep_thread'] / med['b3sum']:.2f}")
    print(f"b3sum --num-threads {STORE_READERS}:                         {gb('b3sum_nt')}")
    print(f"  store alone, {STORE_READERS} readers, wall clock:          {gb('sweep_wall')}  ratio "
          f"{med['sweep_wall'] / med['b3sum']:.2f}")
    print(f"store read+verify / b3sum, same thread count ({STORE_READERS}), wall: "
          f"{med['sweep_wall'] / med['b3sum_nt']:.2f} (target >= 0.9)")
    print(f"verification share of decode time: {share:.1%} = 1 - decode without hashing {med['without']:.2f}s / with "
          f"{med['with']:.2f}s (target <= 10%); hashing thread-seconds / wall (report): {med['cli_share']:.1%}")
    return {"b3sum_bytes_per_s": med["b3sum"], "b3sum_1t_bytes_per_s": med["b3sum_1t"], "ours_bytes_per_s": med["cli"],
            "ratio": ratio, "ratio_vs_b3sum_1t": med["cli"] / med["b3sum_1t"],
            "ours_cpu_bytes_per_s": med["cli_cpu"], "cpu_ratio": med["cli_cpu"] / med["b3sum"],
            "sweep_per_thread_ratio": med["sweep_thread"] / med["b3sum"],
            "sweep_wall_ratio": med["sweep_wall"] / med["b3sum"], "verify_share": share,
            "b3sum_same_threads_bytes_per_s": med["b3sum_nt"],
            "store_vs_b3sum_same_threads": med["sweep_wall"] / med["b3sum_nt"],
            "verify_thread_share": med["cli_share"], "decode_s_verify": m["with"], "decode_s_skip_hash": m["without"]}


def _session(model: str, pub: str, budget_mib: str, max_tokens: int):
    from shardtool.cli._common import keep_freed_memory, set_compute_threads

    set_compute_threads(0, 2)  # as verify-and-run does, before numpy loads
    keep_freed_memory()
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_verified_manifest
    from shardtool.runtime.engine._session import Session

    verified = load_verified_manifest(Path(model) / "manifest.msgpack", [load_public_key(Path(pub))], 1)
    return Session(Path(model), verified, budget=int(budget_mib) * MIB, max_tokens=max_tokens, readers=STORE_READERS)


def run_sweep(out: Path, model: str, pub: str, budget_mib: str) -> None:
    """Subprocess: every expert once, two at a time (top-2), through the store alone: no compute competes."""
    session = _session(model, pub, budget_mib, 64)
    store = session.store
    experts = [e for e in session.manifest.entries if e.kind == "expert"]
    t = time.perf_counter()
    for i in range(0, len(experts), STORE_READERS):
        store.get_many(experts[i:i + STORE_READERS])
    wall = time.perf_counter() - t
    s = store.stats
    session.close()
    out.write_text(json.dumps({"per_thread_bytes_per_s": s.bytes_read / (s.read_seconds + s.verify_seconds),
                               "wall_bytes_per_s": s.bytes_read / wall}))


def run_decode(out: Path, model: str, pub: str, budget_mib: str, tokens: str, mode: str) -> None:
    """Subprocess: one generation; with mode skip-hash the store reads without hashing (a benchmark-only
    counterfactual, never a runtime option) to measure what verification adds to token time."""
    session = _session(model, pub, budget_mib, len(PROMPT) + int(tokens))
    if mode == "skip-hash":
        import numpy as np

        import shardtool.runtime.store._store as store_mod
        from shardtool.safeio import open_beneath
        from shardtool.manifest._files import READ_CHUNK, VerifiedBytes

        def read_without_hash(root, entry):
            t = time.perf_counter()
            fd = open_beneath(Path(root), entry.path)
            data = np.empty(entry.size, np.uint8)
            view, done = memoryview(data), 0
            while done < entry.size:
                done += os.readv(fd, [view[done:done + READ_CHUNK]])
            os.close(fd)
            return VerifiedBytes(data, time.perf_counter() - t, 0.0)

        # The name the store calls: patching any other name would leave hashing on and measure nothing.
        if not hasattr(store_mod, "read_verified_timed"):
            raise RuntimeError("shardtool.runtime.store._store no longer reads through read_verified_timed")
        store_mod.read_verified_timed = read_without_hash
    report = session.generate(PROMPT, int(tokens), temperature=0.0, top_p=1.0, seed=None, on_token=lambda t: None)
    session.close()
    out.write_text(json.dumps({"decode_s": report.decode_seconds, "prefill_s": report.prefill_seconds}))


def run_warm(out: Path, model: str, pub: str, tokens: str) -> None:
    """Subprocess: warm decode, the reference of streaming: every expert read and verified into a cache that holds
    them all before generating (the trunk on the prompt's step), so the decode steps are compute only."""
    session = _session(model, pub, str(1 << 16), len(PROMPT) + int(tokens))
    try:
        session.store.get_many([e for e in session.manifest.entries if e.kind == "expert"])
        report = session.generate(PROMPT, int(tokens), temperature=0.0, top_p=1.0, seed=None,
                                  on_token=lambda t: None)
    finally:
        session.close()
    out.write_text(json.dumps({"decode_tokens_per_s": (report.new_tokens - 1) / report.decode_seconds,
                               "generated_ids": report.generated}))


# --- (e) lookahead prefetch --------------------------------------------------------------------------------

LOOKAHEAD_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
# 6 layers x 16 experts of 0.79 MB (bf16): a quarter of the experts is 24 of 96.
LOOKAHEAD_KNOBS = dict(layers=6, experts=16, hidden=256, moe_intermediate=512, intermediate=384, vocab=512,
                       dtype="bf16")


LOOKAHEAD_VARIANTS = ("float", "int8")  # the checkpoint's own dtype, and split --quantize int8 experts


def build_family(work: Path, family: str, variant: str = "float") -> Path:
    """A make_tiny_moe.py checkpoint of `family` with LOOKAHEAD_KNOBS and no EOS token (every run generates every
    token asked for), split (experts quantized unless `variant` is float) and signed once; returns the split
    directory."""
    name = f"lookahead-{family}" + ("" if variant == "float" else f"-{variant}")
    out, marker = work / name / "model", work / name / "signed.json"
    want = {**LOOKAHEAD_KNOBS, "variant": variant}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    shutil.rmtree(work / name, ignore_errors=True)
    ck = work / name / "ck"
    knobs = [x for k, v in LOOKAHEAD_KNOBS.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    # DeepSeek's multi-token-prediction layer (one trunk shard holding all its experts) is never run: left out, so
    # the trunk is what the forward pass reads
    mtp = ["--mtp-layers", "0"] if family == "deepseek_v3" else []
    subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_moe.py"), str(ck), "--family", family, *knobs,
                    *mtp], check=True, capture_output=True)
    config = json.loads((ck / "config.json").read_text())
    config["eos_token_id"] = None
    (ck / "config.json").write_text(json.dumps(config, indent=2))
    (ck / "generation_config.json").unlink(missing_ok=True)
    shardtool = str(VENV_BIN / "shardtool")
    quantize = [] if variant == "float" else ["--quantize", variant]
    subprocess.run([shardtool, "split", "-q", str(ck), str(out), "--model-id", f"bench/{name}", *quantize], check=True,
                   capture_output=True)
    subprocess.run([shardtool, "sign", str(out), "--key", str(work / "bench.key")], check=True, capture_output=True)
    shutil.rmtree(ck)
    marker.write_text(json.dumps(want))
    return out


def quarter_budget(work: Path, model: Path, tokens: int) -> dict:
    """The --memory-budget whose shard cache is every trunk shard + a quarter of the expert bytes (the plan's KV cache
    and working buffers on top, as verify-and-run computes them)."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_verified_manifest
    from shardtool.runtime import verified_config
    from shardtool.runtime.engine._plan import plan_budget

    manifest = load_verified_manifest(model / "manifest.msgpack", [load_public_key(work / "bench.pub")], 1)
    config = verified_config(model, manifest)
    plan = plan_budget(1 << 40, config, manifest, max_tokens=len(PROMPT) + tokens, readers=2)
    experts = sum(e.size for e in manifest.entries if e.kind == "expert")
    trunk = sum(e.size for e in manifest.entries if e.kind == "trunk")
    return {"budget": plan.kv_cache + plan.working + trunk + experts // 4, "shard_cache": trunk + experts // 4,
            "expert_bytes": experts, "trunk_bytes": trunk}


def part_e(work: Path, repeats: int, tokens: int) -> dict:
    cases = [(family, variant) for variant in LOOKAHEAD_VARIANTS for family in LOOKAHEAD_FAMILIES]
    models = {case: build_family(work, *case) for case in cases}
    budgets = {case: quarter_budget(work, model, tokens) for case, model in models.items()}
    keys = ("wait", "expert_wait", "recall", "hit", "decode", "prefetched", "used")
    m = {c: {arm: {k: [] for k in keys} for arm in ("on", "off")} for c in cases}
    warm = {c: [] for c in cases}
    same = {c: True for c in cases}
    for i in range(repeats):  # interleaved: every case and arm in each round, the streaming arms' order alternating
        for case, model in models.items():
            ids = {}
            for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
                _, rep = verify_and_run(work, model, str(budgets[case]["budget"]), tokens,
                                        extra=(f"--{'' if arm == 'on' else 'no-'}lookahead",))
                r, la = m[case][arm], rep["lookahead"]
                new = max(rep["new_tokens"], 1)
                r["wait"].append(rep["per_token_seconds"]["waiting_for_shards"])
                r["expert_wait"].append(rep["seconds"]["waiting_for_experts"] / new)
                r["recall"].append(la["recall"])
                r["hit"].append(rep["cache"]["expert_hit_rate"])
                r["decode"].append(rep["decode_tokens_per_s"])
                r["prefetched"].append(la["prefetched"] / new)
                r["used"].append(la["prefetch_used"] / new)
                ids[arm] = rep["generated_ids"]
            w = in_subprocess("warm", model, work / "bench.pub", tokens)
            warm[case].append(w["decode_tokens_per_s"])
            same[case] &= ids["on"] == ids["off"] == w["generated_ids"]
    print(f"\n## (e) lookahead prefetch: shard cache = trunk + 1/4 of the experts ({LOOKAHEAD_KNOBS}), "
          f"{len(PROMPT)}-token prompt, {tokens} new tokens, medians of {repeats} interleaved runs; warm = every "
          f"expert verified into the cache first (compute only)")
    print(f"{'family':<12} {'experts':<7} {'wait ms/tok on':>14} {'off':>7} {'ratio':>6} {'recall':>7} {'hit on':>7} "
          f"{'hit off':>7} {'tok/s on':>8} {'off':>6} {'warm':>6} {'on/warm':>7} {'off/warm':>8}  same tokens   "
          f"wait runs on | off")
    out = {}
    for case in cases:
        family, variant = case
        on, off = m[case]["on"], m[case]["off"]
        med = {arm: {k: median([x for x in v if x is not None]) for k, v in m[case][arm].items()}
               for arm in ("on", "off")}
        warm_tps = median(warm[case])
        ratio = med["on"]["wait"] / med["off"]["wait"] if med["off"]["wait"] else float("nan")
        on_warm, off_warm = med["on"]["decode"] / warm_tps, med["off"]["decode"] / warm_tps
        print(f"{family:<12} {variant:<7} {med['on']['wait'] * 1e3:14.2f} {med['off']['wait'] * 1e3:7.2f} {ratio:6.2f} "
              f"{med['on']['recall']:7.2f} {med['on']['hit']:7.2f} {med['off']['hit']:7.2f} {med['on']['decode']:8.1f} "
              f"{med['off']['decode']:6.1f} {warm_tps:6.1f} {on_warm:7.2f} {off_warm:8.2f}  {str(same[case]):<11}   "
              f"{fmt([x * 1e3 for x in on['wait']], '.1f')} | {fmt([x * 1e3 for x in off['wait']], '.1f')}")
        out[f"{family}/{variant}"] = {
            "budget": budgets[case], "wait_per_token_on": med["on"]["wait"], "wait_per_token_off": med["off"]["wait"],
            "wait_ratio": ratio, "target_met": ratio <= 0.5, "recall": med["on"]["recall"],
            "hit_rate_on": med["on"]["hit"], "hit_rate_off": med["off"]["hit"],
            "expert_wait_per_token_on": med["on"]["expert_wait"], "expert_wait_per_token_off": med["off"]["expert_wait"],
            "decode_tokens_per_s_on": med["on"]["decode"], "decode_tokens_per_s_off": med["off"]["decode"],
            "decode_tokens_per_s_warm": warm_tps, "streaming_over_warm_on": on_warm,
            "streaming_over_warm_off": off_warm, "streaming_target_met": on_warm >= 0.8,
            "prefetched_per_token": med["on"]["prefetched"], "prefetch_used_per_token": med["on"]["used"],
            "same_tokens": same[case], "runs": {**m[case], "warm": warm[case]}}
    for variant in LOOKAHEAD_VARIANTS:
        rows = [out[f"{f}/{variant}"] for f in LOOKAHEAD_FAMILIES]
        print(f"{variant}: wait per token, lookahead / none: median over families "
              f"{median([r['wait_ratio'] for r in rows]):.2f} (target <= 0.5); streaming / warm with lookahead "
              f"{median([r['streaming_over_warm_on'] for r in rows]):.2f}, without "
              f"{median([r['streaming_over_warm_off'] for r in rows]):.2f} (target >= 0.8); prefetched per token "
              f"{fmt([r['prefetched_per_token'] for r in rows], '.1f')}, of which used "
              f"{fmt([r['prefetch_used_per_token'] for r in rows], '.1f')}")
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_run":
        mode, out, *rest = sys.argv[2:]
        {"hf": run_hf, "sweep": run_sweep, "decode": run_decode, "warm": run_warm}[mode](Path(out), *rest)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="abcde")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--speed-models", default="tiny,small")
    ap.add_argument("--speed-tokens", type=int, default=128, help="(b): enough to amortize first-use expert reads")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-runtime"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if "c" in args.parts and not shutil.which("b3sum"):
        sys.exit("bench_runtime: b3sum not found (Debian: apt-get install b3sum)")
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "bench.key").exists():
        subprocess.run([str(VENV_BIN / "shardtool"), "keygen", "--out", str(work / "bench"), "--no-passphrase"],
                       check=True, capture_output=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: trust ratios, not times)")
    results = {}
    if "a" in args.parts:
        results["memory"] = part_a(work, args.repeats, args.tokens, args.budget_mib)
    if "b" in args.parts:
        results["decode_speed"] = part_b(work, args.repeats, args.speed_tokens, args.speed_models.split(","))
    if "c" in args.parts:
        results["streaming"] = part_c(work, args.repeats, args.tokens, args.budget_mib)
    if "d" in args.parts:
        results["attack_budgets"] = part_d(work, args.repeats)
    if "e" in args.parts:
        results["lookahead"] = part_e(work, args.repeats, args.tokens)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
