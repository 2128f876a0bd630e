"""Choosing the next token from logits (greedy, or temperature + top-p with a seeded generator), what a request
asks of it (`SamplingParams`), and a position's score (`token_logprobs`: the model's own log-softmax).

The decode loop that uses it is the runtime's engine; a receipt's replay re-derives each draw (`sampling_slack`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardtool.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # None: the engine draws one (a receipt records the seed that was used)
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's eos ids


MAX_TOP_LOGPROBS = 20  # the most alternatives a position's score lists (OpenAI's cap)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's score: its token's log-probability under the model's own distribution (the log-softmax of
    the logits it was sampled or read from, before temperature and top-p), and the `top` most probable tokens
    with theirs, most probable first (lower id first on a tie)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """# [V], id, n -> the token's log-probability and the n best (float64 arithmetic; at most the vocabulary)."""
    shifted = logits.astype(np.float64)
    shifted -= shifted.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    best: tuple[tuple[int, float], ...] = ()
    n = min(top, len(logp))
    if n > 0:
        idx = np.argpartition(-logp, n - 1)[:n]
        idx = idx[np.lexsort((idx, -logp[idx]))]
        best = tuple((int(i), float(logp[i])) for i in idx)
    return TokenLogprobs(int(token), float(logp[token]), best)


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
    order, cdf = nucleus(logits, temperature, top_p)
    # One uniform draw per token, then the first cumulative probability above it: the draw is what a receipt's
    # replay re-derives from the seed (`sampling_slack`).
    u = rng.random()
    return int(order[min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)])


def nucleus(logits: np.ndarray, temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """# [V] -> token ids [m], cumulative probabilities [m] (float64, ending at 1): the top-p nucleus of the
    temperature-scaled distribution, most probable first."""
    if not np.isfinite(logits).all():
        raise UsageError("cannot sample from logits that are not all finite")
    order, probs = _sorted_probs(logits, temperature)
    # Nucleus: the smallest prefix whose mass reaches top_p (always at least the top token).
    keep = int(np.count_nonzero((np.cumsum(probs) - probs) < top_p))
    cdf = np.cumsum(probs[:keep] / probs[:keep].sum())
    cdf /= cdf[-1]
    return order[:keep], cdf


def _sorted_probs(logits: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    # Shift before dividing: (x - max) / t <= 0 for every temperature, so a tiny one cannot overflow to inf.
    shifted = logits.astype(np.float64)
    shifted -= shifted.max()
    with np.errstate(over="ignore", under="ignore"):  # a tiny temperature sends (x - max) / t to -inf: exp 0
        probs = np.exp(shifted / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    return order, probs[order]


def sampling_slack(logits: np.ndarray, temperature: float, top_p: float, u: float, token: int,
                   order_tie: float = 0.0) -> float:
    """How far (in probability mass) the draw `u` is from selecting `token` under these logits: 0 when
    `sample_token` with that draw gives `token`. A token just outside the nucleus adds how far the nucleus
    would have had to reach for it.

    `order_tie` (logit units, 0: none): a neighbour of `token` in the sorted order whose logit lies within it of
    `token`'s may have sorted on the other side of it in the run, whose logits differed from these by float
    rounding; the draw then selected `token` if it fell anywhere in the span the two cover together. (A swap of
    two near-equal tokens moves each one's interval by the other's whole probability, far beyond any rounding of
    the mass.) Only the two neighbours: on a long tail, where many tokens lie that close, no wider choice opens."""
    order, probs = _sorted_probs(logits, temperature)
    j = int(np.nonzero(order == token)[0][0])
    nucleus_size = int(np.count_nonzero((np.cumsum(probs) - probs) < top_p))
    first = last = j
    if order_tie > 0:
        values = np.asarray(logits, dtype=np.float64)
        if j > 0 and abs(values[order[j - 1]] - values[token]) <= order_tie:
            first = j - 1
        if j + 1 < nucleus_size and abs(values[order[j + 1]] - values[token]) <= order_tie:
            last = j + 1
    # A tie across the nucleus cut: sorted first in the run, the token was the nucleus' last and drawn on that
    # position's interval of this nucleus (not of one stretched to hold both, which would reach into the interval
    # of the token before them).
    across_cut = first < nucleus_size <= j
    if across_cut:
        last = first
    outside = 0.0 if across_cut or j < nucleus_size else max(0.0, float(np.sum(probs[:j])) - top_p)
    keep = max(nucleus_size, last + 1)
    cdf = np.cumsum(probs[:keep] / probs[:keep].sum())
    cdf /= cdf[-1]
    lo, hi = (float(cdf[first - 1]) if first else 0.0), float(cdf[last])
    return max(outside, lo - u, u - hi, 0.0)
