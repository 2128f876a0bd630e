"""Pipeline spans: each node of a pipeline plan runs a contiguous span of decoder layers (their trunk and experts) on
the hidden states a coordinator sends, and keeps every sequence's keys and values for those layers between steps.
A token then makes one round per node instead of one per MoE layer.

Node side, `SpanRunner`: checks a span call (`SpanRunner.check`, every field capped before use), then runs its layers
with the same functions a single process runs (`step_attends`, `run_layers`): the same float32 bits. Each sequence
is keyed by (the caller's session id, its number), so one coordinator never reaches another's keys. A call says
where each sequence's rows start; keys past that position (a step that failed after this node ran it) are
forgotten first, and a sequence this node has no keys for up to that position (it restarted, or evicted it: at
most `max_sequences` are kept, least recently used first) fails, with its rows named, not the node.

Coordinator side, `PipelineLayers`: the forward pass's `Layers` (`forward_batch(layers=...)`): the embedding, the
head and every commit stay with the coordinator; each span's node is called in layer order through
`RemoteExperts.span`, which authenticates and checks the answer.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence

import blake3
import numpy as np

from shardtool.errors import UnavailableError, UsageError
from shardtool.runtime.model import (ExpertUnavailable, KVCache, ModelConfig, PackedWeights, Segment, WeightProvider,
                                     bytes_per_token, inv_freq, run_layers, step_attends, step_bytes)

from ._plan import MIN_ACTIVATION_RESERVE

MAX_SEGMENTS = 1 << 12  # sequences in one step: far above any --max-batch
MAX_DROP = 1 << 12  # sequences forgotten in one call; also the most a coordinator keeps to forget at one node
MAX_SEQUENCE = (1 << 63) - 1
DEFAULT_MAX_SEQUENCES = 16
DEFAULT_MAX_CONTEXT = 4096


def span_input_digest(span: Sequence[int], x: np.ndarray, segments: Sequence[Sequence[int]],
                      drop: Sequence[int], routes: bool) -> str:
    """BLAKE3 of what a span call computed on: the span, the hidden states [n, H] (shape, float32 bytes), each
    segment's (sequence, start, rows), the sequences dropped and whether routes were asked. The node's
    authenticated answer names it."""
    h = blake3.blake3(np.asarray([*span, *x.shape, len(segments), len(drop), int(bool(routes))], "<i8").tobytes())
    h.update(np.ascontiguousarray(x, dtype="<f4").tobytes())
    h.update(np.asarray(segments, dtype="<i8").reshape(-1).tobytes())
    h.update(np.asarray(drop, dtype="<i8").reshape(-1).tobytes())
    return h.hexdigest()


def span_kv_bytes(cfg: ModelConfig, layers: Sequence[int], max_sequences: int, max_context: int) -> int:
    """The most bytes of keys and values a node running `layers` keeps: `max_sequences` of `max_context` tokens."""
    return bytes_per_token(cfg) * len(layers) // max(cfg.num_layers, 1) * max_sequences * max_context


def span_activations(cfg: ModelConfig, max_sequences: int, max_context: int) -> int:
    """The bytes a span node keeps for one call's temporaries: a step of all its sequences over the longest context
    (what one process reserves for a decode step of its batch, `plan_budget`), at least MIN_ACTIVATION_RESERVE. A
    coordinator whose --max-batch and --max-context are at most the node's never sends a call needing more
    (`RemoteExperts.check_span_room`); the node refuses one that does before it computes anything."""
    return max(MIN_ACTIVATION_RESERVE, step_bytes(cfg, max_sequences, max_context))


def _int(v, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise UsageError(f"{what} must be an integer in [{lo}, {hi}], got {str(v)[:40]}")
    return v


class SpanRunner:
    """A pipeline node's layers and the keys and values of the sequences it has seen (thread-safe: one call at a
    time)."""

    def __init__(self, cfg: ModelConfig, provider: WeightProvider, layers: Sequence[int], *,
                 max_sequences: int = DEFAULT_MAX_SEQUENCES, max_context: int = DEFAULT_MAX_CONTEXT):
        if not layers or list(layers) != list(range(layers[0], layers[-1] + 1)):
            raise UsageError(f"a node's span must be contiguous layers, got {list(layers)[:8]}")
        self.cfg, self.layers = cfg, tuple(layers)
        self.span = (self.layers[0], self.layers[-1] + 1)
        self.max_sequences, self.max_context = max_sequences, max_context
        self.activations = span_activations(cfg, max_sequences, max_context)
        self.weights = PackedWeights(cfg, provider)
        self.rope = inv_freq(cfg.rope)
        self._caches: OrderedDict[tuple[str, int], KVCache] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def check(self, span, x: np.ndarray, segments, drop, routes) -> tuple[list[tuple[int, int, int]], list[int]]:
        """A span call's values (their wire form checked by `decode_any_call`): the span must be this node's,
        x [n, H] with n the segments' rows, each segment [sequence, start, rows] once, within the context, at most
        max_sequences of them, and a step whose temporaries fit this node's activation reserve."""
        if not isinstance(span, list) or span != list(self.span):
            raise UsageError(f"the call is for layers {str(span)[:40]}, this node runs layers "
                             f"{self.span[0]}..{self.span[1] - 1}")
        if x.shape[1] != self.cfg.hidden_size or not 1 <= x.shape[0] <= MAX_SEGMENTS * self.max_context:
            raise UsageError(f"hidden states have shape {x.shape}, expected [rows, {self.cfg.hidden_size}]")
        most = min(MAX_SEGMENTS, self.max_sequences)  # more would evict this very call's sequences
        if not isinstance(segments, list) or not 1 <= len(segments) <= most:
            raise UsageError(f"segments must be a list of 1 to {most} [sequence, start, rows] (this node's "
                             f"--max-sequences is {self.max_sequences}), got "
                             f"{len(segments) if isinstance(segments, list) else 'a ' + type(segments).__name__}")
        checked, seen = [], set()
        for seg in segments:
            if not isinstance(seg, list) or len(seg) != 3:
                raise UsageError("each segment must be [sequence, start, rows]")
            q = _int(seg[0], 0, MAX_SEQUENCE, "a segment's sequence")
            t = _int(seg[2], 1, self.max_context, "a segment's rows")
            start = _int(seg[1], 0, self.max_context - t, f"sequence {q}'s start (this node's --max-context is "
                                                          f"{self.max_context})")
            if q in seen:
                raise UsageError(f"sequence {q} is in the call twice")
            seen.add(q)
            checked.append((q, start, t))
        if sum(t for _, _, t in checked) != x.shape[0]:
            raise UsageError(f"the segments have {sum(t for _, _, t in checked)} rows, the hidden states {x.shape[0]}")
        keys = max(start + t for _, start, t in checked)
        need = step_bytes(self.cfg, x.shape[0], keys)  # attention scores alone are [heads, t, keys] per segment
        if need > self.activations:
            raise UsageError(f"a step of {x.shape[0]} rows over {keys} keys needs {need} bytes of temporaries, this "
                             f"node keeps {self.activations} (for --max-sequences {self.max_sequences} over "
                             f"--max-context {self.max_context}): send fewer rows per call")
        if not isinstance(drop, list) or len(drop) > MAX_DROP:
            raise UsageError(f"drop must be a list of at most {MAX_DROP} sequences")
        dropped = [_int(q, 0, MAX_SEQUENCE, "a dropped sequence") for q in drop]
        if type(routes) is not bool:
            raise UsageError("routes must be true or false")
        return checked, dropped

    def run(self, session: str, x: np.ndarray, segments: list[tuple[int, int, int]], drop: list[int],
            routes: bool) -> tuple[np.ndarray | None, list[np.ndarray], dict]:
        """# x [n, H] through this node's layers -> (x' [n, H] or None, per MoE layer the chosen experts [n, k] when
        `routes`, a failure: {} or {"why": one line, "rows": [row, ...]}). A sequence with no keys up to its start
        fails (its rows) and nothing runs; keys commit only when every layer ran."""
        with self._lock:
            for q in drop:
                self._caches.pop((session, q), None)
            bounds = [0, *itertools.accumulate(t for _, _, t in segments)]  # segment i: rows bounds[i]:bounds[i+1]
            lost = [(q, lo, t) for (q, start, t), lo in zip(segments, bounds)
                    if start and self._length(session, q) < start]
            if lost:
                return None, [], {"why": f"this node has no keys for sequence {lost[0][0]} up to its position "
                                         f"(it restarted or evicted them; it keeps {self.max_sequences})",
                                  "rows": [r for _, lo, t in lost for r in range(lo, lo + t)]}
            for q, _, _ in segments:  # this call's sequences first in line to stay: a new one evicts another's
                if (session, q) in self._caches:
                    self._caches.move_to_end((session, q))
            segs = [Segment(np.zeros(t, np.int64), self._cache(session, q, start), "none") for q, start, t in segments]
            chosen: list[np.ndarray] = []
            observe = (lambda idx, scores: chosen.append(np.sort(idx, axis=1))) if routes else None
            try:
                y = run_layers(self.cfg, self.weights, x, step_attends(self.cfg, self.rope, segs, bounds),
                               self.layers, observe)
            except ExpertUnavailable as e:
                return None, [], {"why": e.cause.one_line(), "rows": [int(r) for r in e.rows]}
            for seg in segs:
                seg.cache.commit(len(seg.ids))
            return y, chosen, {}

    def _length(self, session: str, q: int) -> int:
        cache = self._caches.get((session, q))
        return 0 if cache is None else cache.length

    def _cache(self, session: str, q: int, start: int) -> KVCache:
        """Sequence q's cache, its keys past `start` forgotten; a new one (evicting the least recently used beyond
        max_sequences) when start is 0 and there is none."""
        key = (session, q)
        cache = self._caches.get(key)
        if cache is None:
            if start:  # (`run` checked every sequence's keys first, and none of its own is evicted here)
                raise RuntimeError(f"sequence {q}'s keys went missing during the call")
            cache = self._caches[key] = KVCache(self.cfg, max_tokens=self.max_context)
            while len(self._caches) > self.max_sequences:
                self._caches.popitem(last=False)
        self._caches.move_to_end(key)
        cache.length = start  # (never above what it holds: `run` checked it)
        return cache


class PipelineLayers:
    """The forward pass's `Layers` for a pipeline plan's coordinator: the step's rows through each span's node in
    layer order. Each KV cache the coordinator steps is a sequence number here; once a cache is gone its number is
    dropped at every node with the next call."""

    def __init__(self, remote, spans: Sequence[tuple[str, tuple[int, ...]]]):
        self.remote, self.spans = remote, tuple(spans)
        self._numbers: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count()
        # Per node, the numbers of caches gone, dropped there with its next call. Bounded: a node that is lost, or
        # comes after one, is not called, and the newest MAX_DROP are kept (a node keeps at most 4,096 sequences,
        # `shardtool node --max-sequences`); a number never dropped only holds a slot until the node's least
        # recently used order evicts it, since numbers are never reused. Appended without a lock: a cache's
        # finaliser may run in a garbage collection that an allocation inside `self._lock` set off, on this thread.
        self._gone: dict[str, deque[int]] = {node: deque(maxlen=MAX_DROP) for node, _ in self.spans}
        self._lock = threading.Lock()

    def _number(self, cache: KVCache) -> int:
        with self._lock:
            q = self._numbers.get(cache)
            if q is None:
                q = self._numbers[cache] = next(self._next)
                weakref.finalize(cache, self._forget, q)
            return q

    def _forget(self, q: int) -> None:
        for gone in self._gone.values():  # (deque.append is atomic; `_drops` alone takes from the left)
            gone.append(q)

    def _drops(self, node: str) -> list[int]:
        with self._lock:
            gone = self._gone[node]
            return [gone.popleft() for _ in range(len(gone))]

    def __call__(self, x: np.ndarray, segments: Sequence[Segment], bounds: Sequence[int], observe) -> np.ndarray:
        if any(seg.trace is not None and seg.trace.alternatives for seg in segments):
            raise UsageError("a receipt's replay runs every layer in one process; a pipeline cluster runs them on "
                             "its nodes")
        seqs = [(self._number(seg.cache), seg.cache.length, len(seg.ids)) for seg in segments]
        for node, layers in self.spans:
            x, chosen = self.remote.span(node, (layers[0], layers[-1] + 1), x, seqs, self._drops(node),
                                         observe is not None)
            for idx in chosen:  # [n, k] per MoE layer of the span, in order
                observe(idx, idx)  # (a trace without alternatives reads no scores: this step's replay is refused)
        return x


def span_failure(node: str, span: tuple[int, int], failed: dict, rows: int) -> ExpertUnavailable:
    """A node's authenticated failure of some rows of a span call, as the forward pass's `ExpertUnavailable` (the
    engine fails only the sequences those rows belong to)."""
    why, failed_rows = failed.get("why"), failed.get("rows")
    if (not isinstance(why, str) or not isinstance(failed_rows, list) or not failed_rows
            or not all(type(r) is int and 0 <= r < rows for r in failed_rows)):
        raise ValueError("a span failure that is not a line and the rows it concerns")
    cause = UnavailableError(f"node {node} could not run layers {span[0]}..{span[1] - 1} for these rows: "
                             f"{why[:300]}")
    return ExpertUnavailable(cause, np.asarray(sorted(set(failed_rows)), dtype=np.int64))
