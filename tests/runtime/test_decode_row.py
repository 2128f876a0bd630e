"""One sequence's decode row (`_decode_row.step`) gives `forward_batch`'s general path's result bit for bit, on
every family it takes, and declines the rest. (A failed layer or expert in the row: test_model_numpy.py.)"""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from shardtool.runtime.model import DictWeightProvider, Model, _decode_row, _packed
from shardtool.runtime.model import Segment, StepTrace, forward_batch
from shardtool.runtime.model import Tensors
from shardtool.runtime.model._layers import ExpertUnavailable

from test_model_numpy import CONFIGS, PROMPT, FailingProvider, make

# mixtral's window of 3 is outgrown by the prompt; the same model without it sees every key; qwen2_moe with the
# optional attention biases (q, k, v as Qwen2 has them, and o)
CASES = sorted(CONFIGS) + ["mixtral-no-window", "qwen2_moe-biased"]
TAKEN = {"mixtral-no-window", "qwen2_moe", "qwen2_moe-biased"}  # (the others: sinks, QK norm, clipping, MLA, Llama 4)

needs_kernels = pytest.mark.skipif(_packed._native is None, reason="the native kernels are not built")


def _make(case: str):
    if case == "mixtral-no-window":
        return make("mixtral", sliding_window=None)
    if case == "qwen2_moe-biased":
        cfg, state = make("qwen2_moe")
        rng = np.random.default_rng(1)
        for layer in range(cfg.num_layers):
            for proj, n in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                state[f"model.layers.{layer}.self_attn.{proj}_proj.bias"] = rng.standard_normal(n * cfg.head_dim,
                                                                                                np.float32)
            state[f"model.layers.{layer}.self_attn.o_proj.bias"] = rng.standard_normal(cfg.hidden_size, np.float32)
        return cfg, state
    return make(case)


class _CountingKernels:
    """The native module, counting the calls of the decode row's two fused kernels."""

    def __init__(self, native):
        self._native, self.calls = native, Counter()

    def __getattr__(self, name):
        kernel = getattr(self._native, name)
        if name not in ("attention_step", "moe_row"):
            return kernel

        def counted(*args):
            self.calls[name] += 1
            return kernel(*args)
        return counted


def _own_native(monkeypatch) -> SimpleNamespace:
    """The native module's functions in a namespace of the test's own, in its place for the test: set one to change it."""
    own = SimpleNamespace(**{name: getattr(_packed._native, name) for name in dir(_packed._native)
                             if not name.startswith("__")})
    monkeypatch.setattr(_packed, "_native", own)
    return own


def _decode(cfg, state, monkeypatch, *, general: bool, tokens=(4, 9, 17, 2, 30, 11),
            fused: Counter | None = None) -> tuple[np.ndarray, int]:
    """# -> logits [len(tokens), V] of decoding `tokens` after PROMPT, and how many steps `_decode_row` ran;
    `fused` receives the decode steps' calls of the fused kernels"""
    taken = []
    real, real_moe = _decode_row.step, _decode_row.moe_layer
    with monkeypatch.context() as m:
        kernels = _CountingKernels(_packed._native)
        m.setattr(_packed, "_native", kernels)
        m.setattr(_decode_row, "step", lambda *args: taken.append(1) or real(*args))
        # the row's experts run in `_decode_row._moe` itself: `moe_layer` is the general path's, and the fallback's
        m.setattr(_decode_row, "moe_layer", lambda *args: pytest.fail("the row fell back to moe_layer") if not general
                  else real_moe(*args))
        if general:
            m.setattr(_decode_row, "applies", lambda cfg, segments: False)
        model = Model(cfg, DictWeightProvider(state))
        model.prefill(PROMPT)
        kernels.calls.clear()
        logits = np.stack([model.decode(t) for t in tokens])
    if fused is not None:
        fused.update(kernels.calls)
    return logits, len(taken)


@needs_kernels
@pytest.mark.parametrize("case", CASES)
def test_decode_row_equals_the_general_path_bit_for_bit(case, monkeypatch):
    cfg, state = _make(case)
    fused, unfused = Counter(), Counter()
    fast, taken = _decode(cfg, state, monkeypatch, general=False, fused=fused)
    general, none = _decode(cfg, state, monkeypatch, general=True, fused=unfused)
    assert none == 0 and taken == (6 if case in TAKEN else 0)
    np.testing.assert_array_equal(fast, general)
    # the row took its fused kernels on every layer (the others: its fallbacks), the general path never
    steps = 6 if case in TAKEN else 0
    want = Counter(attention_step=steps * cfg.num_layers, moe_row=steps * sum(cfg.moe_layers))
    assert fused == +want  # (+: without the zero counts of a family the row declines)
    assert not unfused


@needs_kernels
@pytest.mark.parametrize("case", sorted(TAKEN))
def test_a_softmax_router_is_applied_by_the_row_itself(case, monkeypatch):
    """A layer's plan keeps its packed router: each decode step's MoE layer routes by `softmax_route` (the router's
    product, then `route_softmax`), never through `route` (the bits: the test above)."""
    cfg, state = _make(case)
    routed = Counter()
    real_softmax = _packed._native.route_softmax
    monkeypatch.setattr(_decode_row, "route", lambda *args: pytest.fail("the row called route"))
    _own_native(monkeypatch).route_softmax = lambda *args: routed.update(["route_softmax"]) or real_softmax(*args)
    model = Model(cfg, DictWeightProvider(state))
    model.prefill(PROMPT)
    routed.clear()
    for token in (4, 9, 17):
        model.decode(token)
    assert routed == Counter(route_softmax=3 * sum(cfg.moe_layers))


@needs_kernels
def test_a_layers_plan_is_made_once_per_trunk_shard(monkeypatch):
    cfg, state = _make("mixtral-no-window")
    made = Counter()

    class Plan(_decode_row._LayerPlan):
        __slots__ = ()

        def __init__(self, cfg, w):
            made[id(w)] += 1
            super().__init__(cfg, w)
    monkeypatch.setattr(_decode_row, "_LayerPlan", Plan)
    _, taken = _decode(cfg, state, monkeypatch, general=False)
    assert taken == 6 and sorted(made.values()) == [1] * cfg.num_layers


@needs_kernels
def test_a_trunk_shard_read_again_gets_a_plan_of_its_own(monkeypatch):
    """A plan lives in its trunk shard's memo: a provider that hands out the layer's tensors afresh at every request
    (as a store does after an eviction and a new verified read) gets a new plan each time, never one made from the
    arrays it handed out before."""
    cfg, state = _make("mixtral-no-window")
    made = []

    class Plan(_decode_row._LayerPlan):
        __slots__ = ()

        def __init__(self, cfg, w):
            made.append(w)
            super().__init__(cfg, w)

    class ReadAgain(DictWeightProvider):
        def layer(self, layer):
            return Tensors(super().layer(layer))  # the same arrays, as a new shard object

    monkeypatch.setattr(_decode_row, "_LayerPlan", Plan)
    model = Model(cfg, ReadAgain(state))
    model.prefill(PROMPT)
    for token in (4, 9, 17):
        model.decode(token)
    assert len(made) == 3 * cfg.num_layers and len({id(w) for w in made}) == len(made)


@needs_kernels
@pytest.mark.parametrize("change", ["a topk_softmax router", "a softmax router with a bias", "route_softmax declining"])
def test_a_router_softmax_route_does_not_define_is_routed_by_route(change, monkeypatch):
    """Only a softmax router without a bias is routed by `softmax_route`, and only where the extension takes its
    logits: another router kind, a router bias, or `route_softmax` declining (as for a non-finite logit: numpy's
    softmax then defines the result) takes `route` at every step, with the general path's bits."""
    cfg, state = _make("mixtral-no-window")
    if change == "a topk_softmax router":
        cfg = dataclasses.replace(cfg, router="topk_softmax")
    elif change == "a softmax router with a bias":
        cfg = dataclasses.replace(cfg, router_bias=True)
        rng = np.random.default_rng(5)
        for layer in range(cfg.num_layers):
            state[f"model.layers.{layer}.mlp.gate.bias"] = rng.standard_normal(cfg.num_experts).astype(np.float32)
    else:
        _own_native(monkeypatch).route_softmax = lambda *args: False
    calls = []
    real_route = _decode_row.route
    monkeypatch.setattr(_decode_row, "route", lambda *args: calls.append(1) or real_route(*args))
    fast, taken = _decode(cfg, state, monkeypatch, general=False)
    general, _ = _decode(cfg, state, monkeypatch, general=True)
    assert taken == 6 and len(calls) == 6 * sum(cfg.moe_layers)
    np.testing.assert_array_equal(fast, general)


@needs_kernels
@pytest.mark.parametrize("case", sorted(TAKEN))
def test_traced_row_records_what_the_general_path_records(case, monkeypatch):
    cfg, state = _make(case)
    results = []
    for general in (False, True):
        with monkeypatch.context() as m:
            if general:
                m.setattr(_decode_row, "applies", lambda cfg, segments: False)
            model = Model(cfg, DictWeightProvider(state))
            model.prefill(PROMPT)
            trace = StepTrace(alternatives=True)
            logits = forward_batch(cfg, model._weights, model._rope, [Segment(np.array([7]), model.cache, "last", trace)])
            results.append((logits, trace))
    (fast, t_fast), (slow, t_slow) = results
    np.testing.assert_array_equal(fast, slow)
    np.testing.assert_array_equal(t_fast.hidden, t_slow.hidden)
    for mine, theirs in ((t_fast.routes, t_slow.routes), (t_fast.gaps, t_slow.gaps), (t_fast.swaps, t_slow.swaps)):
        assert len(mine) == len(theirs) == sum(cfg.moe_layers)
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)


@needs_kernels
def test_an_expert_the_row_cannot_have_fails_its_rows_as_the_general_path_does(monkeypatch):
    """ExpertUnavailable naming the row and carrying the provider's error, from either path: the engine fails only
    the sequences whose rows chose that expert."""
    cfg, state = _make("mixtral-no-window")
    raised = []
    for general in (False, True):
        with monkeypatch.context() as m:
            if general:
                m.setattr(_decode_row, "applies", lambda cfg, segments: False)
            provider = FailingProvider(state)
            model = Model(cfg, provider)
            model.prefill(PROMPT)
            provider.fail = "expert"
            with pytest.raises(ExpertUnavailable) as info:
                forward_batch(cfg, model._weights, model._rope, [Segment(np.array([7]), model.cache, "last")])
            raised.append((info.value.rows.tolist(), str(info.value.cause)))
    assert raised[0] == raised[1] and raised[0][0] == [0] and "layer 2 expert" in raised[0][1], raised


def test_declines_batches_prompts_outgrown_windows_and_other_layers(monkeypatch):
    cfg, state = _make("mixtral-no-window")
    model = Model(cfg, DictWeightProvider(state))
    one = Segment(np.array([3]), model.cache)
    assert _decode_row.applies(cfg, [one]) == (_packed._native is not None)
    assert not _decode_row.applies(cfg, [Segment(np.array([3, 4]), model.cache)])
    assert not _decode_row.applies(cfg, [one, Segment(np.array([5]), model.cache)])
    windowed, _ = make("mixtral")  # window 3: the row's 4th key needs the mask
    model.cache.length = 2
    assert _decode_row.applies(windowed, [one]) == (_packed._native is not None)
    model.cache.length = 3
    assert not _decode_row.applies(windowed, [one])
    model.cache.length = 0
    for other in sorted(set(CONFIGS) - TAKEN - {"mixtral"}):
        assert not _decode_row.applies(_make(other)[0], [one]), other
    monkeypatch.setattr(_packed, "_native", None)
    model.cache.length = 0
    assert not _decode_row.applies(cfg, [one])



@needs_kernels
def test_a_growing_cache_and_unplain_inputs_give_the_same_bits(monkeypatch):
    # Past the cache's initial capacity of 64 (no max_tokens: it grows by copying), and with the attention's input
    # refused as not plain (the row then runs `gqa_attention` itself): the general path's logits, bit for bit.
    cfg, state = _make("qwen2_moe-biased")
    tokens = [(7 * i) % cfg.vocab_size for i in range(66)]
    fast, taken = _decode(cfg, state, monkeypatch, general=False, tokens=tokens)
    general, _ = _decode(cfg, state, monkeypatch, general=True, tokens=tokens)
    assert taken == len(tokens)
    np.testing.assert_array_equal(fast, general)
    monkeypatch.setattr(_decode_row._fused, "plain", lambda a: False)  # (numpy's attention and rotary in both runs)
    fused = Counter()
    refused, taken = _decode(cfg, state, monkeypatch, general=False, tokens=tokens[:6], fused=fused)
    general, _ = _decode(cfg, state, monkeypatch, general=True, tokens=tokens[:6])
    assert taken == 6 and not fused  # (gqa_attention, and the experts one by one)
    np.testing.assert_array_equal(refused, general)


@needs_kernels
@pytest.mark.parametrize("refused", ["self_attn.q_proj.bias", "self_attn.o_proj.bias", "input_layernorm.weight",
                                     "post_attention_layernorm.weight", "cos", "sin", "shared"])
def test_each_input_a_fused_kernel_cannot_take_sends_its_half_to_numpy(refused, monkeypatch):
    """One array in a form the kernels do not take (here: declared so) sends its layer half, and only that half, to
    the numpy path (`gqa_attention`, or the experts one by one), with the same bits as the general path."""
    cfg, state = _make("qwen2_moe-biased")
    general, _ = _decode(cfg, state, monkeypatch, general=True)
    seen = {}
    real_attend, real_shared, real_plain = _decode_row._attend, _decode_row.shared_expert, _decode_row._fused.plain

    class Plan(_decode_row._LayerPlan):  # a layer's weights are looked at once, when its plan is made
        __slots__ = ()

        def __init__(self, cfg, w):
            seen.update(w)
            super().__init__(cfg, w)

    def attend(cfg, plan, x, cos, sin, cache, layer):
        seen.update(cos=cos, sin=sin)
        return real_attend(cfg, plan, x, cos, sin, cache, layer)
    monkeypatch.setattr(_decode_row, "_LayerPlan", Plan)

    def shared(*args):
        seen["shared"] = out = real_shared(*args)
        return out
    monkeypatch.setattr(_decode_row, "_attend", attend)
    monkeypatch.setattr(_decode_row, "shared_expert", shared)
    monkeypatch.setattr(_decode_row, "_fused", SimpleNamespace(plain=lambda a: a is not seen.get(refused)
                                                               and real_plain(a)))
    fused = Counter()
    fast, taken = _decode(cfg, state, monkeypatch, general=False, fused=fused)
    kept = (Counter(attention_step=taken * cfg.num_layers) if refused == "shared"
            else Counter(moe_row=taken * sum(cfg.moe_layers)))
    assert taken == 6 and fused == kept
    np.testing.assert_array_equal(fast, general)


@needs_kernels
def test_a_row_that_asks_for_no_logits_gets_none(monkeypatch):
    cfg, state = _make("mixtral-no-window")
    model = Model(cfg, DictWeightProvider(state))
    model.prefill(PROMPT)
    assert forward_batch(cfg, model._weights, model._rope, [Segment(np.array([3]), model.cache, "none")]) is None
    assert model.cache.length == len(PROMPT) + 1
