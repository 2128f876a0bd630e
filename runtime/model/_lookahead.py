"""The lookahead: a layer's experts guessed from a hidden state that has not reached it, the guesses handed to a
`Prefetcher`, and the accounting of how well they matched the experts the layer then chose."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._config import ModelConfig
from ._layers import ROUTER_TENSORS, ObserveRoute, predict_experts
from ._prepare import prepare_layer
from ._weights import Prefetcher, WeightProvider, derived


@dataclass
class LookaheadStats:
    """Recall = |predicted ∩ actual| / |actual| per layer and token, summed over both before dividing."""

    predictions: int = 0  # MoE layer-token rows that had a prediction
    actual: int = 0  # experts those rows chose (rows x top-k)
    matched: int = 0  # of those, how many had been predicted for the same row

    def add(self, predicted: np.ndarray, actual: np.ndarray) -> None:
        """# predicted [T, k'] ids, actual [T, k] ids of the same rows -> counts updated"""
        if predicted.shape[0] != actual.shape[0]:
            raise ValueError(f"predicted {predicted.shape[0]} rows, the layer routed {actual.shape[0]}")
        if actual.size == 0:
            return
        hit = (actual[:, :, None] == predicted[:, None, :]).any(axis=2)  # [T, k]: this chosen expert was predicted
        self.predictions += actual.shape[0]
        self.actual += actual.size
        self.matched += int(hit.sum())

    @property
    def recall(self) -> float | None:
        return self.matched / self.actual if self.actual else None

    def as_dict(self) -> dict:
        return {"rows": self.predictions, "actual": self.actual, "matched": self.matched, "recall": self.recall}


class Lookahead:
    """The guesses of one model's forward steps: `guess(l, x)` applies layer l's router to a hidden state [T, H]
    on its way to layer l and hands the predicted experts to the prefetcher, which starts reading and verifying them
    while the layers before l still compute; `observer(l, observe)` scores the guess against the layer's own routing
    (`stats`). `prefetcher` None: no guesses (a provider that takes none, or a cluster's nodes compute the experts)."""

    def __init__(self, cfg: ModelConfig, provider: WeightProvider, prefetcher: Prefetcher | None):
        self.cfg = cfg
        self.provider = provider
        self.prefetcher = prefetcher
        self.stats = LookaheadStats()
        self._predicted: dict[int, np.ndarray] = {}  # layer -> [T, k] ids predicted for this step's rows

    @property
    def on(self) -> bool:
        return self.prefetcher is not None and bool(self.prefetcher.lookahead)

    def guess(self, layer: int, hidden: np.ndarray) -> None:
        """# layer l, a hidden state [T, H] on its way to layer l -> its experts predicted and their loads started.
        Nothing for a dense layer, past the last layer, or without a provider that prefetches."""
        self._predicted.pop(layer, None)
        if layer >= self.cfg.num_layers or not self.cfg.moe_layers[layer] or not self.on:
            return
        router = derived(self.provider.layer(layer), "router", self.cfg,
                         lambda t: prepare_layer(self.cfg, layer, t, only=ROUTER_TENSORS))
        predicted = predict_experts(hidden, router, self.cfg)  # [T, k]
        self._predicted[layer] = predicted
        if len(predicted) == 1:  # a decode row: its k ids (distinct: every router's top-k), np.unique's order
            self.prefetcher.prefetch_experts(layer, sorted(predicted[0].tolist()))
            return
        ids, rows = np.unique(predicted, return_counts=True)  # most rows first, ties by id
        self.prefetcher.prefetch_experts(layer, [int(e) for e in ids[np.argsort(-rows, kind="stable")]])

    def observer(self, layer: int, observe: ObserveRoute | None) -> ObserveRoute | None:
        """`observe` for layer `layer`'s routing, first scoring it against what the lookahead predicted."""
        predicted = self._predicted.pop(layer, None)
        if predicted is None:
            return observe

        def scored(idx: np.ndarray, scores: np.ndarray) -> None:
            if len(predicted) == len(idx):  # (always, unless a failed step left a guess for other rows)
                self.stats.add(predicted, idx)
            if observe is not None:
                observe(idx, scores)
        return scored
