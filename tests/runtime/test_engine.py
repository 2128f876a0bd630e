"""The engine's continuous batching on a real split and signed model: a request served in a batch gives the
tokens it gives alone, each step fetches each chosen expert once for the whole batch, admission holds the KV
share (queue, 503, 400), cancelling frees a slot, and a shard that fails verification fails only the
requests that need it. (The transformers oracle for batched output: test_parity_e2e.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardtool.errors import OverloadedError, RequestRefusedError
from shardtool.runtime import Engine, ErrorEvent, FinishEvent, PromptScoresEvent, SamplingParams, TokenEvent

from _kit.cli import ok as _cli
from examples.make_tiny_moe import make_checkpoint

# 16 prompts of different lengths (1 to 37 tokens) and different numbers of new tokens.
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(1 + (i * 5) % 37)] for i in range(16)]
NEW = [4 + (i * 3) % 17 for i in range(16)]


def _build(work: Path, experts: int) -> Path:
    make_checkpoint(work / "ck", "mixtral", experts=experts, layers=2)
    _cli("shardtool", "split", "-q", work / "ck", work / "model", "--model-id", "test/engine", cwd=work)
    _cli("shardtool", "keygen", "--out", "k", "--no-passphrase", cwd=work)
    _cli("shardtool", "sign", work / "model", "--key", "k.key", cwd=work)
    return work


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("engine"), 16)


@pytest.fixture(scope="module")
def few_experts(tmp_path_factory) -> Path:
    """Mixtral's shape of routing (top-2 of few experts), where a batch's sequences share most experts."""
    return _build(tmp_path_factory.mktemp("engine4"), 4)


def _verified(work: Path, model: Path, state: Path):
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_trusted_manifest

    return load_trusted_manifest(model / "manifest.msgpack", [load_public_key(work / "k.pub")], 1, state)


def _engine(work: Path, tmp_path: Path, model: Path | None = None, **kw) -> Engine:
    model = model or work / "model"
    kw.setdefault("budget", 1 << 30)
    return Engine(model, _verified(work, model, tmp_path / "state"), **kw)


class Collect:
    """A sink that keeps every event of one request."""

    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if isinstance(e, TokenEvent)]

    @property
    def end(self):
        return self.events[-1] if self.events and not isinstance(self.events[-1], TokenEvent) else None


def _drain(engine: Engine, tickets) -> None:
    for _ in range(10_000):
        if all(t.done for t in tickets):
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


def _solo(work: Path, tmp_path: Path, prompts, news, **params) -> list[list[int]]:
    engine = _engine(work, tmp_path, max_batch=1)
    try:
        out = []
        for prompt, new in zip(prompts, news):
            got: list[int] = []
            engine.run_one(prompt, SamplingParams(new, **params), got.append)
            out.append(got)
        return out
    finally:
        engine.close()


def _batched(engine: Engine, prompts, news, **params) -> list[Collect]:
    sinks = [Collect() for _ in prompts]
    tickets = [engine.submit(p, SamplingParams(n, **params), s) for p, n, s in zip(prompts, news, sinks)]
    _drain(engine, tickets)
    return sinks


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}], ids=["greedy", "sampled"])
def test_sixteen_requests_in_one_batch_each_give_their_solo_tokens(signed, tmp_path, params):
    params = [dict(params, seed=params["seed"] + i) if "seed" in params else params for i in range(16)]
    solo = [_solo(signed, tmp_path, [p], [n], **kw)[0] for p, n, kw in zip(PROMPTS[:4], NEW[:4], params[:4])]
    solo += _solo(signed, tmp_path, PROMPTS[4:], NEW[4:], **params[4]) if "seed" not in params[4] else [
        _solo(signed, tmp_path, [p], [n], **kw)[0] for p, n, kw in zip(PROMPTS[4:], NEW[4:], params[4:])]
    engine = _engine(signed, tmp_path, max_batch=16)
    try:
        sinks = [Collect() for _ in PROMPTS]
        tickets = [engine.submit(p, SamplingParams(n, **kw), s) for p, n, kw, s in zip(PROMPTS, NEW, params, sinks)]
        _drain(engine, tickets)
        m = engine.metrics()
    finally:
        engine.close()
    for i, sink in enumerate(sinks):
        assert sink.tokens == solo[i], f"request {i} (prompt of {len(PROMPTS[i])} tokens) differs in a batch"
        assert isinstance(sink.end, FinishEvent) and sink.end.reason in ("stop", "length")
    assert m["running"] == 0 and m["kv_cache_bytes_reserved"] == 0
    assert m["step_sequences_total"] > m["steps_total"], "the requests never shared a step"


def test_each_step_fetches_each_chosen_expert_once_for_the_whole_batch(signed, tmp_path):
    engine = _engine(signed, tmp_path, max_batch=16)
    calls: list[tuple[int, list[int]]] = []
    real = engine.weights.experts

    def experts(layer, ids):
        calls.append((layer, list(ids)))
        return real(layer, ids)

    engine.weights.experts = experts
    try:
        _batched(engine, PROMPTS, NEW)
        steps = engine.metrics()["steps_total"]
        layers = engine.config.num_layers
    finally:
        engine.close()
    assert len(calls) == steps * layers, "one expert fetch per MoE layer per step, whatever the batch size"
    assert all(len(ids) == len(set(ids)) for _, ids in calls)
    assert max(len(ids) for _, ids in calls) > engine.config.top_k, "no step shared experts across sequences"


def test_batched_expert_reads_per_token_fall_when_the_cache_cannot_hold_the_experts(few_experts, tmp_path):
    """With a shard cache smaller than the experts, one by one every token reads its top-2 experts per layer
    again; a batch of 8 reads each chosen expert once per step for all of them (at most 4 of 16 picks)."""
    signed = few_experts
    from shardtool.runtime import plan_budget

    probe = _engine(signed, tmp_path, max_batch=16)
    cfg, manifest = probe.config, probe.manifest
    probe.close()
    base = plan_budget(1 << 30, cfg, manifest, 64, 2, max_batch=16, kv_cache=16 * 64 * probe.bytes_per_token)
    largest = max(e.size for e in manifest.entries if e.kind in ("expert", "trunk"))
    budget = base.kv_cache + base.working + (cfg.top_k + 1) * largest  # the least the plan accepts
    prompts, news = PROMPTS[:8], [12] * 8
    kw = dict(budget=budget, max_context=64, kv_cache=base.kv_cache)

    def per_token(max_batch: int) -> float:
        engine = _engine(signed, tmp_path, max_batch=max_batch, **kw)
        try:
            sinks = _batched(engine, prompts, news)
            m = engine.metrics()
            assert m["cache_evictions_total"] > 0
            return m["expert_bytes_read_total"] / sum(len(s.tokens) for s in sinks)
        finally:
            engine.close()

    assert per_token(8) < 0.5 * per_token(1)


def test_admission_holds_the_kv_share_queues_then_refuses_with_retry_after(signed, tmp_path):
    probe = _engine(signed, tmp_path)
    per_request = probe.bytes_per_token * (len(PROMPTS[0]) + 8)
    probe.close()
    engine = _engine(signed, tmp_path, max_batch=16, max_queue=2, kv_cache=2 * per_request, max_context=64)
    try:
        sinks = [Collect() for _ in range(5)]
        tickets = [engine.submit(PROMPTS[0], SamplingParams(8), s) for s in sinks[:4]]
        m = engine.metrics()
        assert (m["running"], m["queue_depth"], m["kv_cache_bytes_reserved"]) == (2, 2, 2 * per_request)
        with pytest.raises(OverloadedError) as info:
            engine.submit(PROMPTS[0], SamplingParams(8), sinks[4])
        assert 1 <= info.value.retry_after <= 60
        _drain(engine, tickets)
        assert all(s.tokens == sinks[0].tokens and isinstance(s.end, FinishEvent) for s in sinks[:4])
        assert sinks[4].events == []
        m = engine.metrics()
        assert (m["running"], m["queue_depth"], m["kv_cache_bytes_reserved"]) == (0, 0, 0)
        assert m["requests_rejected_queue_full_total"] == 1
    finally:
        engine.close()


@pytest.mark.parametrize("prompt,new,match", [
    ([], 4, "the prompt is empty"),
    ([5, 512], 4, "token id 512 is outside this model's vocabulary of 512"),
    ([5, -1], 4, "token id -1 is outside"),
    ([5], 0, "max_tokens must be an integer >= 1"),
    ([5] * 60, 5, "more than the context of 64"),
    ([5] * 10, 30, "need .* bytes of KV cache; the whole KV cache is"),
], ids=["empty", "id-at-vocab", "negative-id", "zero-new", "over-context", "over-kv-cache"])
def test_requests_that_can_never_run_are_refused_at_once(signed, tmp_path, prompt, new, match):
    probe = _engine(signed, tmp_path)
    kv = probe.bytes_per_token * 32
    probe.close()
    engine = _engine(signed, tmp_path, max_batch=4, kv_cache=kv, max_context=64)
    try:
        with pytest.raises(RequestRefusedError, match=match):
            engine.submit(prompt, SamplingParams(new), Collect())
        assert engine.metrics()["queue_depth"] == 0
    finally:
        engine.close()


def test_cancel_frees_the_kv_share_at_the_next_step_and_admits_the_waiter(signed, tmp_path):
    probe = _engine(signed, tmp_path)
    per_request = probe.bytes_per_token * (len(PROMPTS[3]) + 20)
    probe.close()
    engine = _engine(signed, tmp_path, max_batch=4, kv_cache=per_request, max_context=64)
    try:
        first, second = Collect(), Collect()
        t1 = engine.submit(PROMPTS[3], SamplingParams(20, stop_token_ids=()), first)
        t2 = engine.submit(PROMPTS[3], SamplingParams(20, stop_token_ids=()), second)
        assert engine.metrics()["queue_depth"] == 1
        engine.step()
        engine.step()
        engine.cancel(t1)
        engine.cancel(t1)  # idempotent
        engine.step()
        assert first.end == FinishEvent("cancelled") and len(first.tokens) == 2
        assert engine.metrics()["queue_depth"] == 0 and not t2.done
        _drain(engine, [t2])
        assert len(second.tokens) == 20
    finally:
        engine.close()


def _experts_used(engine: Engine, prompt, new) -> set[tuple[int, int]]:
    used: set[tuple[int, int]] = set()
    real = engine.weights.experts

    def experts(layer, ids):
        used.update((layer, e) for e in ids)
        return real(layer, ids)

    engine.weights.experts = experts
    try:
        engine.run_one(prompt, SamplingParams(new), lambda _: None)
    finally:
        engine.weights.experts = real
    return used


def test_a_tampered_expert_fails_only_the_requests_that_need_it(signed, tmp_path):
    prompts, news = PROMPTS[:8], NEW[:8]
    clean = _solo(signed, tmp_path, prompts, news)
    tracer = _engine(signed, tmp_path, max_batch=1)
    try:
        used = [_experts_used(tracer, p, n) for p, n in zip(prompts, news)]
    finally:
        tracer.close()
    # An expert of the last layer some requests choose and others never do.
    counts = {key: sum(key in u for u in used) for u in used for key in u if key[0] == 1}
    layer, expert = min((k for k, c in counts.items() if 0 < c < len(prompts)), key=lambda k: counts[k])
    model = Path(shutil.copytree(signed / "model", tmp_path / "model"))
    engine = _engine(signed, tmp_path, model=model, max_batch=8)
    path = f"experts/layer-{layer:03d}/expert-{expert:04d}.safetensors"
    data = bytearray((model / path).read_bytes())
    data[-3] ^= 0x40
    (model / path).write_bytes(bytes(data))  # after the manifest was verified: the store must catch it
    try:
        sinks = _batched(engine, prompts, news)
        after = Collect()
        _drain(engine, [engine.submit(prompts[0], SamplingParams(news[0]), after)])
        m = engine.metrics()
    finally:
        engine.close()
    failed = [i for i, u in enumerate(used) if (layer, expert) in u]
    for i, sink in enumerate(sinks):
        if i in failed:
            assert isinstance(sink.end, ErrorEvent) and sink.end.status == 500, i
            assert path in sink.end.message and "BLAKE3" in sink.end.message
            assert sink.tokens == clean[i][:len(sink.tokens)], "a token computed from the tampered bytes left"
        else:
            assert sink.tokens == clean[i] and isinstance(sink.end, FinishEvent), f"request {i} did not need it"
    assert m["verification_failures_total"] >= len(failed) and m["requests_failed_total"] >= len(failed)
    assert (0 in failed) == isinstance(after.end, ErrorEvent), "the engine kept serving after the failure"


def test_a_tampered_trunk_shard_fails_the_step_and_the_engine_serves_on(signed, tmp_path):
    model = Path(shutil.copytree(signed / "model", tmp_path / "model"))
    engine = _engine(signed, tmp_path, model=model, max_batch=4, budget=1 << 30)
    trunk = model / "trunk" / "layer-001.safetensors"
    good = trunk.read_bytes()
    trunk.write_bytes(good[:-3] + bytes([good[-3] ^ 0x40]) + good[-2:])
    try:
        sinks = _batched(engine, PROMPTS[:3], [4, 4, 4])
        assert all(isinstance(s.end, ErrorEvent) and "trunk/layer-001" in s.end.message for s in sinks)
        trunk.write_bytes(good)  # repaired on disk: the next request verifies it again and runs
        again = _batched(engine, PROMPTS[:1], [4])[0]
        assert isinstance(again.end, FinishEvent) and len(again.tokens) == 4
    finally:
        engine.close()


def test_a_bug_outside_the_forward_pass_fails_the_batch_and_the_loop_serves_on(signed, tmp_path, monkeypatch):
    """On the background thread (serve), an unexpected exception in a step must not kill the loop: the
    requests in that step get a 500, later ones run."""
    import threading

    import shardtool.runtime.engine._engine as engine_mod

    engine = _engine(signed, tmp_path, max_batch=4)
    real = engine_mod.sample_token
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(*a, **kw)

    monkeypatch.setattr(engine_mod, "sample_token", flaky)
    engine.start()
    try:
        ends = []
        for _ in range(2):
            done = threading.Event()
            sink = Collect()

            def on(event, _sink=sink, _done=done):
                _sink(event)
                if not isinstance(event, TokenEvent):
                    _done.set()

            engine.submit(PROMPTS[1], SamplingParams(3), on)
            assert done.wait(120), "the request never ended"
            ends.append(sink.end)
    finally:
        engine.close()
    assert isinstance(ends[0], ErrorEvent) and ends[0].status == 500 and "RuntimeError" in ends[0].message
    assert isinstance(ends[1], FinishEvent)


def test_close_ends_every_request_exactly_once(signed, tmp_path):
    engine = _engine(signed, tmp_path, max_batch=4, max_queue=8)
    sinks = [Collect() for _ in range(10)]
    engine.start()
    for i, sink in enumerate(sinks):
        engine.submit(PROMPTS[i], SamplingParams(1 + i % 3), sink)
    engine.close()
    for sink in sinks:
        ends = [e for e in sink.events if not isinstance(e, TokenEvent)]
        assert len(ends) == 1, ends


def test_a_new_prompt_is_prefilled_at_once_beside_many_decoding_sequences(signed, tmp_path):
    engine = _engine(signed, tmp_path, max_batch=16)
    try:
        for i in range(12):
            engine.submit([5 + i], SamplingParams(40, stop_token_ids=()), Collect())
        engine.step()
        engine.step()
        late = Collect()
        ticket = engine.submit([7, 8, 9], SamplingParams(2, stop_token_ids=()), late)
        for _ in range(2):
            engine.step()
        assert ticket.done and len(late.tokens) == 2, "the new prompt waited behind the decoding sequences"
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------------------
# Scores (logprobs): the model's own log-softmax, against transformers on the same checkpoint.

LOGPROB_TOL = 1e-4


def _oracle_logprobs(work: Path, ids: list[int]):
    """# [T] ids -> [T, V] float64 log-softmax of transformers' float32 logits for the checkpoint `work/ck`."""
    torch = pytest.importorskip("torch", reason="the scores' oracle needs torch (pip install -e '.[oracle]')")
    transformers = pytest.importorskip("transformers", reason="the scores' oracle needs transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "ck", attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check_score(score, expected, token: int, top: int, where: str) -> None:
    import numpy as np

    assert score.token == token, where
    assert abs(score.logprob - expected[token]) <= LOGPROB_TOL, (where, score.logprob, expected[token])
    best = np.argsort(-expected, kind="stable")[:top]
    assert [t for t, _ in score.top] == [int(t) for t in best], where
    for t, lp in score.top:
        assert abs(lp - expected[t]) <= LOGPROB_TOL, (where, t, lp, expected[t])


def test_scores_equal_the_transformers_log_softmax_in_a_batch(signed, tmp_path):
    """A scored prompt with generation, a prompt scored alone (max_tokens 0) and a sampled request with logprobs,
    in one batch beside plain requests: every score is transformers' log-softmax (before temperature and top-p)."""
    engine = _engine(signed, tmp_path, max_batch=16)
    plain = [Collect() for _ in range(3)]
    scored, alone, sampled = Collect(), Collect(), Collect()
    try:
        tickets = [engine.submit(PROMPTS[i + 5], SamplingParams(6), s) for i, s in enumerate(plain)]
        engine.step()  # the plain ones decode while the scored prompts prefill
        tickets += [engine.submit(PROMPTS[9], SamplingParams(5, stop_token_ids=()), scored, logprobs=3,
                                  score_prompt=True),
                    engine.submit(PROMPTS[13], SamplingParams(0), alone, logprobs=2, score_prompt=True),
                    engine.submit(PROMPTS[4], SamplingParams(4, temperature=1.5, top_p=0.5, seed=3,
                                                             stop_token_ids=()), sampled, logprobs=20)]
        _drain(engine, tickets)
    finally:
        engine.close()
    for sink, prompt, top in ((scored, PROMPTS[9], 3), (alone, PROMPTS[13], 2), (sampled, PROMPTS[4], 20)):
        ids = prompt + sink.tokens
        expected = _oracle_logprobs(signed, ids)
        prompt_scores = [e.scores for e in sink.events if isinstance(e, PromptScoresEvent)]
        if sink is sampled:
            assert prompt_scores == []
        else:
            assert len(prompt_scores) == 1 and len(prompt_scores[0]) == len(prompt) and prompt_scores[0][0] is None
            for i, score in enumerate(prompt_scores[0][1:], start=1):
                _check_score(score, expected[i - 1], prompt[i], top, f"prompt token {i}")
        tokens = [e for e in sink.events if isinstance(e, TokenEvent)]
        for i, event in enumerate(tokens):
            at = len(prompt) + i
            _check_score(event.logprobs, expected[at - 1], ids[at], top, f"new token {i}")
        assert isinstance(sink.end, FinishEvent) and sink.end.reason == "length"
    assert alone.tokens == [] and len(scored.tokens) == 5 and len(sampled.tokens) == 4
    for sink in plain:
        assert all(e.logprobs is None for e in sink.events if isinstance(e, TokenEvent))


def test_a_prompt_scored_in_chunks_of_three_rows(signed, tmp_path, monkeypatch):
    """Prefill in chunks (a small activation reserve): each chunk's last row scores the next chunk's first token."""
    import shardtool.runtime.engine._engine as engine_module

    monkeypatch.setattr(engine_module, "step_rows", lambda cfg, reserve, keys: 3)
    engine = _engine(signed, tmp_path)
    sink = Collect()
    prompt = PROMPTS[11]
    try:
        ticket = engine.submit(prompt, SamplingParams(2, stop_token_ids=()), sink, logprobs=1, score_prompt=True)
        _drain(engine, [ticket])
    finally:
        engine.close()
    assert len(prompt) > 9 and engine.stats.steps >= len(prompt) // 3
    expected = _oracle_logprobs(signed, prompt + sink.tokens)
    (scores,) = [e.scores for e in sink.events if isinstance(e, PromptScoresEvent)]
    for i in range(1, len(prompt)):
        _check_score(scores[i], expected[i - 1], prompt[i], 1, f"prompt token {i}")


@pytest.mark.parametrize("new, kw, match", [
    (0, {}, "max_tokens must be an integer >= 1"),
    (0, {"logprobs": 2}, "max_tokens must be an integer >= 1"),
    (1, {"logprobs": 21}, "logprobs must be an integer from 0 to 20"),
    (1, {"logprobs": -1}, "logprobs must be an integer from 0 to 20"),
    (-1, {"score_prompt": True}, "max_tokens must be an integer >= 0"),
], ids=["zero-new-unscored", "zero-new-logprobs-only", "top-21", "top-negative", "negative-new-scored"])
def test_bad_score_requests_are_refused(signed, tmp_path, new, kw, match):
    engine = _engine(signed, tmp_path)
    try:
        with pytest.raises(RequestRefusedError, match=match):
            engine.submit([5, 6], SamplingParams(new), Collect(), **kw)
    finally:
        engine.close()


def test_a_prompt_past_the_context_is_refused_with_its_code(signed, tmp_path):
    engine = _engine(signed, tmp_path, max_context=16)
    try:
        with pytest.raises(RequestRefusedError) as info:
            engine.submit(list(range(3, 15)), SamplingParams(5), Collect())
        assert info.value.code == "context_length_exceeded"
    finally:
        engine.close()


def test_expert_cache_is_the_heat_map_of_the_store_by_manifest_layer(few_experts, tmp_path):
    """What the status page draws: each MoE layer of the manifest, its expert count, which are cached (the store's
    cached paths, mapped through the signed entries) and the hits of each; the hits sum to the store's expert hits."""
    engine = _engine(few_experts, tmp_path, max_batch=4)
    try:
        assert [(x["layer"], x["experts"], x["cached"], sum(x["hits"])) for x in engine.expert_cache()["layers"]] \
            == [(0, 4, [], 0), (1, 4, [], 0)]
        _batched(engine, PROMPTS[:4], NEW[:4])
        layers = engine.expert_cache()["layers"]
        paths, _ = engine.store.expert_cache()
        stats = engine.store.stats
    finally:
        engine.close()
    by_path = engine.manifest.by_path()
    cached = {(by_path[p].layer, by_path[p].expert) for p in paths if by_path[p].kind == "expert"}
    assert {(x["layer"], e) for x in layers for e in x["cached"]} == cached and cached
    assert sum(sum(x["hits"]) for x in layers) == stats.request_hits["expert"] > 0
