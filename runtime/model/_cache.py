"""The KV cache: per-layer float32 buffers that grow along the time axis, with a byte count for budgeting."""

from __future__ import annotations

import math

import numpy as np

from shardtool.errors import UsageError

from ._config import ModelConfig


def _per_token_shapes(cfg: ModelConfig) -> tuple[tuple[tuple[int, ...], int], ...]:
    """(shape with a time axis of length 0, that axis) for each buffer of one layer."""
    if cfg.mla is not None:  # latent c [S, r] and the shared rotary key [S, dr]
        return ((0, cfg.mla.kv_lora_rank), 0), ((0, cfg.mla.qk_rope_head_dim), 0)
    return ((cfg.num_kv_heads, 0, cfg.head_dim), 1), ((cfg.num_kv_heads, 0, cfg.head_dim), 1)


def bytes_per_token(cfg: ModelConfig) -> int:
    """Cache bytes one token costs across all layers (float32)."""
    per_layer = sum(math.prod(n for i, n in enumerate(shape) if i != axis) for shape, axis in _per_token_shapes(cfg))
    return 4 * per_layer * cfg.num_layers


class KVCache:
    """Keys and values of the tokens seen so far, for every layer.

    A step writes its T new entries at positions [length, length + T) of every layer and `commit(T)`
    moves `length` on only once all layers are done, so a step that fails midway leaves the cache as it was.

    With `max_tokens` each buffer is allocated once at that capacity, so the cache never holds more than
    `bytes_per_token(cfg) * max_tokens` bytes (the figure the memory budget reserves), never copies itself
    to grow, and untouched pages cost no resident memory. Without it, buffers grow by doubling.
    """

    def __init__(self, cfg: ModelConfig, *, max_tokens: int | None = None, initial_capacity: int = 64):
        if max_tokens is not None and max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._shapes = _per_token_shapes(cfg)
        self._initial = initial_capacity
        self._buffers: list[list[np.ndarray]] = [[] for _ in range(cfg.num_layers)]
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes currently allocated (capacity, not just the used part)."""
        return sum(b.nbytes for layer in self._buffers for b in layer)

    def reset(self) -> None:
        """Forget all tokens; keep the allocation for reuse."""
        self.length = 0

    def check_room(self, new_tokens: int) -> None:
        if self.max_tokens is not None and self.length + new_tokens > self.max_tokens:
            raise UsageError(f"sequence of {self.length + new_tokens} tokens exceeds the KV cache limit "
                             f"of {self.max_tokens}")

    def append(self, layer: int, *new: np.ndarray) -> tuple[np.ndarray, ...]:
        """Write this step's entries for `layer`; return views of all entries so far (length + T)."""
        start = self.length
        views = []
        for i, ((_, axis), x) in enumerate(zip(self._shapes, new, strict=True)):
            stop = start + x.shape[axis]
            buf = self._room(layer, i, stop)
            _span(buf, axis, start, stop)[...] = x
            views.append(_span(buf, axis, 0, stop))
        return tuple(views)

    def row_buffers(self, layer: int) -> tuple[np.ndarray, ...]:
        """`layer`'s whole buffers, with room for one more entry at position `length`: for a kernel that writes a
        decode row's entries there itself (they count once `commit(1)` is called, as `append`'s)."""
        return tuple(self._room(layer, i, self.length + 1) for i in range(len(self._shapes)))

    def _room(self, layer: int, i: int, stop: int) -> np.ndarray:
        """Buffer i of `layer`, allocated or grown (its entries kept) to hold at least `stop` along its time axis."""
        bufs = self._buffers[layer]
        shape, axis = self._shapes[i]
        if i == len(bufs):
            capacity = self.max_tokens if self.max_tokens is not None else max(self._initial, stop)
            bufs.append(np.empty(_with(shape, axis, capacity), np.float32))
        buf = bufs[i]
        if stop > buf.shape[axis]:
            grown = np.empty(_with(shape, axis, max(2 * buf.shape[axis], stop)), np.float32)
            _span(grown, axis, 0, self.length)[...] = _span(buf, axis, 0, self.length)
            bufs[i] = buf = grown
        return buf

    def commit(self, new_tokens: int) -> None:
        self.length += new_tokens


def _with(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return shape[:axis] + (n,) + shape[axis + 1:]


def _span(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    if axis == 0:  # (the two axes the buffers have, indexed directly: every layer of every step comes here)
        return a[start:stop]
    if axis == 1:
        return a[:, start:stop]
    return a[(slice(None),) * axis + (slice(start, stop),)]
