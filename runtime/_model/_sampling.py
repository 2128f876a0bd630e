"""Choosing the next token from logits (greedy, or temperature + top-p with a seeded generator).

The decode loop that uses it is the runtime's `Session.generate`."""

from __future__ import annotations

import numpy as np

from shardtool.errors import UsageError


def check_sampling(temperature: float, top_p: float) -> None:
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise UsageError(f"temperature must be a finite number >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise UsageError(f"top_p must be in (0, 1], got {top_p}")


def sample_token(logits: np.ndarray, *, temperature: float = 0.0, top_p: float = 1.0,
                 rng: np.random.Generator | None = None) -> int:
    """# [V] -> token id. temperature 0 is greedy (first maximum, as torch.argmax)."""
    check_sampling(temperature, top_p)
    if temperature == 0:
        return int(np.argmax(logits))
    if rng is None:
        raise UsageError("sampling with temperature > 0 needs a random generator (pass a seed)")
    if not np.isfinite(logits).all():
        raise UsageError("cannot sample from logits that are not all finite")
    # Shift before dividing: (x - max) / t <= 0 for every temperature, so a tiny one cannot overflow to inf.
    shifted = logits.astype(np.float64)
    shifted -= shifted.max()
    with np.errstate(over="ignore", under="ignore"):  # a tiny temperature sends (x - max) / t to -inf: exp 0
        probs = np.exp(shifted / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    # Nucleus: the smallest prefix whose mass reaches top_p (always at least the top token).
    keep = (np.cumsum(sorted_probs) - sorted_probs) < top_p
    kept = sorted_probs[keep]
    return int(order[rng.choice(len(kept), p=kept / kept.sum())])
