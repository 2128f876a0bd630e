"""Run receipts end to end on real split and signed models: honest runs (alone, in a batch, greedy and sampled,
two families) verify; receipts from runs that used other weights, another prompt, seed or temperature, or that
cut the answer short do not; the CLI gives one line and the right exit code for every bad receipt.

The full experiment (hundreds of runs, thread counts, dtypes, the margins table) is benchmarks/bench_receipts.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shardtool.errors import ManifestFormatError, ReceiptMismatchError
from shardtool.keys import load_private_key, load_public_key
from shardtool.manifest import Receipt, load_trusted_manifest, open_receipt, routing_leaves, routing_root, sign_receipt
from shardtool.runtime import (Engine, FinishEvent, SamplingParams, Tolerances, check_request, make_receipt,
                               replay_receipt)
from shardtool.runtime.engine._sampling import nucleus, sample_token, sampling_slack

from _receiptkit import cli as _cli
from examples.make_tiny_moe import make_checkpoint

MODEL_ID = "test/receipts"
PROMPT = [5, 6, 7, 8, 9, 10, 11]
BUDGET = 1 << 30


def _checkpoint(work: Path, name: str, family: str, **knobs) -> Path:
    return make_checkpoint(work / name, family, experts=8, layers=2, vocab=300, dtype="f32", **knobs)


def _split_and_sign(work: Path, ckpt: Path, out: str, key: str, version: int = 1) -> Path:
    _cli("shardtool", "split", "-q", ckpt, work / out, "--model-id", MODEL_ID, "--version", version, cwd=work)
    _cli("shardtool", "sign", work / out, "--key", f"{key}.key", cwd=work)
    return work / out


def _resign(work: Path, model: Path, key: str, version: int = 1) -> None:
    """Hash a (modified) model directory again and sign it with `key`: what an operator who changed the weights
    does to make the runtime accept them."""
    (model / "manifest.msgpack").unlink()
    _cli("shardtool", "manifest", model, "--model-id", MODEL_ID, "--version", version, cwd=work)
    _cli("shardtool", "sign", model, "--key", f"{key}.key", cwd=work)


@pytest.fixture(scope="module", params=["mixtral", "deepseek_v3"])
def world(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"receipts-{request.param}")
    for name in ("publisher", "operator", "attacker"):
        _cli("shardtool", "keygen", "--out", name, "--no-passphrase", cwd=work)
    model = _split_and_sign(work, _checkpoint(work, "ck", request.param), "model", "publisher")
    return work, model, request.param


def _manifest(work: Path, model: Path, key: str = "publisher", state: str = "state"):
    return load_trusted_manifest(model / "manifest.msgpack", [load_public_key(work / f"{key}.pub")], 1,
                                 work / state)


def _run(work: Path, model: Path, params: SamplingParams, prompt=PROMPT, key: str = "publisher"):
    """(record, manifest): one recorded run on `model` as verified with `key`."""
    manifest = _manifest(work, model, key, state=f"state-{key}-{model.name}")
    engine = Engine(model, manifest, budget=BUDGET, max_batch=4)
    try:
        ticket = engine.run_one(prompt, params, lambda t: None, record=True)
    finally:
        engine.close()
    return ticket.record, engine.config


def _operator(work: Path):
    return load_private_key(work / "operator.key", lambda: b"")


def _receipt(work: Path, record, config, manifest) -> tuple[Receipt, bytes, bytes]:
    signed = make_receipt(record, manifest, config, _operator(work))
    receipt, _ = open_receipt(signed.data, [load_public_key(work / "operator.pub")])
    return receipt, signed.data, signed.trace


def _check(work: Path, model: Path, receipt: Receipt, **kw) -> dict:
    """The replay, for a client whose request named the receipt's stop tokens (most runs here ask for
    exactly max_new_tokens: no stop tokens); the default, the model's EOS ids, is tested on its own."""
    kw.setdefault("stop_token_ids", receipt.stop_token_ids)
    return replay_receipt(model, _manifest(work, model), receipt, budget=BUDGET, **kw)


GREEDY = SamplingParams(24, stop_token_ids=())
SAMPLED = SamplingParams(24, temperature=0.9, top_p=0.95, seed=1234, stop_token_ids=())


# ---------------------------------------------------------------------------------------------- honest


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, SamplingParams(16, temperature=1.0)], ids=["greedy", "sampled",
                                                                                                  "unseeded"])
def test_honest_receipt_verifies(world, params):
    work, model, _ = world
    record, config = _run(work, model, params)
    receipt, _, trace = _receipt(work, record, config, _manifest(work, model))
    assert receipt.seed == record.params.seed  # an unseeded request records the seed the engine drew
    verdict = _check(work, model, receipt)
    assert verdict["valid"], verdict
    assert verdict["positions_checked"] == len(PROMPT) + len(receipt.token_ids) - 1
    assert _check(work, model, receipt, trace=trace)["valid"]


def test_receipts_of_a_batch_verify(world):
    """Eight requests decoded together (different prompts, lengths, greedy and sampled): each receipt replays
    alone, so batch composition is within the tolerances."""
    work, model, _ = world
    manifest = _manifest(work, model)
    engine = Engine(model, manifest, budget=BUDGET, max_batch=8)
    records = {}
    try:
        tickets = []
        for i in range(8):
            params = SamplingParams(6 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i, stop_token_ids=())

            def sink(event, i=i):
                if isinstance(event, FinishEvent):
                    records[i] = event.record
            tickets.append(engine.submit([3 + i + j for j in range(1 + 2 * i)], params, sink, record=True))
        while not all(t.done for t in tickets):
            engine.step()
        assert engine.stats.last_batch_size > 1 or engine.stats.step_sequences > engine.stats.steps
    finally:
        engine.close()
    for i, record in records.items():
        receipt, _, _ = _receipt(work, record, engine.config, manifest)
        verdict = _check(work, model, receipt)
        assert verdict["valid"], (i, verdict)


# ---------------------------------------------------------------------------------------------- dishonest


def _tampered_copy(work: Path, model: Path, name: str, edit) -> Path:
    """A copy of the split directory with `edit(copy)` applied, re-signed by the attacker."""
    copy = work / name
    if not copy.exists():
        shutil.copytree(model, copy)
        edit(copy)
        _resign(work, copy, "attacker")
    return copy


def _expert_used(record, config) -> tuple[int, int]:
    """(layer, expert) of an expert the honest run routed its first token to."""
    layer = next(i for i, moe in enumerate(config.moe_layers) if moe)
    slot = [i for i, moe in enumerate(config.moe_layers) if moe].index(layer)
    return layer, int(record.routes[0][0, slot, 0])


def _edit_expert(path: Path, change) -> None:
    from safetensors.numpy import load_file, save_file
    tensors = load_file(path)
    save_file({k: change(k, v) for k, v in tensors.items()}, path)


def _expert_file(copy: Path, layer: int, expert: int) -> Path:
    return copy / "experts" / f"layer-{layer:03d}" / f"expert-{expert:04d}.safetensors"


def _dishonest(work: Path, model: Path, other: Path, params: SamplingParams, prompt=PROMPT,
               key: str = "attacker") -> dict:
    """Generate on `other` (verified with `key`), claim the genuine manifest, replay on `model`."""
    record, config = _run(work, other, params, prompt=prompt, key=key)
    receipt, _, _ = _receipt(work, record, config, _manifest(work, model))
    return _check(work, model, receipt)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_scaled_expert_is_detected(world, params):
    work, model, _ = world
    layer, expert = _expert_used(*_run(work, model, params))
    other = _tampered_copy(work, model, "scaled", lambda c: _edit_expert(
        _expert_file(c, layer, expert), lambda k, v: (v.astype(np.float32) * np.float32(1.01)).astype(v.dtype)))
    verdict = _dishonest(work, model, other, params)
    assert not verdict["valid"]
    assert verdict["first_divergence"]["position"] == 0  # the first token is routed to the scaled expert


def test_scaled_expert_output_is_detected(world):
    """One routed expert's output x1.01 (its down projection only): the answer's tokens usually stay the same, so
    only the fingerprint can see it; its deviation (measured by the benchmark: >= 7e-4 of max|h|) passed the
    earlier tolerance of 1e-3."""
    work, model, _ = world
    layer, expert = _expert_used(*_run(work, model, GREEDY))
    other = _tampered_copy(work, model, "scaled-output", lambda c: _edit_expert(
        _expert_file(c, layer, expert), lambda k, v: (v * np.float32(1.01)).astype(v.dtype)
        if k.endswith(("down_proj.weight", "w2.weight")) else v))
    verdict = _dishonest(work, model, other, GREEDY)
    assert not verdict["valid"] and verdict["first_divergence"]["position"] == 0


def test_the_fingerprint_tolerance_sits_between_honest_noise_and_a_scaled_expert(world):
    """Committed fingerprint values moved by 2e-6 of max|h| (twice the largest honest error measured) verify; moved
    by 1e-4 (below what one expert's output x1.01 causes) they do not. Fails if the tolerance is loosened to 1e-3."""
    work, model, _ = world
    record, config = _run(work, model, GREEDY)
    manifest = _manifest(work, model)
    for factor, valid in ((1 + 2e-6, True), (1 + 1e-4, False)):
        fingerprints = [f.copy() for f in record.fingerprints]
        for f in fingerprints:
            f["v"] = (f["v"].astype(np.float64) * factor).astype(np.float32)
        receipt, _, _ = _receipt(work, replace(record, fingerprints=fingerprints), config, manifest)
        verdict = _check(work, model, receipt)
        assert verdict["valid"] == valid, (factor, verdict)
        if not valid:
            assert verdict["first_divergence"]["check"] == "fingerprint"


def test_swapped_experts_are_detected(world):
    work, model, _ = world
    layer, expert = _expert_used(*_run(work, model, GREEDY))
    swap = (expert + 1) % 8

    def edit(c: Path) -> None:
        a, b = _expert_file(c, layer, expert), _expert_file(c, layer, swap)
        from safetensors.numpy import load_file, save_file
        ta, tb = load_file(a), load_file(b)
        save_file({k.replace(f".{swap}.", f".{expert}."): v for k, v in tb.items()}, a)
        save_file({k.replace(f".{expert}.", f".{swap}."): v for k, v in ta.items()}, b)
    other = _tampered_copy(work, model, "swapped", edit)
    assert not _dishonest(work, model, other, GREEDY)["valid"]


def test_weights_rounded_to_bf16_are_detected(world):
    import ml_dtypes
    work, model, _ = world

    def edit(c: Path) -> None:
        for path in (c / "experts").rglob("*.safetensors"):
            _edit_expert(path, lambda k, v: v.astype(ml_dtypes.bfloat16).astype(v.dtype)
                         if v.dtype == np.float32 else v)
    other = _tampered_copy(work, model, "bf16", edit)
    verdict = _dishonest(work, model, other, GREEDY)
    assert not verdict["valid"] and verdict["first_divergence"]["check"] == "fingerprint"


def test_another_release_is_detected(world):
    """A second release of the same model (other weights, version 2): claiming version 1 fails the replay; an
    honest version-2 receipt names weights the version-1 directory does not hold."""
    work, model, family = world
    v2 = work / "model-v2"
    if not v2.exists():
        _split_and_sign(work, _checkpoint(work, "ck2", family, seed=7), "model-v2", "publisher", version=2)
    assert not _dishonest(work, model, v2, GREEDY, key="publisher")["valid"]
    record, config = _run(work, v2, GREEDY)
    receipt, _, _ = _receipt(work, record, config, _manifest(work, v2, state="state-v2"))
    with pytest.raises(ReceiptMismatchError, match="manifest version 2"):
        _check(work, model, receipt)


def test_changed_prompt_is_detected(world):
    work, model, _ = world
    record, config = _run(work, model, GREEDY, prompt=PROMPT[:3] + [PROMPT[3] + 1] + PROMPT[4:])
    claimed = replace(record, prompt=tuple(PROMPT))  # the client's prompt
    receipt, _, _ = _receipt(work, claimed, config, _manifest(work, model))
    verdict = _check(work, model, receipt)
    assert not verdict["valid"] and verdict["first_divergence"]["position"] == 3


@pytest.mark.parametrize("change", [{"seed": 4321}, {"temperature": 0.6}], ids=["seed", "temperature"])
def test_changed_sampling_is_detected(world, change):
    work, model, _ = world
    record, config = _run(work, model, replace(SAMPLED, **change))
    claimed = replace(record, params=SAMPLED)
    receipt, _, _ = _receipt(work, claimed, config, _manifest(work, model))
    verdict = _check(work, model, receipt)
    assert not verdict["valid"] and verdict["first_divergence"]["check"] == "token"


def test_truncated_answer_is_refused_before_replay(world):
    """An answer cut short, claimed as reaching max_new_tokens or as ending on a stop token: refused by the
    receipt's own rules as soon as its signature verifies (our signer will not even sign it)."""
    from shardtool.manifest import Envelope, _canonical
    from shardtool.manifest._receipt import RECEIPT_FORMAT, RECEIPT_PAYLOAD_TYPE
    work, model, _ = world
    record, config = _run(work, model, GREEDY)
    receipt, _, _ = _receipt(work, record, config, _manifest(work, model))
    cut = replace(receipt, token_ids=receipt.token_ids[:-3], fingerprint=receipt.fingerprint[:-24])
    for finish in ("length", "stop"):
        forged = replace(cut, finish_reason=finish)
        with pytest.raises(ManifestFormatError, match="max_new_tokens|stop token"):
            sign_receipt(forged, _operator(work))
        envelope = Envelope(RECEIPT_PAYLOAD_TYPE, _canonical.encode(forged.to_payload()), (), 1 << 24)
        data = _canonical.encode({"format": RECEIPT_FORMAT,
                                  "envelope": envelope.signed_by(_operator(work)).to_dict()})
        with pytest.raises(ManifestFormatError, match="max_new_tokens|stop token"):
            open_receipt(data, [load_public_key(work / "operator.pub")])


def test_routing_near_tie_is_tolerated_and_counted(world):
    """A receipt whose routing differs from the replay only by swapping near-tied experts: accepted within the
    route tolerance (the swap found by search without the trace, and located with it); refused at tolerance 0."""
    work, model, _ = world
    record, config = _run(work, model, GREEDY)
    routes = np.concatenate(record.routes)
    # Take the replay's closest call (the smallest gap between a chosen and an unchosen expert) and swap it, as a
    # near-tie resolved the other way by different rounding would.
    manifest = _manifest(work, model)
    engine = Engine(model, manifest, budget=BUDGET, max_batch=1)
    try:
        fed = np.array(record.prompt + tuple(record.tokens[:-1]))
        (_, _, trace), = list(engine.teacher_forced(fed))
    finally:
        engine.close()
    gaps = np.stack(trace.gaps, axis=1)  # [positions, layers]
    position, slot = np.unravel_index(int(np.argmin(gaps)), gaps.shape)
    out, into = trace.swaps[slot][position]
    altered = routes.copy()
    row = altered[position, slot]
    row[row == out] = into
    altered[position, slot] = np.sort(row)
    signed = make_receipt(replace(record, routes=[altered]), manifest, config, _operator(work))
    receipt, _ = open_receipt(signed.data, [load_public_key(work / "operator.pub")])
    assert receipt.routing_root == routing_root(routing_leaves(altered))
    loose = Tolerances(route_gap=float(gaps[position, slot]) * 1.0001)
    for trace_file in (None, signed.trace):
        verdict = _check(work, model, receipt, tol=loose, trace=trace_file)
        assert verdict["valid"] and verdict["near_ties"]["routing"] == 1, verdict
    strict = _check(work, model, receipt, tol=Tolerances(route_gap=0.0), trace=signed.trace)
    assert not strict["valid"]
    assert strict["first_divergence"] | {"detail": None} == {
        "position": int(position), "token_index": _token_index(int(position)), "layer": receipt.moe_layers[slot],
        "check": "routing", "detail": None}
    assert not _check(work, model, receipt, tol=Tolerances(route_gap=0.0))["valid"]


def _token_index(position: int) -> int | None:
    return position - len(PROMPT) if position >= len(PROMPT) else None


def test_sampling_slack_is_zero_exactly_for_the_drawn_token():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64).astype(np.float32)
    for temperature, top_p in ((0.5, 1.0), (1.0, 0.8), (2.0, 0.3)):
        a, b = np.random.default_rng(9), np.random.default_rng(9)
        for _ in range(30):
            token = sample_token(logits, temperature=temperature, top_p=top_p, rng=a)
            u = b.random()
            assert sampling_slack(logits, temperature, top_p, u, token) == 0.0
            assert sampling_slack(logits, temperature, top_p, u, (token + 1) % 64) > 0.0


def test_a_request_no_honest_run_serves_is_refused_before_replay(world):
    """Past the signed context, or stopping at other tokens than the request named (by default the signed
    config's EOS ids, what verify-and-run and serve stop at)."""
    work, model, _ = world
    record, config = _run(work, model, GREEDY)
    receipt, _, _ = _receipt(work, record, config, _manifest(work, model))
    check_request(receipt, config, receipt.stop_token_ids)
    with pytest.raises(ReceiptMismatchError, match="tokens of context"):
        check_request(replace(receipt, max_new_tokens=config.max_position_embeddings), config, ())
    with pytest.raises(ReceiptMismatchError, match="end-of-sequence ids are"):
        check_request(receipt, config)  # GREEDY named no stop tokens; the default expects the config's EOS
    with pytest.raises(ReceiptMismatchError, match="end-of-sequence ids are"):
        _check(work, model, receipt, stop_token_ids=None)


def test_near_tie_tokens_are_bounded_per_receipt(world):
    """Each near-tie token is a choice the operator could have made: the last token swapped for another is
    accepted under a (deliberately huge) logit tolerance, but not past max_token_ties."""
    work, model, _ = world
    record, config = _run(work, model, GREEDY)
    receipt, _, _ = _receipt(work, record, config, _manifest(work, model))
    last = receipt.token_ids[-1]
    other = replace(receipt, token_ids=receipt.token_ids[:-1] + ((last + 1) % config.vocab_size,))
    forged, _ = open_receipt(sign_receipt(other, _operator(work)), [load_public_key(work / "operator.pub")])
    loose = _check(work, model, forged, tol=Tolerances(logit=10.0))
    assert loose["valid"] and loose["near_ties"]["tokens"] == 1, loose
    capped = _check(work, model, forged, tol=Tolerances(logit=10.0, max_token_ties=0))
    assert not capped["valid"] and "tolerated near-tie" in capped["first_divergence"]["detail"], capped
    assert not _check(work, model, forged)["valid"]


def test_the_sampling_tolerance_admits_few_tokens_on_a_long_tail():
    """A 150k-token vocabulary with p proportional to 1/rank: a draw in the tail has many tiny intervals near it.
    The earlier tolerance (1e-4 of mass) let the operator pick among dozens to hundreds of them at one step;
    the tolerance in force admits a handful."""
    ranks = np.arange(1, 150_001, dtype=np.float64)
    logits = (-np.log(ranks)).astype(np.float32)[np.random.default_rng(5).permutation(150_000)]
    order, cdf = nucleus(logits, 1.0, 1.0)
    lo = np.concatenate(([0.0], cdf[:-1]))

    def admitted(u: float, tol: float) -> np.ndarray:  # positions whose interval lies within tol of u
        return np.nonzero((cdf >= u - tol) & (lo <= u + tol))[0]

    for u in (0.9, 0.95, 0.99):  # (1e-4 admitted 108, 202 and 332 tokens here; 1e-6 admits 2, 3 and 4)
        now = admitted(u, Tolerances().sample_mass)
        assert 1 <= len(now) <= 8, (u, len(now))
        assert len(admitted(u, 1e-4)) > 20 * len(now), u
        inside, outside = order[now[-1]], order[now[-1] + 1]  # the implementation agrees at the edge
        assert sampling_slack(logits, 1.0, 1.0, u, int(inside)) <= Tolerances().sample_mass
        assert sampling_slack(logits, 1.0, 1.0, u, int(outside)) > Tolerances().sample_mass


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def cli_world(tmp_path_factory):
    work = tmp_path_factory.mktemp("receipts-cli")
    for name in ("publisher", "operator", "stranger"):
        _cli("shardtool", "keygen", "--out", name, "--no-passphrase", cwd=work)
    _split_and_sign(work, _checkpoint(work, "ck", "qwen3_moe"), "model", "publisher")
    _cli("verify-and-run", "model", "--trust", "publisher.pub", "--model-id", MODEL_ID, "--prompt-ids", "4,5,6,7",
         "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "11", "--print-ids", "-q",
         "--receipt-key", "operator.key",
         "--receipt-out", "run.receipt", "--trace-out", "run.trace", cwd=work)
    return work


def _verify(work: Path, receipt: str, *extra) -> subprocess.CompletedProcess:
    return _cli("shardtool", "verify-receipt", receipt, "model", "--operator", "operator.pub", "--trust",
                "publisher.pub", "--model-id", MODEL_ID, *extra, cwd=work, check=False)


def test_cli_verify_and_run_receipt_verifies(cli_world):
    proc = _verify(cli_world, "run.receipt", "--json")
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(proc.stdout)
    assert verdict["valid"] and verdict["prompt_ids"] == [4, 5, 6, 7] and len(verdict["token_ids"]) == 12
    assert verdict["request"]["temperature"] == 0.8
    proc = _verify(cli_world, "run.receipt", "--trace", "run.trace")
    assert proc.returncode == 0 and "VALID" in proc.stderr and proc.stdout == ""


def _one_line_exit(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def _payload_type_swapped(work: Path) -> bytes:
    """The genuine payload, signed by the operator under the manifest's payloadType."""
    from shardtool.manifest import PAYLOAD_TYPE, Envelope, _canonical
    genuine = (work / "run.receipt").read_bytes()
    doc = _canonical.decode(genuine, max_size=1 << 24)
    env = Envelope(PAYLOAD_TYPE, doc["envelope"]["payload"], (), 1 << 24).signed_by(_operator(work))
    return _canonical.encode({"format": doc["format"], "envelope": env.to_dict()})


@pytest.mark.parametrize("case", ["truncated", "garbage-100MB", "garbage-small", "unknown-key", "payload-type",
                                  "other-model", "empty"])
def test_cli_bad_receipts_exit_1_with_one_line(cli_world, case):
    work = cli_world
    genuine = (work / "run.receipt").read_bytes()
    path = work / f"{case}.receipt"
    if case == "truncated":
        path.write_bytes(genuine[:len(genuine) // 2])
        needles = ("not valid msgpack",)
    elif case == "garbage-100MB":
        with open(path, "wb") as fh:  # sparse: 100 MB claimed, refused by its size before a byte is read
            fh.truncate(100_000_000)
        needles = ("refused before reading",)
    elif case == "garbage-small":
        path.write_bytes(os.urandom(5000))
        needles = ("receipt",)
    elif case == "unknown-key":
        stranger = load_private_key(work / "stranger.key", lambda: b"")
        receipt, _ = open_receipt(genuine, [load_public_key(work / "operator.pub")])
        path.write_bytes(sign_receipt(receipt, stranger))
        needles = ("none of the 1 signature(s) verifies",)
    elif case == "payload-type":
        path.write_bytes(_payload_type_swapped(work))
        needles = ("payloadType",)
    elif case == "other-model":
        receipt, _ = open_receipt(genuine, [load_public_key(work / "operator.pub")])
        path.write_bytes(sign_receipt(replace(receipt, model_id="test/other"), _operator(work)))
        needles = ("NOT VALID", "model ID 'test/other'")
    else:
        path.write_bytes(b"")
        needles = ("empty",)
    _one_line_exit(_verify(work, path.name), 1, *needles)


def test_cli_usage_errors_exit_2(cli_world):
    work = cli_world
    _one_line_exit(_verify(work, "missing.receipt"), 2, "does not exist")
    _one_line_exit(_cli("shardtool", "verify-receipt", "run.receipt", "model", "--trust", "publisher.pub", cwd=work,
                        check=False), 2, "operator")
    _one_line_exit(_verify(work, "run.receipt", "--sample", "1.5"), 2, "--sample")
    proc = _cli("verify-and-run", "model", "--trust", "publisher.pub", "--prompt-ids", "4", "--receipt-key",
                "operator.key", cwd=work, check=False)
    _one_line_exit(proc, 2, "--receipt-out")


def test_cli_sample_of_a_log_finds_the_bad_receipt(cli_world):
    work = cli_world
    log = work / "log"
    log.mkdir(exist_ok=True)
    genuine = (work / "run.receipt").read_bytes()
    receipt, _ = open_receipt(genuine, [load_public_key(work / "operator.pub")])
    for i in range(3):
        (log / f"good-{i}.receipt").write_bytes(genuine)
    tokens = list(receipt.token_ids)
    tokens[4] = (tokens[4] + 1) % 300
    (log / "bad.receipt").write_bytes(sign_receipt(replace(receipt, token_ids=tuple(tokens)), _operator(work)))
    whole = _verify(work, "log", "--sample", "1", "--json")
    assert whole.returncode == 1, whole.stderr
    summary = json.loads(whole.stdout)
    assert summary["sampled"] == 4 and summary["invalid"] == ["bad.receipt"]
    bad = next(r for r in summary["results"] if r["file"] == "bad.receipt")
    assert bad["first_divergence"]["token_index"] is not None
    some = _verify(work, "log", "--sample", "0.25", "--sample-seed", "3", "--json")
    assert json.loads(some.stdout)["sampled"] == 1


def test_cli_a_stop_list_widened_to_cut_the_answer_is_refused(cli_world):
    """The operator keeps the first few of 12 tokens and adds the last kept one to the stop tokens, so the cut
    answer reads as a natural stop; the stop tokens must be the ones the request named (by default the model's
    EOS ids)."""
    from shardtool.manifest import decode_trace
    work = cli_world
    receipt, _ = open_receipt((work / "run.receipt").read_bytes(), [load_public_key(work / "operator.pub")])
    routes = decode_trace((work / "run.trace").read_bytes(), receipt)
    # The run is sampled with a fresh seed, so the kept answer must end in a token seen nowhere before it
    # (else the widened stop list would cut it earlier still and the receipt could not even be signed).
    ids = receipt.token_ids
    keep = next(k for k in range(2, len(ids)) if ids[k - 1] not in ids[:k - 1] and ids[k - 1] not in
                receipt.stop_token_ids)
    positions = len(receipt.prompt_ids) + keep - 1
    cut = replace(receipt, token_ids=receipt.token_ids[:keep], fingerprint=receipt.fingerprint[:8 * positions],
                  stop_token_ids=tuple(sorted({*receipt.stop_token_ids, receipt.token_ids[keep - 1]})),
                  finish_reason="stop", routing_root=routing_root(routing_leaves(routes[:positions])))
    (work / "cut.receipt").write_bytes(sign_receipt(cut, _operator(work)))
    _one_line_exit(_verify(work, "cut.receipt"), 1, "NOT VALID", "stops at token ids")
    named = _verify(work, "cut.receipt", "--stop-ids", ",".join(map(str, cut.stop_token_ids)), "--json")
    assert named.returncode == 0, named.stderr  # a client that did name these stops gets its genuine prefix
    assert json.loads(named.stdout)["request"]["stop_token_ids"] == list(cut.stop_token_ids)
    for bad in ("1,x", "²", "", "1," * 65):
        _one_line_exit(_verify(work, "cut.receipt", "--stop-ids", bad), 2, "--stop-ids")


def test_cli_sample_names_receipts_it_could_not_check_and_still_summarises(cli_world, monkeypatch, capsys):
    """A receipt gone between the listing and its turn is 'not checked' (exit 2 when nothing is invalid), not
    a verdict on the node, and the summary of the rest is printed."""
    from shardtool.cli import _common, main, receipt_cmd
    work = cli_world
    log = work / "log-gone"
    log.mkdir()
    (log / "good.receipt").write_bytes((work / "run.receipt").read_bytes())
    listed = receipt_cmd._receipts_in
    monkeypatch.setattr(receipt_cmd, "_receipts_in", lambda d: listed(d) + ["gone.receipt"])
    monkeypatch.setattr(_common, "keep_freed_memory", lambda: None)  # malloc tuning is for the CLI's own process
    monkeypatch.setenv("XDG_STATE_HOME", str(work / "xdg"))
    monkeypatch.setattr(sys, "argv", ["shardtool", "verify-receipt", str(log), str(work / "model"), "--operator",
                                      str(work / "operator.pub"), "--trust", str(work / "publisher.pub"),
                                      "--model-id", MODEL_ID, "--sample", "1", "--json"])
    with pytest.raises(SystemExit) as info:
        main()
    summary = json.loads(capsys.readouterr().out)
    assert info.value.code == 2, summary
    assert summary["valid"] == 1 and summary["invalid"] == [] and summary["unchecked"] == ["gone.receipt"]


def test_cli_sample_over_damaged_local_weights_blames_the_directory_not_the_node(cli_world):
    work = cli_world
    shutil.copytree(work / "model", work / "model-damaged")
    head = work / "model-damaged" / "trunk" / "head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 1
    head.write_bytes(bytes(data))
    log = work / "log-local"
    log.mkdir()
    (log / "good.receipt").write_bytes((work / "run.receipt").read_bytes())
    proc = _cli("shardtool", "verify-receipt", "log-local", "model-damaged", "--operator", "operator.pub", "--trust",
                "publisher.pub", "--model-id", MODEL_ID, "--sample", "1", cwd=work, check=False)
    _one_line_exit(proc, 1, "model directory failed verification", "head.safetensors")


def test_two_near_equal_tokens_sorted_the_other_way_round_in_the_run_are_a_near_tie_not_a_forgery():
    """The run's logits and the replay's differ by float rounding (~1e-6 measured); two tokens that close sort
    either way round, and a draw on them selects the other one: the honest receipt is accepted as a near-tie (it
    was rejected: the swap moves each interval by the other token's whole probability). A token farther away is
    still refused."""
    from shardtool.runtime.engine._replay import _check_token, _Stats

    replayed, run, a, b = _swapped_pair(3, 10)  # replay: a sorts before b; run: b before a
    order, cdf = nucleus(run, 1.0, 1.0)
    pos_b = int(np.nonzero(order == b)[0][0])
    u = float(cdf[pos_b - 1] + 0.25 * (cdf[pos_b] - cdf[pos_b - 1]))  # a draw on b's interval in the run
    assert sample_token(run, temperature=1.0, rng=_Draws([u])) == b
    assert sampling_slack(replayed, 1.0, 1.0, u, int(b)) > Tolerances().sample_mass  # the plain check refuses it

    stats = _Stats()
    assert _check_token(replayed, _one_token(b, 1.0, 1.0), 0, _Draws([u]), Tolerances(), stats) is None
    assert stats.token_ties == 1
    far = int(np.argsort(-replayed)[30])
    refused = _check_token(replayed, _one_token(far, 1.0, 1.0), 0, _Draws([u]), Tolerances(), _Stats())
    assert refused is not None and "does not give token" in refused


class _Draws:
    """A generator whose random() returns the given draws."""

    def __init__(self, draws):
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)


def test_the_order_tie_admits_only_the_two_neighbours_on_a_long_tail():
    """On a 150k-token 1/rank tail, dozens of tokens lie within 1e-5 · max|logit| of each other; the order tie
    lets a draw select only the drawn token's two sorted neighbours, never a token farther along."""
    from shardtool.runtime.engine._replay import _check_token, _Stats
    ranks = np.arange(1, 150_001, dtype=np.float64)
    logits = (-np.log(ranks)).astype(np.float32)[np.random.default_rng(5).permutation(150_000)]
    order, cdf = nucleus(logits, 1.0, 1.0)
    for u in (0.9, 0.95, 0.99):
        drawn = int(np.searchsorted(cdf, u, side="right"))
        tie = Tolerances().sample_order * float(np.max(np.abs(logits)))
        assert abs(float(logits[order[drawn + 5]]) - float(logits[order[drawn]])) <= tie  # many near-equal here

        def admitted(tol: Tolerances) -> set[int]:  # sorted positions whose token the check accepts for this draw
            return {k for k in range(drawn - 12, drawn + 13)
                    if _check_token(logits, _one_token(int(order[k]), 1.0, 1.0), 0, _Draws([u]), tol, _Stats()) is None}

        by_mass = admitted(Tolerances(sample_order=0.0))  # the 1e-6 of mass alone: 2-4 tokens here
        extra = admitted(Tolerances()) - by_mass
        assert drawn in by_mass and len(extra) <= 2, (u, sorted(by_mass), sorted(extra))
        assert extra <= {k + d for k in by_mass for d in (-1, 1)}, (u, sorted(by_mass), sorted(extra))


def _swapped_pair(seed: int, rank: int):
    """Replayed and run logits of 64 tokens where the tokens at sorted positions `rank` and `rank + 1` of the replay
    (a, then b) differ by 2e-7 and sort the other way round in the run (float rounding of 4e-7)."""
    replayed = np.random.default_rng(seed).normal(size=64)
    a, b = np.argsort(-replayed)[[rank, rank + 1]]
    replayed[b] = replayed[a] - 2e-7
    run = replayed.copy()
    run[b] = replayed[a] + 2e-7
    return replayed, run, int(a), int(b)


def _one_token(token: int, temperature: float, top_p: float):
    return type("R", (), {"token_ids": [token], "temperature": temperature, "top_p": top_p, "seed": 0})()


@pytest.mark.parametrize("rank, temperature", [(0, 1.0), (3, 1.0), (0, 0.01), (0, 1e-6), (3, 100.0)])
def test_two_near_equal_tokens_swapped_across_the_nucleus_cut_are_a_near_tie_not_a_forgery(rank, temperature):
    """top_p < 1 cuts the nucleus between the two: in the run b sorted first, was the nucleus' last token and the
    draw fell on it; the replay sorts a first, so b lies just outside its nucleus. The honest receipt is a counted
    near-tie (it was refused by how far the nucleus would have had to reach for b, all of a's probability); at a
    low temperature, where the nucleus is the top token or two, this is the usual case. The same receipt with b
    not within the tie of a (1e-3 · max|logit| below it) is refused: the cut opens no choice of its own."""
    from shardtool.runtime.engine._replay import _check_token, _Stats
    replayed, run, a, b = _swapped_pair(11, rank)
    order, probs = np.argsort(-run, kind="stable"), np.exp((run - run.max()) / temperature)
    probs = probs[order] / probs.sum()
    top_p = float(np.sum(probs[:rank + 1])) - 0.5 * float(probs[rank])  # the run's nucleus ends with b
    nuc, cdf = nucleus(run, temperature, top_p)
    assert nuc[-1] == b and a not in nuc and b not in nucleus(replayed, temperature, top_p)[0]
    lo = float(cdf[-2]) if len(cdf) > 1 else 0.0
    u = lo + 0.5 * (1.0 - lo)  # a draw on b's interval in the run
    assert sample_token(run, temperature=temperature, top_p=top_p, rng=_Draws([u])) == b

    stats = _Stats()
    assert _check_token(replayed, _one_token(b, temperature, top_p), 0, _Draws([u]), Tolerances(), stats) is None
    assert stats.token_ties == 1
    if rank:  # a draw near the end of the interval of the token before a (not tied): b is refused
        rep_cdf = nucleus(replayed, temperature, top_p)[1]
        early = float(rep_cdf[rank - 1]) - 0.1 * float(rep_cdf[rank - 1] - (rep_cdf[rank - 2] if rank > 1 else 0.0))
        assert _check_token(replayed, _one_token(b, temperature, top_p), 0, _Draws([early]), Tolerances(), _Stats())
    apart = replayed.copy()
    apart[b] = replayed[a] - 1e-3 * float(np.max(np.abs(replayed)))
    refused = _check_token(apart, _one_token(b, temperature, top_p), 0, _Draws([u]), Tolerances(), _Stats())
    assert refused is not None and "does not give token" in refused


_TIE_ATTACKS = {  # name: (logits, temperature, top_p): crafted receipts the order tie must judge, never crash on
    "flat_all_zero": (np.zeros(16, dtype=np.float32), 1.0, 1.0),
    "flat_all_equal_nucleus_cut": (np.full(16, 3.0, dtype=np.float32), 1.0, 0.3),
    "two_token_vocabulary_tied": (np.array([1.0, 1.0], dtype=np.float32), 1.0, 1.0),
    "one_token_vocabulary": (np.array([0.5], dtype=np.float32), 1.0, 1.0),
    "smallest_temperature": (np.array([2.0, 2.0, 1.0, 2.0], dtype=np.float32), 5e-324, 1.0),
    "largest_temperature": (np.random.default_rng(1).normal(size=32).astype(np.float32), 1e6, 1.0),
    "smallest_top_p": (np.array([2.0, 2.0, 2.0, 1.0], dtype=np.float32), 1e-300, 1e-300),
    "tied_plateau_long_tail": (np.r_[np.float32(5.0), np.full(40, -1.0, dtype=np.float32)], 1.0, 1.0),
    "tie_with_the_last_nucleus_token": (np.array([3.0, 1.0, 1.0, 1.0, 0.0], dtype=np.float32), 1.0, 0.9),
    # a nucleus ending 3e-7 short of the next token (admitted by the mass tolerance), which is tied to the one
    # after it: that one is not admitted as well (two tolerances composed across the cut)
    "tie_past_a_cut_the_mass_tolerance_reaches": (np.array(
        [0.3, -0.6, 0.2, 0.3, 0.6, -0.2, 0.6, -1.2, 0.8, 0.1, 0.6, -1.5, -0.7, -0.9, -0.2, 0.3, -0.5, -0.6, 0.5, 0.3,
         0.6, -0.5, -0.1, -0.5, -1.3, 0.3, 0.9, -0.5, 0.4, 0.4, -0.1, 0.7, 0.5, -0.4, -0.2, 1.6, -0.8, -1.0, 1.0, -0.4,
         0.2, -0.2, 0.4, 0.2, 1.3, 0.2, -1.6, 0.1, -1.4, -0.8, -0.4, 1.3, 0.1, 0.0, 1.1, 0.6, 0.5, 0.0, 0.4, 1.9, -0.3,
         2.9, 0.0, 0.2], dtype=np.float32), 1e6, 0.5),
}


@pytest.mark.parametrize("name", sorted(_TIE_ATTACKS))
def test_the_order_tie_gives_a_verdict_and_at_most_the_drawn_tokens_two_tied_neighbours(name):
    """For every token of the vocabulary and draws at 0, the ends and inside intervals: _check_token returns a
    verdict (no IndexError on j = 0, the nucleus' last, a token outside it; no empty nucleus), and a draw admits
    at most three tokens, the drawn one and its sorted neighbours tied with it (four for a draw exactly on a
    boundary, a chance of 2^-53): even where every logit is equal, the operator chooses among three, and each
    choice is a counted near-tie."""
    from shardtool.runtime.engine._replay import _check_token, _Stats
    logits, temperature, top_p = _TIE_ATTACKS[name]
    order, cdf = nucleus(logits, temperature, top_p)
    ends = [0.0, float(np.nextafter(1.0, 0.0))] + [float(c) for c in cdf[:-1]]
    mids = [float((lo + hi) / 2) for lo, hi in zip(np.r_[0.0, cdf[:-1]], cdf)] + [1e-7, 1.0 - 1e-7]
    tie = Tolerances().sample_order * max(float(np.max(np.abs(logits))), 1e-30)
    for u in ends + mids:
        drawn = sample_token(logits, temperature=temperature, top_p=top_p, rng=_Draws([u]))
        admitted = []
        for token in range(len(logits)):
            stats = _Stats()
            verdict = _check_token(logits, _one_token(token, temperature, top_p), 0, _Draws([u]), Tolerances(), stats)
            assert verdict is None or "does not give token" in verdict
            if verdict is None:
                admitted.append(token)
                # (a draw exactly on a boundary selects the later token and is 0 away from the earlier one)
                assert token == drawn or stats.token_ties == 1 or u in ends, (u, token)
        assert drawn in admitted and len(admitted) <= (4 if u in ends else 3), (u, drawn, admitted)
        off = [t for t in admitted if abs(float(logits[t]) - float(logits[drawn])) > tie]
        assert sampling_slack(logits, temperature, top_p, u, drawn) == 0.0
        if u not in ends:  # (on a boundary, a token within the mass of it and that token's tied neighbour)
            assert all(sampling_slack(logits, temperature, top_p, u, t) <= Tolerances().sample_mass for t in off), off


def test_order_tie_tokens_count_against_the_receipts_near_ties():
    """An operator taking the other token of a near-equal pair at every step it can: each is counted, and past
    max_token_ties the receipt is refused."""
    from shardtool.runtime.engine._replay import _check_token, _Stats
    replayed, run, a, b = _swapped_pair(11, 3)
    order, cdf = nucleus(run, 1.0, 1.0)
    pos_b = int(np.nonzero(order == b)[0][0])
    u = float(cdf[pos_b - 1] + 0.5 * (cdf[pos_b] - cdf[pos_b - 1]))
    stats, tol = _Stats(), Tolerances()
    verdicts = [_check_token(replayed, _one_token(b, 1.0, 1.0), 0, _Draws([u]), tol, stats)
                for _ in range(tol.max_token_ties + 1)]
    assert verdicts[:-1] == [None] * tol.max_token_ties
    assert "used its 8 tolerated near-tie tokens" in verdicts[-1]
