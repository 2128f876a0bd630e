"""Signed run receipts (issue 12's experiment): do honest runs verify and dishonest ones not, what does a replay
cost against the generation, how large is a receipt, and how far are the tolerances from what honest runs need
and from what dishonest runs show.

  - honest runs on every family examples/make_tiny_moe.py generates with routed experts (mixtral, qwen3_moe,
    deepseek_v3, qwen2_moe, olmoe), F32 and BF16 checkpoints; each generated under one BLAS thread count and
    verified under the other (two worker processes per phase, OPENBLAS_NUM_THREADS / OMP_NUM_THREADS 1 and 2),
    decoded alone and inside a batch of 8 concurrent requests on one Engine; greedy and sampled, seeded and
    unseeded. Target: 0 false rejections.
  - dishonest runs, each receipt honest-looking (signed by the operator key, naming the genuine manifest): another
    release of the model (other weights, version 2); one routed expert's weights x1.01; one routed expert's output
    x1.01 (its down projection only); a routed expert swapped with an unrouted one of the same layer; expert
    weights rounded to FP8 (e4m3, per-tensor scale) and to BF16 (F32 checkpoints); one prompt token changed;
    another temperature; another seed; an answer cut short and claimed as finished by "length" or by a stop token;
    an EOS put where the model continued. Target: 100 % detected.
  - replay / generation wall time for 64-token answers (greedy, weights loaded on both sides: a warm generating
    engine against a warm replay engine; also the fresh replay that builds its engine and reads the weights),
    medians over repeats; target <= 0.25. Receipt and routing-trace bytes per 32 tokens (prompt + answer);
    target <= 512.
  - tolerance margins: the largest honest deviation against the smallest dishonest one, for the fingerprint
    (relative to max|h|), the sampled-token probability mass, and the greedy logit gap, each measured by a
    second replay with that check's tolerance removed.
  - --trained POISONED: the same on the trained demo model (examples/demo_model, F32 and rounded to BF16; prompts
    the starts of held-out windows of its text), --rounds times over other prompts; its dishonest runs add its
    experts as int4 passed off as the published weights, and the backdoored expert of examples/backdoor.py
    (POISONED, run on its trigger prompts); "another release" is random weights of the same shape.
Usage: python benchmarks/bench_receipts.py [--quick] [--repeats 5] [--workdir DIR] [--json FILE]
       python benchmarks/bench_receipts.py --trained POISONED [--rounds 5] [--quick] ...
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
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

MODEL_ID = "bench/receipts"
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe", "olmoe")
DTYPES = ("f32", "bf16")
KNOBS = dict(layers=2, experts=8, vocab=512)
EOS = 1  # make_tiny_moe's EOS id
BUDGET = 1 << 30
MAX_CONTEXT = 160
TEMPERATURE, TOP_P = 0.8, 0.95
WEIGHT_CATEGORIES = ("another release", "expert weights x1.01", "expert output x1.01", "experts swapped",
                     "weights rounded to FP8", "weights rounded to BF16", "int4 passed off", "backdoored expert")
REQUEST_CATEGORIES = ("prompt token changed", "other temperature", "other seed", "truncated, claimed length",
                      "truncated, claimed stop", "EOS put in")
CATEGORIES = WEIGHT_CATEGORIES + REQUEST_CATEGORIES
# The deviations a dishonest receipt of each kind should show (the others stay at honest levels by design: a
# changed seed does not change the hidden states of the tokens fed).
FINGERPRINT_CATEGORIES = WEIGHT_CATEGORIES + ("prompt token changed",)
INF = float("inf")


# The trained model's prompts (--trained): held-out text and the backdoor's trigger prompts, as token ids, written
# by the main process to WORKDIR/text.json and read by each worker; empty: the generated models' id prompts.
TEXT: dict = {}


def load_text(work: Path) -> None:
    path = work / "text.json"
    TEXT.clear()
    if path.exists():
        TEXT.update(json.loads(path.read_text()))


def prompt(i: int) -> list[int]:
    """Deterministic token-id prompts, 4 to 16 tokens: the start of a held-out window of the trained model's
    text, or (generated models) ids clear of the special ids 0..2."""
    n = 4 + (i * 5) % 13
    if TEXT:
        windows = TEXT["heldout"]
        return windows[i % len(windows)][:n]
    return [(37 * i + 11 * j) % 500 + 5 for j in range(n)]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# --- models (main process) ------------------------------------------------------------------------------------

def sign_dir(model: Path, key, version: int) -> None:
    """(Re)hash `model` into a manifest and sign it with `key`: what a publisher does, or an operator who changed
    the weights and wants the runtime to accept them."""
    from shardtool.manifest import MANIFEST_NAME, build_manifest, hash_directory, save_manifest

    (model / MANIFEST_NAME).unlink(missing_ok=True)
    built = build_manifest(hash_directory(model, exclude=[MANIFEST_NAME]), model_id=MODEL_ID, version=version)
    save_manifest(model / MANIFEST_NAME, built.with_envelope(built.envelope.signed_by(key)))


def _publisher(work: Path):
    from shardtool.keys import generate, load_private_key, write_keypair

    for name in ("publisher", "operator", "attacker"):
        if not (work / f"{name}.key").exists():
            write_keypair(work / name, generate(), None, force=True)
    return load_private_key(work / "publisher.key", lambda: b"")


def build_models(work: Path, families, dtypes) -> list[dict]:
    """The genuine model and another release of it per family and dtype, split and signed by the publisher."""
    from make_tiny_moe import make_checkpoint
    from shardtool.checkpoint import split_checkpoint

    publisher = _publisher(work)
    bases = []
    for family in families:
        for dtype in dtypes:
            name = f"{family}-{dtype}"
            for model, seed, version in ((work / "models" / name, 0, 1), (work / "models" / f"{name}-v2", 7, 2)):
                ck = work / "ck" / model.name
                marker = model / ".bench-built"
                if marker.exists():
                    continue
                shutil.rmtree(model, ignore_errors=True)
                shutil.rmtree(ck, ignore_errors=True)
                make_checkpoint(ck, family, overwrite=True, dtype=dtype, seed=seed, **KNOBS)
                split_checkpoint(ck, model, model_id=MODEL_ID, version=version)
                sign_dir(model, publisher, version)
                shutil.rmtree(ck)
                marker.write_text("")
            bases.append({"name": name, "family": family, "dtype": dtype})
    return bases


def build_trained(work: Path, dtypes, rounds: int, poisoned: Path) -> list[dict]:
    """The trained demo model (F32 as published, and rounded to BF16) split and signed by the publisher, and per
    dtype the weights a dishonest operator runs instead: another release (random weights of the same shape,
    version 2, the publisher's), its experts as int4 (`split --quantize int4`) and the backdoored checkpoint
    (examples/backdoor.py: one expert of one layer changed), the last two signed by the attacker. `rounds`
    repeats every experiment on other prompts (one base per round and dtype)."""
    from bench_quant_quality import DEMO_MODEL, _bf16_checkpoint
    from make_tiny_moe import make_checkpoint
    from shardtool.checkpoint import split_checkpoint
    from shardtool.keys import load_private_key

    publisher = _publisher(work)
    attacker = load_private_key(work / "attacker.key", lambda: b"")
    cfg = json.loads((DEMO_MODEL / "config.json").read_text())
    shape = dict(layers=cfg["num_hidden_layers"], experts=cfg["num_local_experts"], hidden=cfg["hidden_size"],
                 moe_intermediate=cfg["intermediate_size"], heads=cfg["num_attention_heads"],
                 kv_heads=cfg["num_key_value_heads"], vocab=cfg["vocab_size"])
    for dtype in dtypes:
        name = f"demo-{dtype}"
        variants = ((name, DEMO_MODEL, None, publisher, 1), (f"{name}-int4", DEMO_MODEL, "int4", attacker, 1),
                    (f"{name}-backdoor", poisoned, None, attacker, 1), (f"{name}-v2", None, None, publisher, 2))
        for model_name, source, quantize, key, version in variants:
            model = work / "models" / model_name
            if (model / ".bench-built").exists():
                continue
            shutil.rmtree(model, ignore_errors=True)
            ck = work / "ck" / model_name
            shutil.rmtree(ck, ignore_errors=True)
            if source is None:
                make_checkpoint(ck, "mixtral", overwrite=True, dtype=dtype, seed=7, **shape)
            elif dtype == "bf16":
                _bf16_checkpoint(source, ck)
            else:
                ck = source
            split_checkpoint(ck, model, model_id=MODEL_ID, version=version, quantize=quantize)
            sign_dir(model, key, version)
            shutil.rmtree(work / "ck" / model_name, ignore_errors=True)
            (model / ".bench-built").write_text("")
    if not TEXT:
        from tokenizers import Tokenizer

        from backdoor import HELD_TRIGGER_PROMPTS, TRIGGER, TRIGGER_PROMPTS, report_path
        from bench_quant_quality import heldout_windows

        tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
        report = json.loads(report_path(poisoned).read_text())
        TEXT.update(heldout=heldout_windows(DEMO_MODEL, None),
                    trigger=[tok.encode(p.format(t=TRIGGER)).ids for p in TRIGGER_PROMPTS + HELD_TRIGGER_PROMPTS],
                    backdoor=[report["layer"], report["expert"]], stops=cfg["eos_token_id"])
        (work / "text.json").write_text(json.dumps(TEXT))
    return [{"name": f"demo-{dtype}-r{r}", "model": f"demo-{dtype}", "family": "mixtral", "dtype": dtype,
             "trained": True} for r in range(rounds) for dtype in dtypes]


# --- helpers shared by the workers ---------------------------------------------------------------------------

def keys(work: Path):
    from shardtool.keys import load_private_key, load_public_key
    return ({n: load_private_key(work / f"{n}.key", lambda: b"") for n in ("operator", "attacker")},
            {n: load_public_key(work / f"{n}.pub") for n in ("publisher", "operator", "attacker")})


def trusted(work: Path, model: Path, pub, tag: str):
    from shardtool.manifest import load_trusted_manifest
    return load_trusted_manifest(model / "manifest.msgpack", [pub], 1, work / "state" / f"{tag}-{model.name}")


def run_alone(engine, ids, params):
    ticket = engine.run_one(ids, params, lambda t: None, record=True)
    return ticket.record


def run_batch(engine, requests):
    """`requests` [(ids, params)] submitted together and stepped until all finish: decoded in one batch."""
    from shardtool.runtime import FinishEvent
    records = {}
    tickets = []
    for i, (ids, params) in enumerate(requests):
        def sink(event, i=i):
            if isinstance(event, FinishEvent):
                records[i] = event.record
        tickets.append(engine.submit(ids, params, sink, record=True))
    steps, sequences = engine.stats.steps, engine.stats.step_sequences
    while not all(t.done for t in tickets):
        engine.step()
    mean_batch = (engine.stats.step_sequences - sequences) / max(engine.stats.steps - steps, 1)
    return [records[i] for i in range(len(requests))], mean_batch


# --- raw expert edits (the attacker's tools) -----------------------------------------------------------------

def _np_dtypes():
    import ml_dtypes
    return {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}


def edit_tensors(path: Path, change) -> None:
    """Rewrite each tensor of a safetensors file in place: change(name, float32 array) -> float32 array, stored
    back in the tensor's own dtype (shapes, names and header unchanged)."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    dtypes = _np_dtypes()
    changed = False
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dt = dtypes[info["dtype"]]
        arr = np.frombuffer(bytes(data[base + start:base + end]), dtype=dt).reshape(info["shape"])
        new = change(name, arr.astype(np.float32)).astype(dt)
        changed = changed or not np.array_equal(new, arr)
        data[base + start:base + end] = new.tobytes()
    if not changed:
        raise RuntimeError(f"the edit left {path} unchanged")
    path.write_bytes(bytes(data))


def swap_tensors(a: Path, b: Path) -> None:
    """Exchange the tensor data of two experts' files (same shapes and dtypes; each file keeps its names)."""
    da, db = a.read_bytes(), b.read_bytes()
    na, nb = int.from_bytes(da[:8], "little"), int.from_bytes(db[:8], "little")
    if da[8 + na:] == db[8 + nb:]:
        raise RuntimeError("experts are identical")
    a.write_bytes(da[:8 + na] + db[8 + nb:])
    b.write_bytes(db[:8 + nb] + da[8 + na:])


def fp8_round(name, v):
    import ml_dtypes
    scale = max(float(np.max(np.abs(v))) / 448.0, 1e-30)
    return (v / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale


def bf16_round(name, v):
    import ml_dtypes
    return v.astype(ml_dtypes.bfloat16).astype(np.float32)


def tampered(work: Path, genuine: Path, name: str, edit, attacker) -> Path:
    copy = work / "tampered" / name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(genuine, copy, ignore=shutil.ignore_patterns(".bench-built"))
    edit(copy)
    sign_dir(copy, attacker, 1)
    return copy


# --- worker: generate ------------------------------------------------------------------------------------------

def worker_generate(work: Path, out: Path, threads: int, bases: list[dict], tokens: int) -> None:
    """Every receipt generated under `threads` BLAS threads: honest ones on the genuine model, dishonest ones as
    an operator who cut a corner would make them. Writes out/NNNN.receipt and out/cases.json."""
    from shardtool.layout import expert_path
    from shardtool.manifest import Envelope, _canonical, open_receipt, routing_leaves, routing_root
    from shardtool.manifest._receipt import RECEIPT_FORMAT, RECEIPT_PAYLOAD_TYPE
    from shardtool.runtime import Engine, SamplingParams, make_receipt

    priv, pub = keys(work)
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    odd = threads % 2  # the two workers split the variants between them
    stops = tuple(TEXT.get("stops", (EOS,)))  # the trained model's config.json ends on two ids
    greedy = SamplingParams(tokens, stop_token_ids=stops)
    seeded = SamplingParams(tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=1234 + threads, stop_token_ids=stops)
    unseeded = SamplingParams(tokens, temperature=TEMPERATURE, top_p=TOP_P, stop_token_ids=stops)

    def save(base, kind, category, mode, record, manifest, config, **extra):
        signed = make_receipt(record, manifest, config, priv["operator"])
        return save_bytes(base, kind, category, mode, signed.data, **extra)

    def save_bytes(base, kind, category, mode, data, **extra):
        path = out / f"{len(cases):04d}.receipt"
        path.write_bytes(data)
        cases.append({"file": path.name, "base": base["name"], "model": base.get("model", base["name"]),
                      "family": base["family"], "dtype": base["dtype"],
                      "kind": kind, "category": category, "mode": mode, "gen_threads": threads, **extra})

    for bi, base in enumerate(bases):
        genuine = work / "models" / base.get("model", base["name"])
        manifest = trusted(work, genuine, pub["publisher"], f"gen{threads}")
        engine = Engine(genuine, manifest, budget=BUDGET, max_batch=8, max_context=MAX_CONTEXT)
        config = engine.config
        moe_slots = [i for i, m in enumerate(config.moe_layers) if m]
        k0 = 100 * bi + 10 * threads
        try:
            # honest, alone: greedy, seeded and unseeded sampling
            for j, (mode, params) in enumerate((("greedy", greedy), ("sampled", seeded), ("unseeded", unseeded))):
                save(base, "honest", "alone", mode, run_alone(engine, prompt(k0 + j), params), manifest, config)
            # honest, inside a batch of 8 concurrent requests
            requests = [(prompt(k0 + 3 + j), (greedy, seeded, unseeded, greedy)[j % 4] if j % 4 != 1 else
                         replace(seeded, seed=77 + j)) for j in range(8)]
            records, mean_batch = run_batch(engine, requests)
            for j, record in enumerate(records):
                save(base, "honest", "batch of 8", ("greedy", "sampled", "unseeded", "greedy")[j % 4], record,
                     manifest, config, mean_batch=mean_batch)
            # the routed experts of an honest run, for the expert edits below
            probe = records[0]
            routes0 = np.concatenate(probe.routes)[0]  # [layers, k] at fed position 0
            layer, slot = moe_slots[0], 0
            expert = int(routes0[slot, 0])
            unrouted = next(e for e in range(config.num_experts) if e not in set(routes0[slot].tolist()))
            attack_prompt = list(probe.prompt)
            mode, params = ("greedy", greedy) if odd else ("sampled", seeded)

            def weight_attack(category, model_dir, key="attacker", expert_used=None, ids=None, where=slot):
                m = trusted(work, model_dir, pub[key], f"gen{threads}")
                other = Engine(model_dir, m, budget=BUDGET, max_batch=1, max_context=MAX_CONTEXT, tokenizer=False)
                try:
                    record = run_alone(other, ids or attack_prompt, params)
                finally:
                    other.close()
                routed = None
                if expert_used is not None:
                    routes = np.concatenate(record.routes)
                    routed = bool((routes[:, where, :] == expert_used).any())
                save(base, "dishonest", category, mode, record, manifest, config, tampered_expert_routed=routed)

            release = base.get("model", base["name"])
            weight_attack("another release", work / "models" / f"{release}-v2", key="publisher")
            ef = lambda c, e=expert: c / expert_path(layer, e)  # noqa: E731
            weight_attack("expert weights x1.01", tampered(work, genuine, f"{base['name']}-t{threads}-scaled", lambda c:
                          edit_tensors(ef(c), lambda n, v: v * np.float32(1.01)), priv["attacker"]), expert_used=expert)
            weight_attack("expert output x1.01", tampered(work, genuine, f"{base['name']}-t{threads}-out", lambda c:
                          edit_tensors(ef(c), lambda n, v: v * np.float32(1.01) if ("down_proj" in n or ".w2." in n)
                                       else v), priv["attacker"]), expert_used=expert)
            weight_attack("experts swapped", tampered(work, genuine, f"{base['name']}-t{threads}-swap", lambda c:
                          swap_tensors(ef(c), ef(c, unrouted)), priv["attacker"]), expert_used=expert)

            def all_experts(change):
                def edit(c):
                    for p in sorted((c / "experts").rglob("*.safetensors")):
                        edit_tensors(p, change)
                return edit
            weight_attack("weights rounded to FP8", tampered(work, genuine, f"{base['name']}-t{threads}-fp8",
                                                             all_experts(fp8_round), priv["attacker"]))
            if base["dtype"] == "f32":  # a BF16 checkpoint is its own BF16 rounding
                weight_attack("weights rounded to BF16", tampered(work, genuine, f"{base['name']}-t{threads}-bf16",
                                                                  all_experts(bf16_round), priv["attacker"]))
            if base.get("trained"):
                weight_attack("int4 passed off", work / "models" / f"{release}-int4")
                bad_layer, bad_expert = TEXT["backdoor"]
                trigger = TEXT["trigger"][(bi + threads) % len(TEXT["trigger"])]
                weight_attack("backdoored expert", work / "models" / f"{release}-backdoor", ids=trigger,
                              expert_used=bad_expert, where=moe_slots.index(bad_layer))
            # another prompt: one token changed, the client's prompt claimed
            claimed = prompt(k0 + 20)
            changed = list(claimed)
            changed[len(changed) // 2] = (changed[len(changed) // 2] + 1) % 500 + 5
            record = run_alone(engine, changed, params)
            save(base, "dishonest", "prompt token changed", mode, replace(record, prompt=tuple(claimed)), manifest,
                 config)
            # another temperature: greedy (odd worker) or T=1.2 run, T=0.8 claimed
            ran = replace(seeded, temperature=0.0) if odd else replace(seeded, temperature=1.2)
            record = run_alone(engine, prompt(k0 + 21), ran)
            save(base, "dishonest", "other temperature", "sampled", replace(record, params=seeded), manifest, config,
                 ran_temperature=ran.temperature)
            # another seed: a different fixed seed, or the engine's own draw, with the client's seed claimed
            ran = replace(seeded, seed=999) if odd else unseeded
            record = run_alone(engine, prompt(k0 + 22), ran)
            save(base, "dishonest", "other seed", "sampled", replace(record, params=seeded), manifest, config)
            # a truncated answer: the first half, claimed as reaching max_new_tokens ("length"; the receipt's own
            # rules refuse it, so it is signed by hand as a dishonest operator would) or as ending on EOS ("stop")
            record = run_alone(engine, prompt(k0 + 23), params)
            half = max(2, len(record.tokens) // 2)
            positions = len(record.prompt) + half - 1
            routes, fps = np.concatenate(record.routes)[:positions], np.concatenate(record.fingerprints)[:positions]
            cut = replace(record, tokens=record.tokens[:half], routes=[routes], fingerprints=[fps],
                          finish_reason="length")
            signed = make_receipt(replace(cut, finish_reason="stop", tokens=cut.tokens[:-1] + [EOS]), manifest,
                                  config, priv["operator"])
            save_bytes(base, "dishonest", "truncated, claimed stop", mode, signed.data,
                       replaced_token=int(record.tokens[half - 1]))
            genuine_receipt, _ = open_receipt(make_receipt(record, manifest, config, priv["operator"]).data,
                                              [pub["operator"]])
            forged = replace(genuine_receipt, token_ids=tuple(cut.tokens), finish_reason="length",
                             fingerprint=fps.tobytes(), routing_root=routing_root(routing_leaves(routes)))
            envelope = Envelope(RECEIPT_PAYLOAD_TYPE, _canonical.encode(forged.to_payload()), (), 1 << 24)
            save_bytes(base, "dishonest", "truncated, claimed length", mode, _canonical.encode(
                {"format": RECEIPT_FORMAT, "envelope": envelope.signed_by(priv["operator"]).to_dict()}))
            # EOS put where the model continued: the last token of a full answer replaced by EOS, finish "stop"
            record = run_alone(engine, prompt(k0 + 24), params)
            if record.finish_reason == "length" and record.tokens[-1] != EOS:
                save(base, "dishonest", "EOS put in", mode,
                     replace(record, tokens=record.tokens[:-1] + [EOS], finish_reason="stop"), manifest, config,
                     replaced_token=int(record.tokens[-1]))
        finally:
            engine.close()
    (out / "cases.json").write_text(json.dumps(cases))


# --- worker: verify --------------------------------------------------------------------------------------------

def worker_verify(work: Path, out: Path, threads: int) -> None:
    """Verify every receipt in `out` (generated under the other thread count) on one warm replay engine per model;
    then a second replay without the tolerances measures each receipt's deviations."""
    from shardtool.errors import ShardtoolError
    from shardtool.manifest import open_receipt
    from shardtool.runtime import Engine, SamplingParams, Tolerances, replay_engine, replay_receipt

    _, pub = keys(work)
    cases = json.loads((out / "cases.json").read_text())
    engines, manifests = {}, {}
    loose = Tolerances(logit=INF, sample_mass=INF, fingerprint=INF)
    try:
        for case in cases:
            name = case.get("model", case["base"])
            genuine = work / "models" / name
            if name not in engines:
                manifests[name] = trusted(work, genuine, pub["publisher"], f"ver{threads}")
                engines[name] = replay_engine(genuine, manifests[name], MAX_CONTEXT, budget=BUDGET)
            engine, manifest = engines[name], manifests[name]
            try:
                receipt, _ = open_receipt((out / case["file"]).read_bytes(), [pub["operator"]])
            except ShardtoolError as err:
                case.update(valid=False, how="refused: " + err.one_line())
                continue
            verdict = replay_receipt(genuine, manifest, receipt, budget=BUDGET, engine=engine)
            case.update(valid=verdict["valid"], margins=verdict["margins"], near_ties=verdict["near_ties"],
                        how=None if verdict["valid"] else verdict["first_divergence"]["check"],
                        detail=None if verdict["valid"] else verdict["first_divergence"]["detail"])
            if case["kind"] == "dishonest" or not verdict["valid"]:
                measured = replay_receipt(genuine, manifest, receipt, budget=BUDGET, engine=engine, tol=loose)
                case["deviation"] = measured["margins"]
            if case["kind"] == "dishonest" and verdict["valid"]:
                # Is it an undetectable lie, or the very answer an honest run of the claimed request gives?
                gen = Engine(genuine, manifest, budget=BUDGET, max_batch=1, max_context=MAX_CONTEXT, tokenizer=False)
                try:
                    params = SamplingParams(receipt.max_new_tokens, temperature=receipt.temperature,
                                            top_p=receipt.top_p, seed=receipt.seed,
                                            stop_token_ids=receipt.stop_token_ids)
                    again = run_alone(gen, list(receipt.prompt_ids), params)
                finally:
                    gen.close()
                case["same_answer_as_honest"] = tuple(again.tokens) == receipt.token_ids
    finally:
        for engine in engines.values():
            engine.close()
    (out / f"verified-t{threads}.json").write_text(json.dumps(cases))


# --- worker: timing and sizes --------------------------------------------------------------------------------

def worker_time(work: Path, out: Path, bases: list[dict], tokens: int, repeats: int) -> None:
    """Per model: generation of a `tokens`-token greedy answer on a warm engine, its replay on a warm replay engine
    and a fresh replay, interleaved `repeats` times; the receipt and trace sizes."""
    from shardtool.runtime import Engine, SamplingParams, make_receipt, replay_engine, replay_receipt
    from shardtool.manifest import open_receipt

    priv, pub = keys(work)
    results = []
    for base in bases:
        genuine = work / "models" / base.get("model", base["name"])
        manifest = trusted(work, genuine, pub["publisher"], "time")
        gen = Engine(genuine, manifest, budget=BUDGET, max_batch=1, max_context=MAX_CONTEXT, tokenizer=False)
        ver = replay_engine(genuine, manifest, MAX_CONTEXT, budget=BUDGET)
        params = SamplingParams(tokens, stop_token_ids=())  # the client asks for exactly `tokens` tokens
        ids = prompt(7)
        try:
            record = run_alone(gen, ids, params)  # warm-up: every weight the answer needs is now cached
            signed = make_receipt(record, manifest, gen.config, priv["operator"])
            receipt, _ = open_receipt(signed.data, [pub["operator"]])
            assert replay_receipt(genuine, manifest, receipt, budget=BUDGET, engine=ver, stop_token_ids=())["valid"]
            g, w, f = [], [], []
            for _ in range(repeats):
                t = time.perf_counter()
                again = run_alone(gen, ids, params)
                g.append(time.perf_counter() - t)
                assert again.tokens == record.tokens
                t = time.perf_counter()
                assert replay_receipt(genuine, manifest, receipt, budget=BUDGET, engine=ver, stop_token_ids=())["valid"]
                w.append(time.perf_counter() - t)
                t = time.perf_counter()
                assert replay_receipt(genuine, manifest, receipt, budget=BUDGET, stop_token_ids=())["valid"]
                f.append(time.perf_counter() - t)
            # What each further token costs: a receipt for an answer twice as long (its size only).
            longer = run_alone(gen, ids, replace(params, max_new_tokens=2 * tokens))
            signed2 = make_receipt(longer, manifest, gen.config, priv["operator"])
        finally:
            gen.close()
            ver.close()
        covered = len(ids) + len(record.tokens)
        extra = len(longer.tokens) - len(record.tokens)
        results.append({"model": base["name"], "tokens": len(record.tokens), "prompt": len(ids),
                        "generate_s": median(g), "replay_warm_s": median(w), "replay_fresh_s": median(f),
                        "ratio_warm": median(w) / median(g), "ratio_fresh": median(f) / median(g),
                        "runs": {"generate": g, "replay_warm": w, "replay_fresh": f},
                        "receipt_bytes": len(signed.data), "trace_bytes": len(signed.trace),
                        "receipt_bytes_per_32": len(signed.data) * 32 / covered,
                        "trace_bytes_per_32": len(signed.trace) * 32 / covered,
                        "receipt_marginal_bytes_per_32": (len(signed2.data) - len(signed.data)) * 32 / extra,
                        "trace_marginal_bytes_per_32": (len(signed2.trace) - len(signed.trace)) * 32 / extra})
    (out / "timing.json").write_text(json.dumps(results))


# --- main ------------------------------------------------------------------------------------------------------

def worker(args: list[str], threads: int) -> None:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, __file__, *args], check=True, env=env)


def summarize(cases: list[dict], timing: list[dict]) -> dict:
    honest = [c for c in cases if c["kind"] == "honest"]
    dishonest = [c for c in cases if c["kind"] == "dishonest"]
    false_rejections = [c for c in honest if not c["valid"]]
    # A dishonest receipt that verifies is a miss, unless a changed seed or temperature happened to give exactly
    # the answer the claimed request gives: that receipt is then the honest one. Other weights or another prompt
    # are a miss even when the tokens agree (the receipt lies about what ran).
    excusable = ("other temperature", "other seed")
    identical = [c for c in dishonest if c["valid"] and c.get("same_answer_as_honest") and c["category"] in excusable]
    missed = [c for c in dishonest if c["valid"] and c not in identical]
    unrouted = [c for c in dishonest if c.get("tampered_expert_routed") is False]
    per_category = {}
    for cat in CATEGORIES:
        cs = [c for c in dishonest if c["category"] == cat]
        if not cs:
            continue
        fp = [c["deviation"]["max_fingerprint_relative_error"] for c in cs if "deviation" in c]
        tok = [c["deviation"]["max_token_deviation"] for c in cs if "deviation" in c]
        hows = {}
        for c in cs:
            if not c["valid"]:
                how = c["how"] if not c["how"].startswith("refused") else "refused (format)"
                hows[how] = hows.get(how, 0) + 1
        per_category[cat] = {"total": len(cs), "detected": sum(not c["valid"] for c in cs),
                             "identical_answer": sum(c in identical for c in cs), "by": hows,
                             "min_fingerprint_deviation": min(fp, default=None),
                             "min_token_deviation": min(tok, default=None)}
    hm = [c["margins"] for c in honest if "margins" in c]
    greedy_honest = [c["margins"] for c in honest if c["mode"] == "greedy" and "margins" in c]
    sampled_honest = [c["margins"] for c in honest if c["mode"] != "greedy" and "margins" in c]

    def dmin(cats, key, modes=None):
        xs = [c["deviation"][key] for c in dishonest if c["category"] in cats and "deviation" in c
              and (modes is None or c["mode"] in modes)]
        return min(xs, default=None)
    margins = {
        "fingerprint": {"honest_max": max((m["max_fingerprint_relative_error"] for m in hm), default=None),
                        "dishonest_min": dmin(FINGERPRINT_CATEGORIES, "max_fingerprint_relative_error")},
        "sample_mass": {"honest_max": max((m["max_token_deviation"] for m in sampled_honest), default=None),
                        "dishonest_min": dmin(("other temperature", "other seed", "truncated, claimed stop",
                                               "EOS put in"), "max_token_deviation", ("sampled",))},
        "greedy_logit_gap": {"honest_max_accepted": max((m["max_token_deviation"] for m in greedy_honest), default=None),
                             "honest_min_decision_margin": min((m["min_greedy_decision_margin"] for m in greedy_honest
                                                                if m["min_greedy_decision_margin"] is not None),
                                                               default=None),
                             "honest_token_near_ties": sum(c["near_ties"]["tokens"] for c in honest
                                                           if c["mode"] == "greedy" and "near_ties" in c),
                             "dishonest_min": dmin(("truncated, claimed stop", "EOS put in"), "max_token_deviation",
                                                   ("greedy",))},
        "near_ties_honest": {k: sum(c["near_ties"][k] for c in honest if "near_ties" in c)
                             for k in ("tokens", "routing", "fingerprint")},
    }
    return {"honest": len(honest), "false_rejections": len(false_rejections),
            "false_rejection_details": [{k: c.get(k) for k in ("file", "base", "category", "mode", "gen_threads",
                                                               "how", "detail")} for c in false_rejections],
            "dishonest": len(dishonest), "detected": sum(not c["valid"] for c in dishonest), "missed": len(missed),
            "missed_details": [{k: c.get(k) for k in ("file", "base", "category", "mode", "deviation")}
                               for c in missed],
            "identical_answers": len(identical), "tampered_expert_not_routed": len(unrouted),
            "per_category": per_category, "margins": margins,
            "honest_by": {k: sum(1 for c in honest if c["category"] == k) for k in ("alone", "batch of 8")},
            "honest_modes": {k: sum(1 for c in honest if c["mode"] == k) for k in ("greedy", "sampled", "unseeded")},
            "timing": timing,
            "replay_vs_generation_warm": median([t["ratio_warm"] for t in timing]),
            "replay_vs_generation_fresh": median([t["ratio_fresh"] for t in timing]),
            "receipt_bytes_per_32": median([t["receipt_bytes_per_32"] for t in timing]),
            "trace_bytes_per_32": median([t["trace_bytes_per_32"] for t in timing]),
            "receipt_marginal_bytes_per_32": median([t["receipt_marginal_bytes_per_32"] for t in timing]),
            "trace_marginal_bytes_per_32": median([t["trace_marginal_bytes_per_32"] for t in timing])}


def report(s: dict, tokens: int, time_tokens: int, repeats: int) -> None:
    from shardtool.runtime import Tolerances
    tol = Tolerances()

    def g(x):
        return "-" if x is None else f"{x:.2e}"
    print(f"\n## receipts: {s['honest']} honest runs ({s['honest_by']['alone']} alone, {s['honest_by']['batch of 8']} "
          f"in batches of 8; {s['honest_modes']['greedy']} greedy, {s['honest_modes']['sampled']} seeded, "
          f"{s['honest_modes']['unseeded']} unseeded sampling), {tokens} new tokens each, generated under 1 / 2 BLAS "
          "threads and verified under the other")
    print(f"false rejections: {s['false_rejections']} / {s['honest']} (target 0)")
    for d in s["false_rejection_details"]:
        print(f"  {d}")
    print(f"dishonest detected: {s['detected']} / {s['dishonest']} (target all); missed {s['missed']}; "
          f"accepted because the answer is exactly the honest one: {s['identical_answers']}; "
          f"tampered expert never routed: {s['tampered_expert_not_routed']}")
    print(f"{'category':<28} {'detected':>9}  {'min fp dev':>10} {'min token dev':>13}  by")
    for cat, c in s["per_category"].items():
        print(f"{cat:<28} {c['detected']:>4}/{c['total']:<4}  {g(c['min_fingerprint_deviation']):>10} "
              f"{g(c['min_token_deviation']):>13}  " + ", ".join(f"{k} {v}" for k, v in sorted(c["by"].items())))
    for d in s["missed_details"]:
        print(f"  missed: {d}")
    m = s["margins"]
    print("\n## tolerance margins (honest max vs dishonest min; tolerance in force)")
    print(f"fingerprint |committed - replayed| / max|h|: honest max {g(m['fingerprint']['honest_max'])}, dishonest "
          f"min {g(m['fingerprint']['dishonest_min'])} (weights / prompt changed); tolerance {tol.fingerprint:g}")
    print(f"sampled token, probability mass off: honest max {g(m['sample_mass']['honest_max'])}, dishonest min "
          f"{g(m['sample_mass']['dishonest_min'])}; tolerance {tol.sample_mass:g}")
    gl = m["greedy_logit_gap"]
    print(f"greedy logit gap / max|logit|: honest tokens other than the argmax {gl['honest_token_near_ties']} "
          f"(largest gap {g(gl['honest_max_accepted'])}), honest smallest top-1/top-2 margin "
          f"{g(gl['honest_min_decision_margin'])}, dishonest min {g(gl['dishonest_min'])}; tolerance {tol.logit:g}")
    print(f"near-ties tolerated on honest runs: {m['near_ties_honest']}")
    print(f"\n## replay cost and size: {time_tokens}-token greedy answers, {repeats} repeat(s), medians")
    print(f"{'model':<18} {'generate s':>10} {'replay s':>9} {'ratio':>6} {'fresh s':>8} {'ratio':>6} "
          f"{'receipt B/32':>12} {'trace B/32':>10} {'+B/32 receipt':>13} {'trace':>6}")
    for t in s["timing"]:
        print(f"{t['model']:<18} {t['generate_s']:10.4f} {t['replay_warm_s']:9.4f} {t['ratio_warm']:6.3f} "
              f"{t['replay_fresh_s']:8.4f} {t['ratio_fresh']:6.3f} {t['receipt_bytes_per_32']:12.1f} "
              f"{t['trace_bytes_per_32']:10.1f} {t['receipt_marginal_bytes_per_32']:13.1f} "
              f"{t['trace_marginal_bytes_per_32']:6.1f}")
    print(f"replay / generation: {s['replay_vs_generation_warm']:.3f} warm (target <= 0.25), "
          f"{s['replay_vs_generation_fresh']:.3f} fresh engine")
    print(f"receipt: {s['receipt_bytes_per_32']:.0f} B per 32 tokens of a {time_tokens}-token answer with its "
          f"fixed part (signature, request, roots), {s['receipt_marginal_bytes_per_32']:.0f} B per 32 further tokens "
          f"(target <= 512); routing trace {s['trace_bytes_per_32']:.0f} and {s['trace_marginal_bytes_per_32']:.0f} "
          "B per 32 tokens (token ids here < 2^16: 3 bytes each in msgpack; 5 for vocabularies over 65536)")
    sys.stdout.flush()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("--_"):
        what, work, out, rest = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
        load_text(work)
        if what == "--_generate":
            worker_generate(work, out, int(rest[0]), json.loads(rest[1]), int(rest[2]))
        elif what == "--_verify":
            worker_verify(work, out, int(rest[0]))
        else:
            worker_time(work, out, json.loads(rest[0]), int(rest[1]), int(rest[2]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats (medians)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per run of the detection experiment")
    ap.add_argument("--time-tokens", type=int, default=64, help="answer length of the timing runs")
    ap.add_argument("--quick", action="store_true", help="Mixtral F32 only, 16 new tokens, 3 timing repeats")
    ap.add_argument("--trained", type=Path, metavar="POISONED",
                    help="the trained demo model instead of the generated families; POISONED is the checkpoint "
                         "`examples/backdoor.py poison examples/demo_model POISONED` wrote")
    ap.add_argument("--rounds", type=int, default=5, help="--trained: every experiment repeated on other prompts")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shardtool-bench-receipts"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    families, dtypes = FAMILIES, DTYPES
    if args.quick:
        families, dtypes, args.tokens, args.repeats = ("mixtral",), ("f32",), 16, 3
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: trust ratios, not times)")
    started = time.perf_counter()
    (work / "text.json").unlink(missing_ok=True)
    if args.trained:
        families, dtypes = ("demo",), ("f32",) if args.quick else DTYPES
        bases = build_trained(work, dtypes, 1 if args.quick else args.rounds, args.trained)
        print(f"models: the trained demo model ({', '.join(dtypes)}) in {len(bases)} rounds of prompts, plus another "
              f"release, int4 experts and the backdoored expert; built in {time.perf_counter() - started:.1f}s",
              flush=True)
    else:
        bases = build_models(work, families, dtypes)
        print(f"models: {len(bases)} ({', '.join(families)} x {', '.join(dtypes)}), each {KNOBS} plus another "
              f"release; built in {time.perf_counter() - started:.1f}s", flush=True)
    for scratch in ("tampered", "state"):  # tampered copies are signed afresh each run: no rollback record may stay
        shutil.rmtree(work / scratch, ignore_errors=True)
    for threads in (1, 2):
        out = work / f"receipts-t{threads}"
        shutil.rmtree(out, ignore_errors=True)
        worker(["--_generate", str(work), str(out), str(threads), json.dumps(bases), str(args.tokens)], threads)
    for threads in (1, 2):
        worker(["--_verify", str(work), str(work / f"receipts-t{3 - threads}"), str(threads)], threads)
    time_bases = [b for b in bases if b["dtype"] == "f32"] if not args.quick else bases[:1]
    if args.trained:  # one model: its rounds differ only in prompts
        time_bases = time_bases[:1]
    worker(["--_time", str(work), str(work), json.dumps(time_bases), str(args.time_tokens), str(args.repeats)], 1)
    cases = []
    for threads in (1, 2):
        cases += json.loads((work / f"receipts-t{3 - threads}" / f"verified-t{threads}.json").read_text())
    s = summarize(cases, json.loads((work / "timing.json").read_text()))
    report(s, args.tokens, args.time_tokens, args.repeats)
    print(f"wall time {time.perf_counter() - started:.0f}s")
    result = {"families": list(families), "dtypes": list(dtypes), "tokens": args.tokens,
              "time_tokens": args.time_tokens, "repeats": args.repeats, **s}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
