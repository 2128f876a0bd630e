"""What one forward step is given per sequence (`Segment`) and what it saw of that sequence's rows (`StepTrace`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._cache import KVCache


@dataclass
class StepTrace:
    """What one forward step saw of one segment's rows, for run receipts: per MoE layer the chosen experts,
    and the last hidden state (after the final norm). With `alternatives` (a receipt's replay), also per MoE
    layer each row's gap between its k-th and (k+1)-th selection score and the two experts on either side of
    it, so a near-tie can be told from a divergence."""

    alternatives: bool = False
    routes: list[np.ndarray] = field(default_factory=list)  # per MoE layer: [t, k] expert ids, rows sorted
    gaps: list[np.ndarray] = field(default_factory=list)  # per MoE layer: [t] float32 (inf when k = E)
    swaps: list[np.ndarray] = field(default_factory=list)  # per MoE layer: [t, 2] (k-th chosen, (k+1)-th best)
    hidden: np.ndarray | None = None  # [t, H] float32

    def observe(self, idx: np.ndarray, scores: np.ndarray) -> None:  # [t, k], [t, E]
        self.routes.append(np.sort(idx, axis=1))
        if not self.alternatives:
            return
        k = idx.shape[1]
        if k >= scores.shape[1]:
            self.gaps.append(np.full(len(idx), np.inf, np.float32))
            self.swaps.append(np.zeros((len(idx), 2), np.int64))
            return
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k + 1]  # [t, k+1]
        best = np.take_along_axis(scores, order, axis=1)
        self.gaps.append((best[:, k - 1] - best[:, k]).astype(np.float32))
        self.swaps.append(order[:, k - 1:k + 1].astype(np.int64))


@dataclass
class Segment:
    """One sequence's rows in a forward step: its new token ids, its own KV cache, and which logits it wants
    ("last": its last row's, "all": every row's, "none"); with a `trace`, what the step saw of its rows."""

    ids: np.ndarray  # [t] int64, t >= 1
    cache: KVCache
    logits: str = "last"
    trace: StepTrace | None = None
