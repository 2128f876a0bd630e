"""A step over several sequences (`forward_batch`) gives each the logits and cache it gets alone: the attention's
products run once on all the step's rows, its scores each sequence's rows against its own cache. (One sequence's
decode row: test_decode_row.py; the engine's batches on a signed model: test_engine.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from shardtool.runtime.model import DictWeightProvider, KVCache, Model, Segment, _forward, forward_batch

from test_model_numpy import make

# name -> (config case, changes): a sliding window of 3 (Mixtral); MLA with and without a query low rank (DeepSeek-V3,
# Kimi K2); per-head QK norm with a sliding window (Qwen3-MoE); whole-projection QK norm and clipping (OLMoE); chunked
# attention and a NoPE layer (Llama 4); sinks and biases on alternate sliding layers (gpt-oss)
FAMILIES = {
    "mixtral-window": ("mixtral", {}),
    "deepseek_v3-mla": ("deepseek_v3", {}),
    "kimi_k2-mla": ("kimi_k2", {}),
    "qwen3_moe-qk_norm-window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 3,
                                               "max_window_layers": 3}),
    "olmoe-qk_norm-clip": ("olmoe", {}),
    "llama4-chunked-nope": ("llama4", {}),
    "gpt_oss-sinks": ("gpt_oss", {}),
}

# Per sequence: the tokens already in its cache, the step's new tokens, the logits it asks for. Decode rows at
# different lengths (inside and past the windows and chunks), a whole prompt, and a prompt's later chunk.
SEQUENCES = (
    ([5, 1, 90, 33, 7, 12], [4], "last"),
    ([], [3, 14, 15, 92, 6], "all"),
    ([2, 7], [18], "last"),
    ([2, 7, 1, 8, 2, 8, 1], [50, 51, 52], "last"),
    ([9, 9, 40, 41, 42, 43, 44, 45, 46, 3], [60], "last"),
    ([77], [61, 62], "none"),
)
NEXT = [8, 21, 34, 55, 89, 13]  # the step after: one decode row each


def _history(model: Model, tokens: list[int]) -> KVCache:
    """# a fresh cache holding `tokens`, run one at a time alone (an empty cache when there are none)"""
    cache = KVCache(model.config)
    for t in tokens:
        forward_batch(model.config, model._weights, model._rope, [Segment(np.array([t]), cache, "none")])
    return cache


def _steps(model: Model, together: bool) -> list[np.ndarray | None]:
    """# SEQUENCES' step, then a decode row each: the two steps' logits, every sequence in one batch (`together`)
    or each alone (its logits concatenated in the same order)"""
    caches = [_history(model, history) for history, _, _ in SEQUENCES]
    steps = [[Segment(np.array(ids), cache, want) for cache, (_, ids, want) in zip(caches, SEQUENCES)],
             [Segment(np.array([t]), cache, "last") for cache, t in zip(caches, NEXT)]]
    out = []
    for segments in steps:
        if together:
            out.append(forward_batch(model.config, model._weights, model._rope, segments))
        else:
            alone = [forward_batch(model.config, model._weights, model._rope, [seg]) for seg in segments]
            out.append(np.concatenate([logits for logits in alone if logits is not None]))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_batched_step_equals_each_sequence_alone(family):
    case, changes = FAMILIES[family]
    cfg, state = make(case, **changes)
    model = Model(cfg, DictWeightProvider(state))
    batched, alone = _steps(model, together=True), _steps(model, together=False)
    assert batched[0].shape == (1 + 5 + 1 + 1 + 1, cfg.vocab_size)
    for step, (b, a) in enumerate(zip(batched, alone)):
        # the second step reads the caches the first wrote: a key or value appended to the wrong cache shows there
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5, err_msg=f"{family}: step {step}")


@pytest.mark.parametrize("family", ["mixtral-window", "deepseek_v3-mla", "qwen3_moe-qk_norm-window"])
def test_a_batch_that_mixes_two_sequences_rows_is_caught(family, monkeypatch):
    """The comparison above can fail: a step whose first two sequences' rows are off by one (the first sequence's
    last row attends in the second's place, with the second's cache) differs from each sequence alone."""
    case, changes = FAMILIES[family]
    cfg, state = make(case, **changes)
    model = Model(cfg, DictWeightProvider(state))
    alone = _steps(model, together=False)
    real = _forward._attend

    def off_by_one(attention, cfg, parts):
        if len(parts) > 1:
            (lo0, hi0, *first), (lo1, hi1, *second) = parts[:2]
            if hi0 - lo0 == 1 and hi1 - lo1 == 1:  # two decode rows: swapped
                parts = [(lo1, hi1, *first), (lo0, hi0, *second), *parts[2:]]
            else:  # a decode row, then a chunk: the chunk's bound one row early takes the row's
                parts = [(lo0, hi0, *first), (lo1 - 1, hi1 - 1, *second), *parts[2:]]
        return real(attention, cfg, parts)

    monkeypatch.setattr(_forward, "_attend", off_by_one)
    mixed = _steps(model, together=True)
    assert not all(np.allclose(b, a, rtol=2e-5, atol=2e-5) for b, a in zip(mixed, alone))
