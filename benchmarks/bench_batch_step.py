"""One engine step of 16 decode rows (`forward_batch`, 16 sequences) on bench_serve's in-memory model (f32, hidden 512,
4 layers x 8 experts, top-2, every expert in memory), and where its time goes.

  - step time with the attention's products once on all 16 rows (`AttentionParts.project` / `output`, as
    forward_batch runs them) against the products per sequence (each sequence's whole attention on its own row, as
    forward_batch ran before), alternated step by step, medians of --steps;
  - a split of the batched step: projections (q/k/v and output products), the attention core (RoPE, cache append,
    scores against each sequence's cache), router, routed experts, shared expert, head; "other" is the rest (norms,
    residuals, embedding, Python between them), from wall-clock timers around each part (median per part).

Each of the 16 sequences has a prompt of 4 to 16 tokens and `--context` tokens decoded already (its cache holds
them); a step decodes one more row per sequence and is then rolled back, so every step sees the same caches.
The kernels use --threads threads (bench_serve --vs-llama's `serve --threads 2`), OpenBLAS 1 as `serve` sets it.
Usage: python benchmarks/bench_batch_step.py [--steps 200] [--threads 2] [--context 32] [--json FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as serve sets it when the native kernels run the products

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import CACHED_MODEL, PROMPTS  # noqa: E402

from shardtool.runtime.model import (DictWeightProvider, KVCache, Model, ModelConfig, Segment, _forward,  # noqa: E402
                                     _layers, forward_batch, set_threads, trunk_shapes)

PARTS = ("projections", "attention core", "router", "routed experts", "shared expert", "head")


def _model(seed: int = 0) -> Model:
    """bench_serve's CACHED_MODEL as a Mixtral config with random float32 weights (the step's cost is in the shapes)."""
    k = CACHED_MODEL
    cfg = ModelConfig.from_hf_config({
        "model_type": "mixtral", "vocab_size": k["vocab"], "hidden_size": k["hidden"], "num_hidden_layers": k["layers"],
        "num_attention_heads": k["heads"], "num_key_value_heads": k["kv_heads"], "intermediate_size": k["intermediate"],
        "num_local_experts": k["experts"], "num_experts_per_tok": k["experts_per_tok"], "max_position_embeddings": 256})
    rng = np.random.default_rng(seed)

    def rand(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return rng.standard_normal(shape, np.float32) * np.float32(1.0 if name == "embed" else 0.05)

    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    state = {"model.embed_tokens.weight": rand("embed", (cfg.vocab_size, h)),
             "model.norm.weight": rand("norm.weight", (h,)), "lm_head.weight": rand("lm_head", (cfg.vocab_size, h))}
    for layer in range(cfg.num_layers):
        required, _ = trunk_shapes(cfg, layer)
        state |= {f"model.layers.{layer}.{name}": rand(name, shape) for name, shape in required.items()}
        for e in range(cfg.num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            state |= {p + "gate_proj.weight": rand("", (i, h)), p + "up_proj.weight": rand("", (i, h)),
                      p + "down_proj.weight": rand("", (h, i))}
    return Model(cfg, DictWeightProvider(state))


def _per_sequence(attention, cfg, parts):
    """forward_batch's `_attend` as it ran before: each sequence's whole attention (its products too) on its rows."""
    if len(parts) == 1:
        return _forward._attend(attention, cfg, parts)

    def attend(xn, w):  # [sum t, H] -> [sum t, H]
        return np.concatenate([attention(xn[lo:hi], w, cfg, cos, sin, mask, append_kv)
                               for lo, hi, (cos, sin), mask, append_kv in parts])
    return attend


class _Timers:
    """Timers around the step's parts (wall and the process's CPU seconds), wrapped in place on the modules that call
    them."""

    def __init__(self):
        self.step: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # part -> [wall, cpu]

    def _timed(self, f, part: str):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent = self.step[part]
                spent[0] += time.perf_counter() - t0
                spent[1] += time.process_time() - c0
        return timed

    def install(self) -> None:
        gqa = _layers.GQA
        _forward.GQA = _layers.AttentionParts(self._timed(gqa.project, "projections"),
                                              self._timed(gqa.attend, "attention core"),
                                              self._timed(gqa.output, "projections"))
        for module, name, part in ((_layers, "route", "router"),
                                   (_layers, "moe_experts", "routed experts"),  # the experts' thunks run in it
                                   (_layers, "shared_expert", "shared expert"),
                                   (_forward, "matmul_t", "head")):  # (forward_batch's one product: the lm_head)
            setattr(module, name, self._timed(getattr(module, name), part))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=32, help="tokens each sequence has decoded before the step")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    set_threads(args.threads)
    model = _model()
    cfg, weights, rope = model.config, model._weights, model._rope
    caches = []
    for i, prompt in enumerate(PROMPTS):
        cache = KVCache(cfg)
        ids = prompt + [(7 * i + j) % cfg.vocab_size for j in range(args.context)]
        forward_batch(cfg, weights, rope, [Segment(np.array(ids), cache, "none")])
        caches.append(cache)
    ids = [np.array([(13 * i) % cfg.vocab_size]) for i in range(len(caches))]

    cpu: dict[str, list[float]] = defaultdict(list)  # the process's CPU seconds per step: steadier when cores are busy

    def step(name: str = "") -> float:
        segments = [Segment(x, cache, "last") for x, cache in zip(ids, caches)]
        c0, t0 = time.process_time(), time.perf_counter()
        forward_batch(cfg, weights, rope, segments)
        seconds = time.perf_counter() - t0
        cpu[name].append(time.process_time() - c0)
        for cache in caches:  # rolled back: every step sees the same caches
            cache.length -= 1
        return seconds

    times: dict[str, list[float]] = {"batched": [], "per sequence": []}
    real_attend = _forward._attend
    for _ in range(5):
        step()
    for _ in range(args.steps):  # alternated step by step: both see the same load on a shared machine
        times["batched"].append(step("batched"))
        _forward._attend = _per_sequence
        try:
            times["per sequence"].append(step("per sequence"))
        finally:
            _forward._attend = real_attend
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    med_cpu = {k: statistics.median(cpu[k]) * 1e3 for k in times}
    timers = _Timers()
    timers.install()
    split: dict[str, dict[str, list[tuple[float, float]]]] = {k: defaultdict(list) for k in times}
    for _ in range(args.steps):  # the same alternation, timers on
        for name in times:
            _forward._attend = real_attend if name == "batched" else _per_sequence
            timers.step.clear()
            wall = step(name)
            for part in PARTS:
                split[name][part].append(tuple(timers.step[part]))
            split[name]["other"].append((wall - sum(timers.step[p][0] for p in PARTS),
                                         cpu[name][-1] - sum(timers.step[p][1] for p in PARTS)))
            split[name]["total"].append((wall, cpu[name][-1]))
    _forward._attend = real_attend
    parts = {name: {part: [statistics.median(x[i] for x in v) * 1e3 for i in (0, 1)] for part, v in by.items()}
             for name, by in split.items()}
    print("  where a step's time goes (timers on, median of each part), wall / CPU ms:")
    print(f"    {'':<16} {'batched':>19}   {'per sequence':>19}")
    for part in (*PARTS, "other", "total"):
        print(f"    {part:<16} " + "   ".join(f"{parts[n][part][0]:8.3f} / {parts[n][part][1]:8.3f}" for n in times))
    if args.json:
        args.json.write_text(json.dumps({"model": CACHED_MODEL, "threads": args.threads, "context": args.context,
                                         "steps": args.steps, "step_ms": med, "step_cpu_ms": med_cpu,
                                         "split_wall_cpu_ms": parts}, indent=1))


if __name__ == "__main__":
    main()
