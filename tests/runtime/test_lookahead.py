"""Lookahead prefetch: recall accounting, the store's prefetch accounting, the provider's budget guard, and parity:
with lookahead on, every family gives bit-identical logits and tokens to lookahead off."""

from __future__ import annotations

from pathlib import Path

import blake3
import numpy as np
import pytest
from safetensors.numpy import save as st_save

from shardtool.manifest import Entry, build_manifest
from shardtool.runtime import ShardStore
from shardtool.runtime.model._lookahead import LookaheadStats

from _kit.cli import ok
from examples.make_tiny_moe import make_checkpoint

PROMPT = [5, 17, 300, 42, 9, 100, 7, 250]


# --- recall accounting --------------------------------------------------------------------------------------

def test_recall_counts_per_row_matches_over_chosen_experts():
    stats = LookaheadStats()
    predicted = np.array([[1, 2], [3, 4], [5, 6]])
    actual = np.array([[2, 1], [4, 7], [8, 9]])  # row 0: both, row 1: one, row 2: none
    stats.add(predicted, actual)
    assert (stats.predictions, stats.actual, stats.matched) == (3, 6, 3)
    assert stats.recall == 0.5
    # Per row, not per layer: row 1's expert 1 was predicted only for row 0, so it does not count for row 1.
    stats.add(np.array([[1, 5]]), np.array([[5, 6]]))
    assert (stats.actual, stats.matched) == (8, 4)
    assert stats.as_dict() == {"rows": 4, "actual": 8, "matched": 4, "recall": 0.5}


def test_recall_with_more_guesses_than_chosen_and_nothing_yet():
    stats = LookaheadStats()
    assert stats.recall is None
    stats.add(np.array([[0, 1, 2, 3]]), np.array([[3, 9]]))
    assert stats.recall == 0.5
    with pytest.raises(ValueError):
        stats.add(np.array([[0, 1]]), np.array([[0, 1], [2, 3]]))


def test_the_prefetch_asks_first_for_the_experts_most_rows_predicted_ties_by_id(monkeypatch):
    """One decode row (its own fast path) and several rows ask in the same order: most rows first, then by id."""
    from types import SimpleNamespace

    import shardtool.runtime.model._lookahead as la
    import shardtool.runtime.model._view as fw

    asked = []

    class Provider:
        lookahead = True

        def layer(self, layer):
            return {}

        def prefetch_experts(self, layer, ids):
            asked.append((layer, ids))

    predicted = {}
    monkeypatch.setattr(la, "prepare_layer", lambda *a, **k: {})
    monkeypatch.setattr(la, "predict_experts", lambda hidden, router, cfg: predicted["ids"])
    cfg = SimpleNamespace(num_layers=3, moe_layers=(True, True, False), vocab_size=4, hidden_size=2)
    weights = fw.PackedWeights(cfg, Provider())
    for ids, want in (([[7, 2, 5]], [2, 5, 7]), ([[7, 2], [2, 9], [9, 2]], [2, 9, 7])):
        predicted["ids"] = np.array(ids)
        asked.clear()
        weights.lookahead(1, np.zeros((len(ids), 2), np.float32))
        assert asked == [(1, want)]
    weights.lookahead(2, np.zeros((1, 2), np.float32))  # a dense layer: nothing predicted
    weights.lookahead(3, np.zeros((1, 2), np.float32))  # past the last layer
    assert asked == [(1, [2, 9, 7])]


# --- the store's prefetch accounting ------------------------------------------------------------------------

def _shards(root: Path, n: int) -> list[Entry]:
    entries = []
    for i in range(n):
        data = st_save({"w": np.full((64, 16), i, np.float32)})
        rel = f"experts/layer-000/expert-{i:04d}.safetensors"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        entries.append(Entry(path=rel, kind="expert", size=len(data), digest=blake3.blake3(data).digest(), layer=0,
                             expert=i))
    return list(build_manifest(entries, model_id="test/lookahead").entries)


def test_prefetched_shards_count_as_used_hits_and_a_guess_never_asked_for_does_not(tmp_path):
    entries = _shards(tmp_path, 4)
    store = ShardStore(tmp_path, budget_bytes=entries[0].size * 10)
    try:
        store.prefetch(entries[:2])  # a guess right (0) and one wrong (1)
        got = store.get_many([entries[0], entries[2]])  # 2 was not guessed: a miss
        assert float(got[0]["w"][0, 0]) == 0.0 and float(got[1]["w"][0, 0]) == 2.0
        s = store.stats
        assert s.prefetched == {"expert": 2} and s.prefetch_used == {"expert": 1}
        assert s.requests == {"expert": 2} and s.request_hits == {"expert": 1} and s.hit_rate("expert") == 0.5
        assert s.misses == 3  # two prefetch loads and one demand load, each read and verified once
        store.prefetch([entries[0]])  # cached: touched, not loaded again, not a new prefetch
        assert s.prefetched == {"expert": 2} and s.misses == 3
        store.get(entries[0])  # a hit, but no longer a prefetch's
        assert s.prefetch_used == {"expert": 1} and s.request_hits == {"expert": 2}
        assert s.wait_by_kind.get("expert", 0.0) >= 0.0 and set(s.wait_by_kind) <= {"expert"}
    finally:
        store.close()


def test_a_tampered_prefetched_shard_fails_when_asked_for(tmp_path):
    from shardtool.errors import DigestMismatchError

    entries = _shards(tmp_path, 2)
    path = tmp_path / entries[1].path
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    store = ShardStore(tmp_path, budget_bytes=entries[0].size * 10)
    try:
        store.prefetch(entries)  # the guess's load fails in the background, silently
        assert float(store.get(entries[0])["w"][0, 0]) == 0.0
        with pytest.raises(DigestMismatchError):
            store.get(entries[1])
    finally:
        store.close()


def test_provider_turns_lookahead_off_when_two_layers_do_not_fit(tmp_path):
    from shardtool.runtime import VerifiedWeights

    entries = _shards(tmp_path, 4)
    manifest = type("M", (), {"by_path": lambda self: {e.path: e for e in entries}})()
    size = entries[0].size
    for shards, on in ((3, False), (4, True)):  # window 2, no trunk: two layers' working sets are 4 experts
        store = ShardStore(tmp_path, budget_bytes=size * shards)
        try:
            weights = VerifiedWeights(store, manifest, num_layers=1, window=2, lookahead=True)
            assert weights.lookahead is on
            weights.prefetch_experts(0, [3, 2, 1, 0])
            # on: at most half the cache (2 shards) of guesses, most wanted first; off: none
            assert store.stats.prefetched == ({"expert": 2} if on else {})
            assert VerifiedWeights(store, manifest, num_layers=1, window=2).lookahead is False  # the default
        finally:
            store.close()


# --- parity on every family: lookahead changes what is read when, never a result --------------------------------

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "llama4")


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    work = tmp_path_factory.mktemp("lookahead")
    ok("shardtool", "keygen", "--out", work / "k", "--no-passphrase", cwd=work)
    return work


def _model(work: Path, family: str) -> Path:
    ck, out = work / f"ck-{family}", work / f"m-{family}"
    if not out.exists():
        make_checkpoint(ck, family, layers=4, experts=8, hidden=64, dtype="bf16")
        ok("shardtool", "split", "-q", ck, out, "--model-id", f"test/{family}", cwd=work)
        ok("shardtool", "sign", out, "--key", work / "k.key", cwd=work)
    return out


def _quarter_budget(model: Path, manifest) -> int:
    """The whole budget whose shard cache holds every non-expert shard and a quarter of the experts (at least the
    two layers' working sets lookahead needs: these models' embedding is big beside their experts)."""
    from shardtool.runtime import verified_config
    from shardtool.runtime.engine._plan import plan_budget

    config = verified_config(model, manifest)
    plan = plan_budget(1 << 30, config, manifest, max_tokens=len(PROMPT) + 12, readers=2)
    experts = [e.size for e in manifest.entries if e.kind == "expert"]
    trunk = [e.size for e in manifest.entries if e.kind == "trunk"]
    two_layers = 2 * (max(trunk) + config.top_k * max(experts))
    floor = (config.top_k + 1) * max(trunk + experts)  # the plan's least shard cache
    return plan.kv_cache + plan.working + max(sum(trunk) + sum(experts) // 4, two_layers, floor)


@pytest.mark.parametrize("family", FAMILIES)
def test_lookahead_on_gives_bit_identical_logits_and_tokens(signed, family):
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_verified_manifest
    from shardtool.runtime import Session

    model = _model(signed, family)
    manifest = load_verified_manifest(model / "manifest.msgpack", [load_public_key(signed / "k.pub")], 1)
    budget = _quarter_budget(model, manifest)
    got = {}
    for on in (True, False):
        session = Session(model, manifest, budget=budget, max_tokens=len(PROMPT) + 12, lookahead=on)
        try:
            report = session.generate(PROMPT, 12, temperature=0.0, top_p=1.0, seed=None, on_token=lambda t: None)
            logits = [chunk for _, chunk, _ in session.engine.teacher_forced(np.array(PROMPT + report.generated))]
            got[on] = (list(report.generated), np.concatenate(logits), session.summary())
        finally:
            session.close()
    (tokens_on, logits_on, on), (tokens_off, logits_off, off) = got[True], got[False]
    assert tokens_on == tokens_off and len(tokens_on) == 12
    assert logits_on.dtype == np.float32 and np.array_equal(logits_on, logits_off)  # bit for bit
    la = on["lookahead"]
    assert la["enabled"] and la["prefetched"] > 0 and la["actual"] > 0 and 0 < la["matched"] <= la["actual"]
    assert on["cache"]["peak_cached_bytes"] <= on["budget"]["shard_cache"]
    assert not off["lookahead"]["enabled"] and off["lookahead"]["actual"] == 0 and off["lookahead"]["prefetched"] == 0


def test_a_second_generate_on_a_session_reports_itself_alone(signed):
    """Each call's report counts its own tokens: a second call used to add them to the first call's while its
    seconds replaced the first's, so its decode rate read twice as high."""
    from shardtool.keys import load_public_key
    from shardtool.manifest import load_verified_manifest
    from shardtool.runtime import Session

    model = _model(signed, "mixtral")
    manifest = load_verified_manifest(model / "manifest.msgpack", [load_public_key(signed / "k.pub")], 1)
    session = Session(model, manifest, budget=1 << 30, max_tokens=len(PROMPT) + 6)
    try:
        first = session.generate(PROMPT, 6, temperature=0.0, top_p=1.0, seed=None, on_token=lambda t: None)
        tokens = list(first.generated)
        second = session.generate(PROMPT, 4, temperature=0.0, top_p=1.0, seed=None, on_token=lambda t: None)
        summary = session.summary()
    finally:
        session.close()
    assert len(tokens) == 6 and second.new_tokens == 4 and second.generated == tokens[:4]  # greedy: the same start
    assert summary["new_tokens"] == 4 and summary["generated_ids"] == tokens[:4]
    assert summary["decode_tokens_per_s"] == pytest.approx(3 / second.decode_seconds)


def test_verify_and_run_reports_lookahead_figures(signed, tmp_path):
    import json

    model = _model(signed, "mixtral")
    base = [model, "--trust", signed / "k.pub", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8",
            "--print-ids", "--state-dir", tmp_path / "st", "--model-id", "test/mixtral", "--memory-budget", "200MiB"]
    reports = {}
    for flag in ("--lookahead", "--no-lookahead"):
        out = tmp_path / f"r{flag}.json"
        r = ok("verify-and-run", *base, flag, "--json-report", out, cwd=tmp_path)
        reports[flag] = (r, json.loads(out.read_text()))
    (r_on, on), (r_off, off) = reports["--lookahead"], reports["--no-lookahead"]
    assert r_on.stdout == r_off.stdout and on["generated_ids"] == off["generated_ids"]
    la = on["lookahead"]
    assert la["enabled"] is True and la["requested"] is True
    assert la["predicted_from"] == "the hidden state leaving layer L, for layer L+1"
    assert 0 < la["recall"] <= 1 and la["recall"] == la["matched"] / la["actual"]
    assert la["prefetched"] > 0 and 0 <= la["prefetch_used"] <= la["prefetched"]
    assert off["lookahead"]["enabled"] is False and off["lookahead"]["recall"] is None
    for s in (on, off):
        cache = s["cache"]
        assert cache["expert_requests"] > 0 and cache["expert_hit_rate"] == cache["expert_hits"] / cache["expert_requests"]
        assert s["per_token_seconds"]["waiting_for_shards"] >= 0 and s["seconds"]["waiting_for_experts"] >= 0
    assert "lookahead: on, from the hidden state leaving layer L, for layer L+1: recall " in r_on.stderr
    assert "lookahead: off; expert cache hit rate" in r_off.stderr and "ms per new token for shards" in r_off.stderr
