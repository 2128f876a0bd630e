"""Shard-cache policies compared by hit rate on routing traces recorded from real runs of the generated models.

(1) record: for each family, generate checkpoints (examples/make_tiny_moe.py; several model seeds), split and
    sign them, then run the verifying runtime (`Session`, the engine `verify-and-run` uses) on a series of
    English prompts with sampled decoding. The routes come from the run's receipt record (`StepTrace`, one
    [t, layers, k] array per forward step); each step is turned into the store's access sequence: the
    embedding, then per layer its trunk shard and the distinct experts the step's rows chose (ascending, as
    the MoE loop asks for them), then the head. Saved as JSON in WORKDIR/traces/.
(2) replay: each trace through the store's own bookkeeping (`CacheIndex` in `runtime/store/_cache_policy.py`) at
    shard-cache budgets of the trunk + 1/8, 1/4 and 1/2 of all expert bytes, with trunk shards evicted last
    (as the store does) or in one order with the experts ("shared"), and Belady's optimal (evict the expert
    used again furthest in the future, trunk kept) as a ceiling. Prints expert hit rates per family, budget
    and policy (the median over model seeds and its range), trunk re-reads, and how repetitive the routing is.

Hit rates are counts, not timings: the figures do not depend on the machine's load.
The generated models have random weights: their routers are nearly flat, so these traces are closer to the
hardest case for any policy (little reuse to find) than to a trained model's skewed routing.
Usage: python benchmarks/bench_cache_policy.py [--families mixtral,...] [--seeds 3] [--prompts 8]
       [--tokens 64] [--workdir DIR] [--json FILE] [--replay-only]
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VENV_BIN, make_without_eos  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
FRACTIONS = ((1, 8), (1, 4), (1, 2))
# 64 experts, 4 per token (qwen3: 8 of 128, olmoe: 8 of 64); 6 layers (deepseek_v3: the first one dense).
KNOBS = dict(layers=6, experts=64, experts_per_tok=4, hidden=64, moe_intermediate=40, vocab=512, dtype="bf16")
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch of the old house.",
    "In 1969 the first humans walked on the Moon. Neil Armstrong stepped out of the lunar module and said",
    "To make bread you need flour, water, salt and yeast. Mix them, knead the dough for ten minutes, then",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Dear customer, thank you for your order. Your package will arrive on Tuesday. If you have questions,",
    "The mitochondria is the powerhouse of the cell: it turns glucose and oxygen into the energy the cell",
    "Once upon a time, in a kingdom by the sea, there lived a young princess who loved to read books about",
    "SELECT name, count(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY name;",
    "The stock market fell sharply on Monday as investors worried about rising interest rates and inflation.",
    "Photosynthesis converts light energy into chemical energy; plants take in carbon dioxide and release",
    "Bonjour! Je m'appelle Marie et j'habite à Paris. J'aime la musique, le cinéma et les longues promenades.",
    "Step 1: unplug the router. Step 2: wait thirty seconds. Step 3: plug it back in and wait for the lights",
]
TRAINED_PROMPT = 32  # tokens of held-out text each prompt of the trained model's trace starts with


# --- (1) recording ---------------------------------------------------------------------------------------

def build(work: Path, family: str, seed: int) -> Path:
    """Generate, split and sign one model (reused across runs); returns the split directory."""
    knobs = {**KNOBS, "seed": seed}
    base = work / "models" / f"{family}-{seed}"
    out, marker = base / "model", base / "signed.json"
    if marker.exists() and json.loads(marker.read_text()) == knobs:
        return out
    subprocess.run(["rm", "-rf", str(base)], check=True)
    make_without_eos(base / "ck", knobs, family)
    shardtool = str(VENV_BIN / "shardtool")
    subprocess.run([shardtool, "split", "-q", str(base / "ck"), str(out), "--model-id", f"bench/{family}-{seed}"],
                   check=True, capture_output=True)
    subprocess.run([shardtool, "sign", str(out), "--key", str(work / "bench.key")], check=True, capture_output=True)
    marker.write_text(json.dumps(knobs))
    return out


def record(work: Path, family: str, seed: int, prompts: int, tokens: int) -> dict:
    """Run the model on `prompts` prompts, `tokens` sampled tokens each, one request after the other (as a
    server's store sees them); returns the trace: the shard sizes and each step's per-layer experts."""
    from shardtool.runtime import encode_prompt, load_tokenizer

    model = build(work, family, seed)
    verified = _verified(work, model, f"{family}-{seed}")
    tokenizer = load_tokenizer(model, verified)
    ids = [encode_prompt(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(prompts)]
    return trace(model, verified, ids, tokens, seed, family, tokenizer)


def record_trained(work: Path, seed: int, prompts: int, tokens: int) -> dict:
    """The trained demo model's trace: its prompts are the first TRAINED_PROMPT tokens of held-out windows (text
    it never trained on), a different `prompts` of them per seed."""
    from bench_quant_quality import DEMO_MODEL, heldout_windows

    model, marker = work / "models" / "demo" / "model", work / "models" / "demo" / "signed.json"
    if not marker.exists():
        subprocess.run(["rm", "-rf", str(model)], check=True)
        shardtool = str(VENV_BIN / "shardtool")
        subprocess.run([shardtool, "split", "-q", str(DEMO_MODEL), str(model), "--model-id", "bench/demo"],
                       check=True, capture_output=True)
        subprocess.run([shardtool, "sign", str(model), "--key", str(work / "bench.key")], check=True,
                       capture_output=True)
        marker.write_text("{}")
    windows = [w[:TRAINED_PROMPT] for w in heldout_windows(DEMO_MODEL, None) if len(w) > TRAINED_PROMPT]
    ids = windows[seed * prompts:(seed + 1) * prompts]
    return trace(model, _verified(work, model, f"demo-{seed}"), ids, tokens, seed, "demo")


def _verified(work: Path, model: Path, tag: str):
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest

    return load_trusted_manifest(model / "manifest.msgpack", [load_public_key(work / "bench.pub")], 1,
                                 work / "state" / tag)


def trace(model: Path, verified, prompts: list[list[int]], tokens: int, seed: int, family: str,
          tokenizer=None) -> dict:
    """Each prompt run with `tokens` sampled tokens, one request after the other; the store's view of it."""
    from shardtool.layout import EMBED, HEAD, trunk_path
    from shardtool.runtime import Session

    steps: list[list[list[int]]] = []
    sizes = {e.path: e.size for e in verified.entries}
    cfg = None
    for i, ids in enumerate(prompts):
        session = Session(model, verified, budget=1 << 30, max_tokens=len(ids) + tokens, tokenizer=tokenizer)
        try:
            cfg = session.config
            session.generate(ids, tokens, temperature=0.8, top_p=1.0, seed=1000 * seed + i, on_token=lambda t: None,
                             record=True)
            for routes in session.record.routes:  # per step: [t, MoE layers, k]
                steps.append([sorted({int(e) for e in routes[:, j, :].ravel()}) for j in range(routes.shape[1])])
        finally:
            session.close()
    moe = [layer for layer, is_moe in enumerate(cfg.moe_layers) if is_moe]
    expert_size = max(e.size for e in verified.entries if e.kind == "expert")
    return {"family": family, "seed": seed, "num_layers": cfg.num_layers, "moe_layers": moe,
            "num_experts": cfg.num_experts, "top_k": cfg.top_k, "expert_size": expert_size,
            "embed_size": sizes[EMBED], "head_size": sizes[HEAD],
            "trunk_sizes": [sizes[trunk_path(layer)] for layer in range(cfg.num_layers)], "steps": steps}


# --- (2) replay --------------------------------------------------------------------------------------------

def accesses(trace: dict) -> list[tuple[str, int]]:
    """The store's access sequence: (key, bytes); keys 'e:L:E' are experts, anything else the trunk."""
    out = []
    moe = trace["moe_layers"]
    for step in trace["steps"]:
        out.append(("embed", trace["embed_size"]))
        for layer in range(trace["num_layers"]):
            out.append((f"t:{layer}", trace["trunk_sizes"][layer]))
            if layer in moe:
                out += [(f"e:{layer}:{e}", trace["expert_size"]) for e in step[moe.index(layer)]]
        out.append(("head", trace["head_size"]))
    return out


def replay(seq: list[tuple[str, int]], policy: str, budget: int, trunk_last: bool) -> dict:
    """Replay through the store's own bookkeeping (`CacheIndex`: evict until the new shard fits; a shard
    bigger than the budget is never cached). `trunk_last`: as the store does, trunk shards are evicted only
    when no expert is cached; False: one order for all shards (every key given to the index as an expert)."""
    from shardtool.runtime.store._cache_policy import CacheIndex

    index = CacheIndex(policy, budget)
    hits = misses = trunk_misses = 0
    read = trunk_read = 0  # bytes read, all and trunk re-reads
    seen: set[str] = set()
    for key, size in seq:
        expert = key.startswith("e:")
        if key in index:
            index.touch(key)
            hits += expert
            continue
        misses += expert
        reread = not expert and key in seen  # a trunk re-read: the first read of each is no policy's doing
        trunk_misses += reread
        trunk_read += size * reread
        read += size
        seen.add(key)
        index.insert(key, size, expert=expert or not trunk_last)
    return {"hit_rate": hits / max(hits + misses, 1), "trunk_misses": trunk_misses, "bytes_read": read,
            "trunk_reread_bytes": trunk_read}


def belady(seq: list[tuple[str, int]], capacity: int) -> float:
    """Expert hit rate of the optimal offline policy with `capacity` experts (all experts one size)."""
    experts = [key for key, _ in seq if key.startswith("e:")]
    next_use = [0] * len(experts)
    seen: dict[str, int] = {}
    for i in range(len(experts) - 1, -1, -1):
        next_use[i] = seen.get(experts[i], len(experts) + i)
        seen[experts[i]] = i
    cached: dict[str, int] = {}  # key -> its next use
    heap: list[tuple[int, str]] = []  # (-next use, key), lazily deleted
    hits = 0
    for i, key in enumerate(experts):
        if key in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits / max(len(experts), 1)


def locality(trace: dict) -> dict:
    """How skewed and how repetitive the routing is: the share of a decode step's experts (per layer) that the
    step before also chose, the share of all expert accesses that go to the 1/8 most used experts, and per MoE
    layer the share of decode steps that chose that layer's most used expert."""
    repeats = total = decode_steps = 0
    prev = None
    counts: dict[tuple[int, int], int] = {}
    decode_counts: dict[tuple[int, int], int] = {}
    for step in trace["steps"]:
        decode = all(len(x) <= trace["top_k"] for x in step)
        for j, experts in enumerate(step):
            for e in experts:
                counts[(j, e)] = counts.get((j, e), 0) + 1
                decode_counts[(j, e)] = decode_counts.get((j, e), 0) + decode
        decode_steps += decode
        if prev is not None and decode:
            for now, before in zip(step, prev):
                repeats += len(set(now) & set(before))
                total += len(now)
        prev = step
    ranked = sorted(counts.values(), reverse=True)
    top = len(trace["moe_layers"]) * trace["num_experts"] // 8
    top_expert = [max((n for (j, _), n in decode_counts.items() if j == layer), default=0) / max(decode_steps, 1)
                  for layer in range(len(trace["moe_layers"]))]
    return {"repeat_previous_step": repeats / max(total, 1), "top_eighth_share": sum(ranked[:top]) / sum(ranked),
            "top_expert_step_share": top_expert}


def evaluate(trace: dict) -> dict:
    seq = accesses(trace)
    n_experts = len(trace["moe_layers"]) * trace["num_experts"]
    trunk = trace["embed_size"] + trace["head_size"] + sum(trace["trunk_sizes"])
    out = {}
    for num, den in FRACTIONS:
        capacity = n_experts * num // den
        budget = trunk + capacity * trace["expert_size"]
        row = {policy: replay(seq, policy, budget, True) for policy in ("lru", "lfu", "lfu-da")}
        row.update({f"{policy} shared": replay(seq, policy, budget, False) for policy in ("lru", "lfu", "lfu-da")})
        row["belady"] = {"hit_rate": belady(seq, capacity), "trunk_misses": 0, "bytes_read": 0,
                         "trunk_reread_bytes": 0}
        out[f"{num}/{den}"] = row
    out["locality"] = locality(trace)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help="generated families, or 'demo': the trained demo model (examples/demo_model) on held-out text")
    ap.add_argument("--seeds", type=int, default=3, help="model seeds per family (the spread is the noise)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="sampled tokens per prompt")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-cache-policy"))
    ap.add_argument("--replay-only", action="store_true", help="replay the traces already in WORKDIR/traces")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = args.workdir
    (work / "traces").mkdir(parents=True, exist_ok=True)
    if not (work / "bench.key").exists():
        subprocess.run([str(VENV_BIN / "shardtool"), "keygen", "--out", str(work / "bench"), "--no-passphrase"],
                       check=True, capture_output=True)
    families = args.families.split(",")
    results: dict = {}
    for family in families:
        for seed in range(args.seeds):
            path = work / "traces" / f"{family}-{seed}.json"
            if not args.replay_only:
                found = (record_trained(work, seed, args.prompts, args.tokens) if family == "demo"
                         else record(work, family, seed, args.prompts, args.tokens))
                path.write_text(json.dumps(found))
            found = json.loads(path.read_text())
            results.setdefault(family, []).append(evaluate(found))
            print(f"{family} seed {seed}: {len(found['steps'])} steps, {len(accesses(found))} shard accesses",
                  flush=True)
    policies = ["lru", "lfu", "lfu-da", "lru shared", "lfu shared", "lfu-da shared", "belady"]
    print("\n## expert hit rate, % (median over model seeds [min-max]); budget = trunk + fraction of expert bytes")
    print(f"{'family':<12} {'budget':>6} " + " ".join(f"{p:>17}" for p in policies))
    summary: dict = {}
    for family, runs in results.items():
        for frac in [f for f in runs[0] if f != "locality"]:
            cells = []
            for policy in policies:
                rates = [100 * r[frac][policy]["hit_rate"] for r in runs]
                summary.setdefault(family, {}).setdefault(frac, {})[policy] = rates
                cells.append(f"{statistics.median(rates):5.1f} [{min(rates):4.1f}-{max(rates):4.1f}]")
            print(f"{family:<12} {frac:>6} " + " ".join(f"{c:>17}" for c in cells))
    print("\n## paired difference vs lru, percentage points (median over seeds [min-max])")
    print(f"{'family':<12} {'budget':>6} " + " ".join(f"{p:>17}" for p in policies[1:]))
    for family, by_frac in summary.items():
        for frac, rates in by_frac.items():
            cells = []
            for policy in policies[1:]:
                d = [a - b for a, b in zip(rates[policy], rates["lru"])]
                cells.append(f"{statistics.median(d):+5.1f} [{min(d):+.1f},{max(d):+.1f}]")
            print(f"{family:<12} {frac:>6} " + " ".join(f"{c:>17}" for c in cells))
    print("\n## trunk re-reads (all seeds) and their share of the bytes read: trunk evicted last (the store) / "
          "one order for all shards (shared)")
    print(f"{'family':<12} {'budget':>6}  " + "  ".join(f"{p:>12}" for p in
                                                       ("lru", "lfu", "lfu-da", "lru sh.", "lfu sh.", "lfu-da sh.")))
    trunk = {}
    for family, runs in results.items():
        for frac in [f for f in runs[0] if f != "locality"]:
            cells = []
            for policy in ("lru", "lfu", "lfu-da", "lru shared", "lfu shared", "lfu-da shared"):
                n = sum(r[frac][policy]["trunk_misses"] for r in runs)
                share = (sum(r[frac][policy]["trunk_reread_bytes"] for r in runs)
                         / max(sum(r[frac][policy]["bytes_read"] for r in runs), 1))
                trunk.setdefault(family, {}).setdefault(frac, {})[policy] = {"rereads": n, "share": share}
                cells.append(f"{n:4d} {100 * share:5.2f}%")
            print(f"{family:<12} {frac:>6}  " + "  ".join(f"{c:>12}" for c in cells))
    print("\n## routing locality (median over seeds): decode-step experts also chosen by the step before; "
          "accesses to the 1/8 most used experts")
    for family, runs in results.items():
        rep = statistics.median(r["locality"]["repeat_previous_step"] for r in runs)
        top = statistics.median(r["locality"]["top_eighth_share"] for r in runs)
        layers = [statistics.median(r["locality"]["top_expert_step_share"][j] for r in runs)
                  for j in range(len(runs[0]["locality"]["top_expert_step_share"]))]
        print(f"{family:<12} repeat {100 * rep:5.1f}%   top-1/8 share {100 * top:5.1f}%   decode steps choosing each "
              "MoE layer's most used expert: " + " ".join(f"{100 * x:.0f}%" for x in layers))
    if args.json:
        args.json.write_text(json.dumps({"hit_rates_percent": summary, "trunk": trunk,
                                         "locality": {f: [r["locality"] for r in rs] for f, rs in results.items()}},
                                        indent=2))


if __name__ == "__main__":
    main()
