"""Weights for the forward pass, fetched from the verifying shard store by split-layout path
(docs/shard-layout.md). Prefetches the next layer's trunk while the current layer computes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterator, Sequence

import numpy as np

from shardtool.errors import VerificationError
from shardtool.layout import EMBED, HEAD, expert_path, trunk_path
from shardtool.manifest import Entry, VerifiedManifest
from shardtool.runtime._store import ShardStore

class VerifiedWeights:
    """A `WeightProvider` whose every array comes from bytes verified against the signed manifest."""

    cache_float32 = False  # float32 copies of the trunk would sit outside the store's budget

    def __init__(self, store: ShardStore, manifest: VerifiedManifest, num_layers: int):
        self.store = store
        self.entries = manifest.by_path()
        self.num_layers = num_layers

    def _entry(self, path: str) -> Entry:
        entry = self.entries.get(path)
        if entry is None:
            raise VerificationError(f"the signed manifest lists no {path}; the model needs it")
        return entry

    def embed(self) -> Mapping[str, np.ndarray]:
        return self.store.get(self._entry(EMBED))

    def head(self) -> Mapping[str, np.ndarray]:
        return self.store.get(self._entry(HEAD))

    def layer(self, layer: int) -> Mapping[str, np.ndarray]:
        arrays = self.store.get(self._entry(trunk_path(layer)))
        following = self.entries.get(trunk_path(layer + 1)) if layer + 1 < self.num_layers else self.entries.get(HEAD)
        if following is not None:
            self.store.prefetch([following])
        return arrays

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Mapping[int, Mapping[str, np.ndarray]]:
        """Starts every selected expert's load at once; indexing waits for that expert only."""
        ids = list(expert_ids)
        waiters = self.store.request([self._entry(expert_path(layer, e)) for e in ids])
        return _PendingExperts(dict(zip(ids, waiters)))


class _PendingExperts(Mapping):
    """expert id -> verified arrays, each available as soon as its own shard is verified."""

    def __init__(self, waiters: dict[int, Callable[[], Mapping[str, np.ndarray]]]):
        self._waiters = waiters

    def __getitem__(self, expert: int) -> Mapping[str, np.ndarray]:
        return self._waiters[expert]()

    def __iter__(self) -> Iterator[int]:
        return iter(self._waiters)

    def __len__(self) -> int:
        return len(self._waiters)
