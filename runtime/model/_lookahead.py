"""Lookahead accounting: how well the experts predicted for a layer matched the ones it then chose."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
