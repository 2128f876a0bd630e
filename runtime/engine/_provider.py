"""Weights for the forward pass, fetched from the verifying shard store by split-layout path
(docs/shard-layout.md). Prefetches the next layer's trunk while the current layer computes, and with lookahead
the experts the forward pass predicts for the next layer (`prefetch_experts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterator, Sequence

import numpy as np

from shardtool.errors import VerificationError
from shardtool.layout import EMBED, HEAD, expert_path, trunk_path
from shardtool.manifest import Entry, VerifiedManifest
from shardtool.runtime.store import ShardStore

class VerifiedWeights:
    """A `WeightProvider` whose every array comes from bytes verified against the signed manifest."""

    def __init__(self, store: ShardStore, manifest: VerifiedManifest, num_layers: int, *, window: int = 8,
                 lookahead: bool = False):
        """`window`: expert loads started ahead of the one being computed (the plan sizes it: top-k).

        `lookahead`: accept the forward pass's predicted experts (`prefetch_experts`). The shard cache must then hold
        two layers' working sets (trunk + `window` experts each): the layer computing and the one predicted. In a
        smaller cache the guesses would push out what the computing layer uses (thrashing), so lookahead stays off
        (`lookahead` is then False). Under the default policy (lru) the store evicts least recently used first and
        a prefetch touches what it finds cached, so in a cache that size the guesses for layer l+1 push out older
        layers' experts, never layer l's trunk or experts. Under lfu / lfu-da that ordering is not guaranteed: a
        guess can evict one of layer l's experts used fewer times (the forward pass still holds the arrays it was
        handed, so the result is the same; the expert is read again when next asked for). Each layer's prefetch is capped at half the shard cache, so a batch that
        predicts many experts cannot flush the cache with guesses."""
        self.store = store
        self.entries = manifest.by_path()
        self.num_layers = num_layers
        self.window = max(1, window)
        largest_expert = max((e.size for e in self.entries.values() if e.kind == "expert"), default=0)
        largest_trunk = max((e.size for e in self.entries.values() if e.kind == "trunk"), default=0)
        working_set = largest_trunk + self.window * largest_expert
        self.lookahead = bool(lookahead) and largest_expert > 0 and store.budget >= 2 * working_set
        self._prefetch_cap = (store.budget // 2 - largest_trunk) // largest_expert if largest_expert else 0
        # Per decoder layer, looked up once: its trunk entry (None: not listed) and the shard read after it (the next
        # layer's trunk, or the head after the last); and (layer, expert) -> entry, filled as experts are asked for.
        self._trunk = [self.entries.get(trunk_path(layer)) for layer in range(num_layers)]
        self._after = self._trunk[1:] + [self.entries.get(HEAD)]
        self._experts: dict[tuple[int, int], Entry | None] = {}

    def expert_entry(self, layer: int, expert: int) -> Entry | None:
        """The manifest's entry for an expert's shard, None when it lists none."""
        key = (layer, expert)
        try:
            return self._experts[key]
        except KeyError:
            entry = self._experts[key] = self.entries.get(expert_path(layer, expert))
            return entry

    def _entry(self, path: str) -> Entry:
        entry = self.entries.get(path)
        if entry is None:
            raise _unlisted_error(path)
        return entry

    def embed(self) -> Mapping[str, np.ndarray]:
        return self.store.get(self._entry(EMBED))

    def head(self) -> Mapping[str, np.ndarray]:
        return self.store.get(self._entry(HEAD))

    def layer(self, layer: int) -> Mapping[str, np.ndarray]:
        if 0 <= layer < self.num_layers:
            entry, following = self._trunk[layer], self._after[layer]
        else:  # not one of the model's layers: looked up as asked
            entry = self.entries.get(trunk_path(layer))
            following = self.entries.get(trunk_path(layer + 1) if layer + 1 < self.num_layers else HEAD)
        arrays = self.store.get(entry if entry is not None else self._entry(trunk_path(layer)))
        if following is not None:
            self.store.prefetch([following])
        return arrays

    def prefetch_experts(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Start reading and verifying experts predicted for `layer`, most wanted first, through the same verifying
        store (their bytes are checked before any use, as every shard's). Not listed ones are skipped here: the
        layer reports them if it really routes to them."""
        if not self.lookahead:
            return
        listed = [self.expert_entry(layer, e) for e in expert_ids[:self._prefetch_cap]]
        self.store.prefetch([entry for entry in listed if entry is not None])

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Mapping[str, np.ndarray]]:
        """The selected experts as they are verified, `window` loads ahead of the one being computed.

        A batch may select many more experts per layer than one sequence's top-k; loading at most `window`
        ahead keeps what is held in memory at once to the single-sequence figure the budget plans for. An
        expert whose shard is missing or fails verification raises when it is reached, not before, so the
        caller knows which rows needed it. When every one is cached and there are at most `window` (a warm decode
        step), they are handed out at once: what the stream would hold, waiters for them all, with less Python."""
        ids = list(expert_ids)
        entries = [self.expert_entry(layer, e) for e in ids]
        if len(ids) <= self.window and None not in entries:
            hits = self.store.cached(entries)  # type: ignore[arg-type]
            if hits is not None:
                return dict(zip(ids, hits))
        return _ExpertStream(self, layer, ids)


class _ExpertStream(Mapping):
    """expert id -> verified arrays, read in the order the ids were given; each expert's load starts once
    the ones `window` places before it are reached, and is dropped from here once handed over."""

    def __init__(self, weights: VerifiedWeights, layer: int, ids: list[int]):
        self._weights, self._layer, self._ids = weights, layer, ids
        self._position = {e: i for i, e in enumerate(ids)}
        self._waiters: dict[int, Callable[[], Mapping[str, np.ndarray]]] = {}
        self._started = 0  # ids[:_started] have had their loads started

    def _start_until(self, stop: int) -> None:
        stop = min(stop, len(self._ids))
        if stop <= self._started:
            return
        batch = self._ids[self._started:stop]
        self._started = stop
        layer, entry_of = self._layer, self._weights.expert_entry
        entries = [entry_of(layer, e) for e in batch]
        listed = [(e, entry) for e, entry in zip(batch, entries) if entry is not None]
        for (e, _), wait in zip(listed, self._weights.store.request([entry for _, entry in listed])):
            self._waiters[e] = wait
        for e, entry in zip(batch, entries):
            if entry is None:
                self._waiters[e] = _unlisted(expert_path(layer, e))

    def __getitem__(self, expert: int) -> Mapping[str, np.ndarray]:
        i = self._position[expert]
        self._start_until(i + self._weights.window)
        wait = self._waiters.pop(expert, None)
        if wait is None:  # asked for again after it was handed over: a cache hit or a new verified read
            entry = self._weights.expert_entry(self._layer, expert)
            return self._weights.store.get(entry if entry is not None else self._weights._entry(
                expert_path(self._layer, expert)))
        return wait()

    def __contains__(self, expert: object) -> bool:  # Mapping's default would load the expert to answer
        return expert in self._position

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def _unlisted_error(path: str) -> VerificationError:
    return VerificationError(f"the signed manifest lists no {path}; the model needs it")


def _unlisted(path: str) -> Callable[[], Mapping[str, np.ndarray]]:
    def wait() -> Mapping[str, np.ndarray]:
        raise _unlisted_error(path)
    return wait
