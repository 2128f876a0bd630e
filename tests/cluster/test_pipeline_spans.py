"""A pipeline plan's nodes each run a span of whole layers (`SpanRunner`); the coordinator keeps the embedding, the
head and the commits (`PipelineLayers`, `forward_batch(layers=...)`). Here in process, without Ray or sessions: the
same logits bit for bit as one process on every family, the routes a receipt records, keys rolled back after a
failed step, an evicted sequence failing only its rows, and every malformed span call refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from shardtool.errors import UsageError
from shardtool.runtime.engine._cluster_spans import PipelineLayers, SpanRunner, span_failure
from shardtool.runtime.model import DictWeightProvider, ExpertUnavailable, KVCache, Model, Segment, StepTrace, forward_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_forward_batch import FAMILIES, NEXT, SEQUENCES  # noqa: E402
from test_model_numpy import make  # noqa: E402


class InProcess:
    """`RemoteExperts.span` without the wire: each node's SpanRunner called directly; `fail_next[node]` raises there
    once (a node lost mid-step), `down[node]` every time (a node lost for good)."""

    def __init__(self, runners: dict[str, SpanRunner]):
        self.runners, self.fail_next, self.down, self.calls = runners, set(), set(), []

    def span(self, node, span, x, segments, drop, routes):
        self.calls.append((node, span, list(segments), list(drop)))
        if node in self.fail_next or node in self.down:
            self.fail_next.discard(node)
            raise UsageError(f"node {node} lost")
        runner = self.runners[node]
        checked, dropped = runner.check(list(span), x, [list(s) for s in segments], list(drop), routes)
        y, chosen, failed = runner.run("session", x, checked, dropped, routes)
        if failed:
            raise span_failure(node, span, failed, len(x))
        return y, chosen


def pipeline(cfg, state, cuts=None, **options):
    n = cfg.num_layers
    cuts = cuts or [0, n // 2, n]
    spans = [(f"n{i}", tuple(range(a, b))) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    remote = InProcess({node: SpanRunner(cfg, DictWeightProvider(state), layers, **options) for node, layers in spans})
    return remote, PipelineLayers(remote, spans)


def steps(model: Model, layers) -> list:
    """SEQUENCES' histories one token at a time, their step together, then a decode row each: every logits."""
    out = []
    caches = [KVCache(model.config) for _ in SEQUENCES]
    for cache, (history, _, _) in zip(caches, SEQUENCES):
        for t in history:
            out.append(forward_batch(model.config, model._weights, model._rope, [Segment(np.array([t]), cache)],
                                     layers))
    out.append(forward_batch(model.config, model._weights, model._rope,
                             [Segment(np.array(ids), c, want) for c, (_, ids, want) in zip(caches, SEQUENCES)], layers))
    out.append(forward_batch(model.config, model._weights, model._rope,
                             [Segment(np.array([t]), c) for c, t in zip(caches, NEXT)], layers))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_pipeline_gives_one_process_logits_bit_for_bit(family):
    case, changes = FAMILIES[family]
    cfg, state = make(case, **changes)
    model = Model(cfg, DictWeightProvider(state))
    _, layers = pipeline(cfg, state)
    local, piped = steps(model, None), steps(model, layers)
    assert len(local) == len(piped)
    for i, (a, b) in enumerate(zip(local, piped)):
        np.testing.assert_array_equal(a, b, err_msg=f"{family}: step {i}")


def test_three_spans_of_uneven_length_give_the_same_logits():
    cfg, state = make("deepseek_v3")
    model = Model(cfg, DictWeightProvider(state))
    _, layers = pipeline(cfg, state, cuts=[0, 1, cfg.num_layers - 1, cfg.num_layers])
    for a, b in zip(steps(model, None), steps(model, layers)):
        np.testing.assert_array_equal(a, b)


def test_the_routes_a_receipt_records_are_the_ones_one_process_records():
    cfg, state = make("mixtral")
    model = Model(cfg, DictWeightProvider(state))
    _, layers = pipeline(cfg, state)
    traces = []
    for via in (None, layers):
        cache, trace = KVCache(cfg), StepTrace()
        forward_batch(cfg, model._weights, model._rope, [Segment(np.array([3, 1, 4, 1, 5]), cache, "last", trace)],
                      via)
        traces.append(trace)
    local, piped = traces
    assert len(local.routes) == sum(cfg.moe_layers) == len(piped.routes)
    for a, b in zip(local.routes, piped.routes):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(local.hidden, piped.hidden)


def test_a_replay_with_alternatives_is_refused_in_a_pipeline():
    cfg, state = make("mixtral")
    model = Model(cfg, DictWeightProvider(state))
    _, layers = pipeline(cfg, state)
    with pytest.raises(UsageError, match="replay runs every layer in one process"):
        forward_batch(cfg, model._weights, model._rope,
                      [Segment(np.array([3]), KVCache(cfg), "last", StepTrace(alternatives=True))], layers)


def test_a_step_that_fails_after_the_first_span_is_rolled_back_there_and_runs_again_alike():
    cfg, state = make("deepseek_v3")
    model = Model(cfg, DictWeightProvider(state))
    remote, layers = pipeline(cfg, state)
    cache, ref = KVCache(cfg), KVCache(cfg)
    prompt = np.array([5, 1, 90, 33])
    forward_batch(cfg, model._weights, model._rope, [Segment(prompt, cache)], layers)
    forward_batch(cfg, model._weights, model._rope, [Segment(prompt, ref)])
    remote.fail_next.add("n1")  # n0 appends this step's keys, n1 fails: the coordinator's cache does not commit
    with pytest.raises(UsageError, match="lost"):
        forward_batch(cfg, model._weights, model._rope, [Segment(np.array([7]), cache)], layers)
    assert cache.length == 4
    again = forward_batch(cfg, model._weights, model._rope, [Segment(np.array([8]), cache)], layers)
    want = forward_batch(cfg, model._weights, model._rope, [Segment(np.array([8]), ref)])
    np.testing.assert_array_equal(again, want)
    assert remote.calls[-2][2] == [(0, 4, 1)]  # the retry starts at 4 again: n0 forgot the failed step's keys


def test_an_evicted_sequence_fails_only_its_own_rows_and_a_finished_one_is_dropped():
    cfg, state = make("mixtral")
    model = Model(cfg, DictWeightProvider(state))
    remote, layers = pipeline(cfg, state, max_sequences=2)
    a, b, c = KVCache(cfg), KVCache(cfg), KVCache(cfg)
    for cache in (a, b, c):  # c evicts a (least recently used) at both nodes
        forward_batch(cfg, model._weights, model._rope, [Segment(np.array([1, 2]), cache)], layers)
    with pytest.raises(ExpertUnavailable, match="no keys for sequence 0") as e:
        forward_batch(cfg, model._weights, model._rope, [Segment(np.array([3]), b), Segment(np.array([3]), a)],
                      layers)
    assert e.value.rows.tolist() == [1]  # a's row: the engine fails that request only
    del a, e  # (the error's traceback holds a's segment)
    import gc
    gc.collect()
    forward_batch(cfg, model._weights, model._rope, [Segment(np.array([3]), b)], layers)
    assert remote.calls[-2][3] == remote.calls[-1][3] == [0]  # a cache that is gone: dropped at each node's next call
    forward_batch(cfg, model._weights, model._rope, [Segment(np.array([4]), b)], layers)
    assert remote.calls[-1][3] == []


def test_the_numbers_to_drop_at_a_node_behind_a_lost_one_stay_bounded_and_the_newest_are_sent():
    """While n0 is lost no step reaches n1: every request's cache that ends adds its number to n1's drops."""
    from shardtool.runtime.engine._cluster_spans import MAX_DROP
    cfg, state = make("mixtral")
    model = Model(cfg, DictWeightProvider(state))
    remote, layers = pipeline(cfg, state)
    remote.down.add("n0")
    for _ in range(MAX_DROP + 50):  # a request each: its step fails at n0 (503), its cache is gone
        with pytest.raises(UsageError, match="n0 lost"):
            forward_batch(cfg, model._weights, model._rope, [Segment(np.array([1]), KVCache(cfg))], layers)
    assert len(layers._gone["n1"]) <= MAX_DROP
    remote.down.clear()
    forward_batch(cfg, model._weights, model._rope, [Segment(np.array([1]), KVCache(cfg))], layers)
    sent = remote.calls[-1][3]  # n1's drops: the newest numbers, at most one call's worth
    assert sent == list(range(50, MAX_DROP + 50))


def test_a_finished_cache_collected_while_its_numbering_holds_the_lock_does_not_hang_the_coordinator():
    """A cache in a reference cycle is freed by a garbage collection, which any allocation may set off, including
    one inside `PipelineLayers`' lock (numbering a cache allocates): its finaliser runs there, on that thread."""
    import gc
    import threading
    cfg, state = make("mixtral")
    _, layers = pipeline(cfg, state)
    ran = threading.Event()

    def collect_inside_the_lock():
        with layers._lock:
            gc.collect()
        ran.set()
    gc.disable()  # (no collection of its own before the one under test)
    try:
        cycle: list = [KVCache(cfg)]
        cycle[0].cycle = cycle  # only the cyclic collector frees it
        layers._number(cycle[0])
        del cycle
        threading.Thread(target=collect_inside_the_lock, daemon=True).start()
        assert ran.wait(10), "the cache's finaliser waited for a lock its own thread held"
    finally:
        gc.enable()
    assert list(layers._drops("n0")) == [0]


BAD_CALLS = [
    ("another span", dict(span=[0, 1]), "this node runs layers"),
    ("span not a list", dict(span=(0, 2)), "this node runs layers"),
    ("wrong hidden size", dict(x=np.zeros((1, 3), np.float32)), "expected \\[rows"),
    ("no segments", dict(segments=[]), "segments must be a list of 1"),
    ("segments not a list", dict(segments="x"), "segments must be a list"),
    ("a segment of two", dict(segments=[[0, 0]]), "\\[sequence, start, rows\\]"),
    ("a bool sequence", dict(segments=[[True, 0, 1]]), "sequence must be an integer"),
    ("a negative start", dict(segments=[[0, -1, 1]]), "start"),
    ("zero rows", dict(segments=[[0, 0, 0]]), "rows must be an integer"),
    ("past the context", dict(segments=[[0, 63, 2]]), "max-context is 64"),
    ("rows that do not add up", dict(segments=[[0, 0, 2]]), "the segments have 2 rows"),
    ("a sequence twice", dict(x=np.zeros((2, 0), np.float32), segments=[[0, 0, 1], [0, 1, 1]]), "twice"),
    ("drop not a list", dict(drop=5), "drop must be a list"),
    ("a float dropped", dict(drop=[1.5]), "dropped sequence"),
    ("routes not a bool", dict(routes=1), "routes must be true or false"),
]


@pytest.mark.parametrize("name,change,message", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_a_malformed_span_call_is_refused_before_anything_runs(name, change, message):
    cfg, state = make("mixtral")
    runner = SpanRunner(cfg, DictWeightProvider(state), (1, 2), max_context=64)
    call = dict(span=[1, 3], x=np.zeros((1, cfg.hidden_size), np.float32), segments=[[0, 0, 1]], drop=[],
                routes=False)
    call.update(change)
    if call["x"].shape[1] == 0:
        call["x"] = np.zeros((call["x"].shape[0], cfg.hidden_size), np.float32)
    with pytest.raises(UsageError, match=message):
        runner.check(call["span"], call["x"], call["segments"], call["drop"], call["routes"])


def _check(runner, segments):
    rows = sum(t for _, _, t in segments)
    x = np.zeros((rows, runner.cfg.hidden_size), np.float32)
    return runner.check([1, 3], x, [list(s) for s in segments], [], False)


def test_a_call_whose_temporaries_outgrow_the_nodes_reserve_is_refused_before_it_runs():
    from shardtool.runtime.model import step_bytes
    cfg, state = make("mixtral")
    runner = SpanRunner(cfg, DictWeightProvider(state), (1, 2), max_sequences=1, max_context=8192)
    # a whole prompt in one call: attention scores [heads, t, t]; the most rows whose step fits are accepted
    fits = max(t for t in range(1, 8193) if step_bytes(cfg, t, t) <= runner.activations)
    assert 1 < fits < 8192
    _check(runner, [(0, 0, fits)])
    with pytest.raises(UsageError, match=f"a step of {fits + 1} rows over {fits + 1} keys needs .* this node keeps "
                                         f"{runner.activations} "):
        _check(runner, [(0, 0, fits + 1)])


def test_a_call_stepping_more_sequences_than_the_node_keeps_is_refused():
    cfg, state = make("mixtral")
    runner = SpanRunner(cfg, DictWeightProvider(state), (1, 2), max_sequences=2)
    _check(runner, [(0, 0, 1), (1, 0, 1)])
    with pytest.raises(UsageError, match="segments must be a list of 1 to 2 .* --max-sequences is 2.*got 3"):
        _check(runner, [(0, 0, 1), (1, 0, 1), (2, 0, 1)])


def test_a_new_sequence_never_evicts_another_sequence_of_the_same_call():
    """At its limit of sequences, a node taking a call with a new sequence and an old one evicts neither of the call's
    own: the old one's keys stay (else they would be rebuilt empty at its position and attend to garbage)."""
    cfg, state = make("mixtral")
    model = Model(cfg, DictWeightProvider(state))
    _, layers = pipeline(cfg, state, max_sequences=2)
    a, b, c = KVCache(cfg), KVCache(cfg), KVCache(cfg)
    ref_a, ref_c = KVCache(cfg), KVCache(cfg)
    for cache in (a, b):
        forward_batch(cfg, model._weights, model._rope, [Segment(np.array([1, 2]), cache)], layers)
    forward_batch(cfg, model._weights, model._rope, [Segment(np.array([1, 2]), ref_a)])
    got = forward_batch(cfg, model._weights, model._rope, [Segment(np.array([5]), c), Segment(np.array([3]), a)],
                        layers)  # a is the least recently used: c must evict b, not a
    want = forward_batch(cfg, model._weights, model._rope, [Segment(np.array([5]), ref_c),
                                                             Segment(np.array([3]), ref_a)])
    np.testing.assert_array_equal(got, want)
