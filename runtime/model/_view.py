"""The forward pass's view of a `WeightProvider`: each shard's tensors checked and packed once per shard it hands
out, and the routed experts fetched (locally or from a cluster's nodes); the lookahead's guesses are `Lookahead`'s
(`_lookahead.py`), which this view hands the forward pass's calls to."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from shardtool.errors import CheckpointFormatError
from shardtool.families import TEXT_MODEL_WRAPPER

from ._config import ModelConfig
from ._dtypes import finite, to_float32, weight_f32
from ._layers import ExpertFetch, ExpertOutputs, ObserveRoute
from ._lookahead import Lookahead
from ._packed import Packed, pack
from ._prepare import expert_packed, prepare_layer, run_expert
from ._weights import Prefetcher, WeightProvider, derived

_T = TypeVar("_T")


class PackedWeights:
    """The weights in their stored dtype, packed (`Packed`: views of the shard, no copies): the model's view of the
    provider, each shard's tensors checked against the config and its weights packed once per shard the provider hands
    out (`derived`); float32 is what the products return, never a whole weight's copy.

    `remote(layer)`, when given, computes the routed experts instead of the provider (a cluster's nodes); the
    provider then serves only the trunk.

    Lookahead: when the provider is a `Prefetcher` and its `lookahead` is true, `lookahead(l, x)` guesses layer
    l's experts and hands them to the provider (`Lookahead`). The layer itself routes on its real input: a wrong guess
    costs a read, never a different result."""

    def __init__(self, cfg: ModelConfig, provider: WeightProvider,
                 remote: Callable[[int], ExpertFetch] | None = None):
        self.cfg = cfg
        self.provider = provider
        self.remote = remote
        # The provider's loads the lookahead may start (None: it takes no guesses, or a cluster computes the experts).
        self._lookahead = Lookahead(cfg, provider,
                                    provider if remote is None and isinstance(provider, Prefetcher) else None)
        self.lookahead_stats = self._lookahead.stats
        self._lm_shape = (cfg.vocab_size, cfg.hidden_size)

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:  # [T] -> [T, H]
        table = derived(self.provider.embed(), "embed", self.cfg, self._embed_table)
        return to_float32(table[ids], "model.embed_tokens.weight")  # only the rows used

    def _embed_table(self, embed: Mapping[str, np.ndarray]) -> np.ndarray:  # -> [V, H] as stored
        table = _unwrapped(embed).get("model.embed_tokens.weight")
        if table is None:
            raise CheckpointFormatError("missing tensor model.embed_tokens.weight")
        if table.shape != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise CheckpointFormatError(f"model.embed_tokens.weight has shape {table.shape}, expected "
                                        f"{(self.cfg.vocab_size, self.cfg.hidden_size)}")
        # its dtype checked and every value finite, once per load of its shard (rows are converted as they are used)
        pack({"embed_tokens.weight": table}, "embed_tokens", self._lm_shape, "model")
        return table

    def head(self) -> tuple[np.ndarray, Packed]:  # norm [H] float32, lm_head [V, H] as stored
        norm, lm = derived(self.provider.head(), "head", self.cfg, self._head)
        if lm is None:  # tied: the embedding table, packed once and kept with it (its shard, not the head's)
            lm = derived(self.provider.embed(), "tied_head", self.cfg, lambda t: pack(
                {"embed_tokens.weight": self._embed_table(t)}, "embed_tokens", self._lm_shape, "model"))
        return norm, lm

    def _head(self, head: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Packed | None]:  # None: tied
        t = _unwrapped(head)
        if "model.norm.weight" not in t:
            raise CheckpointFormatError("missing tensor model.norm.weight")
        norm = finite(weight_f32(t, "model.norm.weight"), "model.norm.weight")
        if norm.shape != (self.cfg.hidden_size,):
            raise CheckpointFormatError(f"model.norm.weight has shape {norm.shape}, expected "
                                        f"{(self.cfg.hidden_size,)}")
        if self.cfg.tie_word_embeddings:
            return norm, None
        if "lm_head.weight" not in t:
            raise CheckpointFormatError("missing tensor lm_head.weight", hint="tie_word_embeddings is false")
        return norm, pack(t, "lm_head", self._lm_shape, "model", fp8_block=self.cfg.fp8_block)

    def layer(self, layer: int) -> dict[str, Packed | np.ndarray]:
        return self._trunk(layer, self.provider.layer(layer))

    def _trunk(self, layer: int, tensors: Mapping[str, np.ndarray]) -> dict[str, Packed | np.ndarray]:
        """# a trunk shard's tensors -> the layer's weights, checked and packed once per shard (`prepare_layer`)"""
        return derived(tensors, "trunk", self.cfg, lambda t: prepare_layer(self.cfg, layer, t))

    def layer_derived(self, layer: int, key: str, make: Callable[[dict[str, Packed | np.ndarray]], _T]) -> _T:
        """`make(self.layer(layer))`, computed once per trunk shard the provider hands out and config (`derived`,
        under `key`; at every call for a provider that hands out plain mappings) and found again with one request to
        the provider: what a decode step works out of a layer's weights."""
        return derived(self.provider.layer(layer), key, self.cfg, lambda t: make(self._trunk(layer, t)))

    @property
    def lookahead_on(self) -> bool:
        return self._lookahead.on

    def lookahead(self, layer: int, hidden: np.ndarray) -> None:
        """# layer l, a hidden state [T, H] on its way to layer l -> its experts guessed and their loads started
        (`Lookahead.guess`)."""
        self._lookahead.guess(layer, hidden)

    def observer(self, layer: int, observe: ObserveRoute | None) -> ObserveRoute | None:
        """`observe` for layer `layer`'s routing, first scoring it against what the lookahead predicted."""
        return self._lookahead.observer(layer, observe)

    def expert_fetch(self, layer: int) -> ExpertFetch:
        if self.remote is not None:
            return self.remote(layer)

        def fetch(x: np.ndarray, rows: Mapping[int, np.ndarray]) -> ExpertOutputs:
            return _LocalExperts(self.cfg, layer, self.experts(layer, list(rows)), x, rows)
        return fetch

    def expert_projections(self, layer: int, expert: int,
                           t: Mapping[str, np.ndarray]) -> tuple[Packed, Packed, Packed]:
        """# an expert shard's tensors -> gate [I, H], up [I, H], down [H, I] as stored (`expert_packed`)"""
        return expert_packed(self.cfg, layer, expert, t)

    def experts(self, layer: int, ids: list[int]) -> Mapping[int, Mapping[str, np.ndarray]]:
        """The provider's experts `ids` of `layer` (their loads started), each a shard's tensors when it is reached."""
        got = self.provider.experts(layer, ids)
        missing = [e for e in ids if e not in got]
        if missing:
            raise CheckpointFormatError(f"layer {layer}: provider returned no tensors for experts {missing}")
        return got


def _unwrapped(tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """Embed/head tensors under their text-model names: a multimodal checkpoint's wrapper prefix removed."""
    if not any(n.startswith(TEXT_MODEL_WRAPPER) for n in tensors):
        return tensors
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        plain = name.removeprefix(TEXT_MODEL_WRAPPER)
        if plain in out:
            raise CheckpointFormatError(f"tensors {plain!r} and {TEXT_MODEL_WRAPPER + plain!r} are both present")
        out[plain] = array
    return out


class _LocalExperts(Mapping):
    """expert id -> a thunk that takes the expert from the provider and runs it on its rows (packed as stored,
    `expert_packed`), only when the MoE loop reaches it: with a streaming provider, expert e computes while the next one is
    still being read and verified."""

    def __init__(self, cfg: ModelConfig, layer: int, got: Mapping[int, Mapping[str, np.ndarray]], x: np.ndarray,
                 rows: Mapping[int, np.ndarray]):
        self.cfg, self.layer, self.got, self.x, self.rows = cfg, layer, got, x, rows

    def __getitem__(self, expert: int) -> Callable[[], np.ndarray]:
        rows, x = self.rows[expert], self.x
        if len(x) > 1:  # (one row: it is the expert's only row, x itself)
            x = x[rows]
        return lambda: run_expert(self.cfg, self.layer, expert, self.got[expert], x)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)
