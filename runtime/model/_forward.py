"""The forward pass over a `WeightProvider` (`forward_batch`), and `Model`: prefill a prompt, then decode one token
at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from itertools import accumulate, chain

import numpy as np

from shardtool.errors import UsageError

from . import _decode_row
from ._activations import prefill_chunk
from ._cache import KVCache
from ._config import ModelConfig
from ._llama4 import chunked_mask
from ._layers import (GQA, MLA, Attend, AttentionParts, ExpertUnavailable, ObserveRoute, causal_mask, decoder_layer,
                      rms_norm)
from ._packed import matmul_t
from ._rope import cos_sin, inv_freq
from ._segment import Segment
from ._view import PackedWeights
from ._weights import WeightProvider


# What runs a step's decoder layers when they are not all this process's (a pipeline cluster's nodes run spans of
# them): (hidden states [sum t, H] after the embedding, the step's segments, their row bounds, observe or None)
# -> the hidden states after the last layer [sum t, H].
Layers = Callable[[np.ndarray, Sequence[Segment], Sequence[int], ObserveRoute | None], np.ndarray]


def forward_batch(cfg: ModelConfig, weights: PackedWeights, rope: tuple[np.ndarray, float],
                  segments: Sequence[Segment], layers: Layers | None = None) -> np.ndarray | None:
    """# segments of t_i token ids -> logits [n, V] for the rows the segments ask for, in segment order
    (None when none asks).

    The rows of every segment go through each layer together: the attention's products run on all rows at once,
    its scores each segment against its own cache and positions; the MLP and the experts run on all rows at once,
    so an expert chosen by several sequences is fetched once per step. Each segment's keys and values are appended
    to its cache, and every cache commits only after the last layer and the head succeeded: a step that fails
    leaves all as they were. `layers`, when given, runs the decoder layers instead of this process (`Layers`): the
    embedding, the head, the traces and the commits stay here.
    """
    if layers is None and _decode_row.applies(cfg, segments):  # one decode row: the same result, less Python
        return _decode_row.step(cfg, weights, rope, segments[0])
    for seg in segments:
        seg.cache.check_room(len(seg.ids))
    bounds = list(accumulate([len(seg.ids) for seg in segments], initial=0))  # segment i: rows bounds[i]:bounds[i+1]
    traced = [(seg.trace, lo, hi) for seg, lo, hi in zip(segments, bounds, bounds[1:]) if seg.trace is not None]
    observe = None
    if traced:
        def observe(idx: np.ndarray, scores: np.ndarray) -> None:  # [sum t, k], [sum t, E]
            for trace, lo, hi in traced:
                trace.observe(idx[lo:hi], scores[lo:hi])
    ids = segments[0].ids if len(segments) == 1 else np.concatenate([seg.ids for seg in segments])
    x = weights.embed_rows(ids)  # [sum t, H]
    if layers is not None:
        x = layers(x, segments, bounds, observe)
    else:
        x = run_layers(cfg, weights, x, step_attends(cfg, rope, segments, bounds), range(cfg.num_layers), observe)
    if traced:
        norm, _ = weights.head()
        for trace, lo, hi in traced:
            trace.hidden = rms_norm(x[lo:hi], norm, cfg.rms_norm_eps)
    rows = list(chain.from_iterable(
        range(lo, hi) if seg.logits == "all" else [hi - 1] if seg.logits == "last" else []
        for seg, lo, hi in zip(segments, bounds, bounds[1:])))
    logits = None
    if rows:
        norm, lm_head = weights.head()
        picked = x if len(rows) == len(x) else x[rows]
        logits = matmul_t(rms_norm(picked, norm, cfg.rms_norm_eps), lm_head)
    for seg in segments:
        seg.cache.commit(len(seg.ids))
    return logits


def run_layers(cfg: ModelConfig, weights: PackedWeights, x: np.ndarray, attends: Sequence[Attend],
               layers: Iterable[int], observe: ObserveRoute | None = None) -> np.ndarray:
    """# [sum t, H] -> [sum t, H] through `layers` in order (ascending), each with its `Attend` (`step_attends`):
    the decoder layers of a step, all of them (`forward_batch`) or a pipeline node's span of them."""
    for layer in layers:
        x = decoder_layer(x, weights.layer(layer), cfg, layer, attends[layer], weights.expert_fetch(layer),
                          weights.observer(layer, observe))
        weights.lookahead(layer + 1, x)  # layer + 1's experts start loading while its attention computes
    return x


def step_attends(cfg: ModelConfig, rope: tuple[np.ndarray, float], segments: Sequence[Segment],
                 bounds: Sequence[int]) -> list[Attend]:
    """Per layer, the step's `Attend`: each segment's rows against its own cache, at its own positions, under the
    layer's mask (sliding window, attention chunk), appending the segment's keys and values for that layer. The
    positions' cos/sin and each kind of mask are built once per segment for the whole step."""
    chunks = cfg.attention_chunks or (None,) * cfg.num_layers
    spans = list(zip(cfg.sliding_windows, chunks))  # (sliding window, attention chunk) per layer
    kinds = set(spans)
    rotary = cfg.rope_layers or (True,) * cfg.num_layers  # False: a NoPE layer, given no cos/sin
    where = []  # per segment: cos [t, d], sin [t, d], {span: mask [t, S] or None}
    for seg in segments:
        q_pos = seg.cache.length + np.arange(len(seg.ids))
        cos, sin = cos_sin(rope[0], rope[1], q_pos)
        kv_len = seg.cache.length + len(seg.ids)
        where.append((cos, sin, {(w, c): causal_mask(q_pos, kv_len, w) if c is None else chunked_mask(q_pos, kv_len, c)
                                 for w, c in kinds}))
    attention = MLA if cfg.mla is not None else GQA
    attends = []
    for layer, (span, rotated) in enumerate(zip(spans, rotary)):
        # per segment: its rows, and attention's arguments after (x, w, cfg): cos, sin, mask, append_kv
        parts = [(lo, hi, (cos, sin) if rotated else (None, None), masks[span], partial(seg.cache.append, layer))
                 for seg, (cos, sin, masks), lo, hi in zip(segments, where, bounds, bounds[1:])]
        attends.append(_attend(attention, cfg, parts))
    return attends


def _attend(attention: AttentionParts, cfg: ModelConfig, parts: list[tuple]) -> Attend:
    """One layer's `Attend` over the segments' (rows lo:hi, attention's arguments after x, w and cfg): the
    attention's row-wise parts (projections, output product) once on all the step's rows, its `attend` on each
    segment's rows against that segment's cache."""
    if len(parts) == 1:  # one sequence: all the rows, no slicing and no concatenation
        (_, _, (cos, sin), mask, append_kv), = parts
        return lambda xn, w: attention(xn, w, cfg, cos, sin, mask, append_kv)

    def attend(xn: np.ndarray, w: Mapping[str, np.ndarray]) -> np.ndarray:  # [sum t, H] -> [sum t, H]
        rows, extra = attention.project(xn, w, cfg)  # each [sum t, ...]
        out = np.concatenate([attention.attend(*(a[lo:hi] for a in rows), w, cfg, cos, sin, mask, append_kv)
                              for lo, hi, (cos, sin), mask, append_kv in parts])  # [sum t, ...]
        return attention.output(out, w, cfg, extra)
    return attend


def forward(cfg: ModelConfig, weights: PackedWeights, rope: tuple[np.ndarray, float], ids: np.ndarray,
            cache: KVCache, *, last_only: bool = False, logits: bool = True) -> np.ndarray | None:
    """# [T] token ids -> logits [T, V] ([1, V] with last_only; None without `logits`), appending T positions
    to `cache`: one sequence's step (`forward_batch` with one segment)."""
    want = "none" if not logits else "last" if last_only else "all"
    try:
        return forward_batch(cfg, weights, rope, [Segment(ids, cache, want)])
    except ExpertUnavailable as e:  # one sequence: it needed the expert, so the error is simply its own
        raise e.cause from None


class Model:
    """A decoder over a `WeightProvider`, with its own KV cache.

    `prefill(ids)` starts a new sequence; `decode(id)` extends it by one token. Both return float32 logits.
    """

    def __init__(self, config: ModelConfig, provider: WeightProvider, *, max_tokens: int | None = None,
                 activation_reserve: int | None = None):
        """`activation_reserve`: bytes a forward step's temporaries may take; prefill then runs in chunks
        that fit (`prefill_chunk`). None: the whole prompt in one step."""
        if not isinstance(provider, WeightProvider):
            raise UsageError(f"provider {type(provider).__name__} does not implement WeightProvider")
        self.config = config
        self.provider = provider
        self.activation_reserve = activation_reserve
        self.cache = KVCache(config, max_tokens=max_tokens)
        self._weights = PackedWeights(config, provider)
        self._rope = inv_freq(config.rope)

    def prefill(self, ids: Sequence[int], *, last_only: bool = False, chunk: int | None = None) -> np.ndarray:
        """# [T] -> logits [T, V] ([1, V] with last_only); resets the cache first.

        `chunk`: at most this many tokens per forward step (default: as many as fit the activation reserve,
        `prefill_chunk`), so attention scores are [heads, chunk, T] rather than [heads, T, T]. Each chunk
        attends to the cached keys of the ones before it: the same sums as one step, up to float32 rounding
        in the matmuls.
        """
        tokens = self._check_ids(ids)
        if chunk is None and self.activation_reserve is not None:
            chunk = prefill_chunk(self.config, self.activation_reserve, len(tokens))
        if chunk is not None and chunk < 1:
            raise UsageError(f"prefill chunk must be >= 1 token, got {chunk}")
        self.cache.reset()
        step = len(tokens) if chunk is None else chunk
        outs = []
        for start in range(0, len(tokens), step):
            last = start + step >= len(tokens)
            # Only the final chunk's last row matters with last_only: the others skip the lm_head.
            logits = forward(self.config, self._weights, self._rope, tokens[start:start + step], self.cache,
                             last_only=last_only, logits=last or not last_only)
            if logits is not None:
                outs.append(logits)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def decode(self, token_id: int) -> np.ndarray:
        """# id -> logits [V] for the next position, after everything prefilled or decoded so far."""
        if self.cache.length == 0:
            raise UsageError("decode() needs a prefilled prompt; call prefill() first")
        tokens = self._check_ids([token_id])
        return forward(self.config, self._weights, self._rope, tokens, self.cache, last_only=True)[0]

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        tokens = np.asarray(ids)
        if tokens.ndim != 1 or len(tokens) == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise UsageError(f"token ids must be a non-empty 1-D sequence of integers, got an array of "
                             f"shape {tokens.shape} and dtype {tokens.dtype}")
        bad = tokens[(tokens < 0) | (tokens >= self.config.vocab_size)]
        if len(bad):
            raise UsageError(f"token id {int(bad[0])} is outside the vocabulary of {self.config.vocab_size}")
        return tokens.astype(np.int64)
