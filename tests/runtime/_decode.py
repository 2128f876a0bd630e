"""Test support: a plain decode loop over an in-memory `Model` (no shard store, no timing), for comparing the
numpy forward pass with the reference. The runtime's own loop is `Session.generate` (runtime/engine/_session.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from shardtool.errors import UsageError
from shardtool.runtime.engine._sampling import check_sampling, sample_token
from shardtool.runtime.model import Model


def stream(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
           top_p: float = 1.0, seed: int | None = None, stop_ids: Sequence[int] | None = None) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids; stops after a stop id (default: the config's eos ids)."""
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_sampling(temperature, top_p)
    stops = set(model.config.eos_token_ids if stop_ids is None else stop_ids)
    rng = np.random.default_rng(seed)
    if max_new_tokens == 0:
        return
    logits = model.prefill(prompt_ids, last_only=True)[0]
    for i in range(max_new_tokens):
        token = sample_token(logits, temperature=temperature, top_p=top_p, rng=rng)
        yield token
        if token in stops or i == max_new_tokens - 1:
            return
        logits = model.decode(token)


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, stop_ids: Sequence[int] | None = None) -> list[int]:
    """The new token ids (not the prompt), as a list; see `stream`."""
    return list(stream(model, prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                       stop_ids=stop_ids))
