"""Which cached shard to evict: LRU, LFU and LFU with dynamic aging, behind one small interface.

A policy only orders keys; the shard store keeps the arrays and their sizes, and asks for victims until a new
shard fits its byte budget. Every policy here is pure bookkeeping (no I/O, no clock, no threads: the store
calls it under its lock), so a trace can be replayed through the very objects the store uses
(`benchmarks/bench_cache_policy.py`).

- lru: evict the key used least recently.
- lfu: evict the key used least often while cached (a key's count starts at 1 each time it is admitted);
  among equal counts, the least recently used.
- lfu-da: LFU with dynamic aging (Arlitt, Cherkasova, Dilley, Friedrich, Jin: "Evaluating content management
  techniques for Web proxy caches", 2000). Each key has priority K = F + L, where F is its use count while
  cached and L the cache's age: 0 at start, set to the K of each evicted key. K is computed when the key is
  admitted or used, so keys that were popular long ago age out instead of staying forever, as under lfu.
  Ties: the least recently used.

A prefetch (a load started because a shard is predicted to be needed, not because the forward pass asked)
is `touch(key, use=False)` on a cached key and an admission on a loaded one: it refreshes recency, but is
never counted as a use, so a misprediction does not make a shard look popular; the store counts the use
when the forward pass does ask for it (`ShardStore._lookup`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Protocol

POLICIES = ("lru", "lfu", "lfu-da")
DEFAULT_POLICY = "lru"


class CachePolicy(Protocol):
    name: str

    def admit(self, key: str) -> None:
        """`key` was just inserted into the cache (its first use, or a prefetch's load); not cached before."""

    def touch(self, key: str, *, use: bool = True) -> None:
        """`key`, cached, was asked for again: by the forward pass (`use`) or by a prefetch."""

    def victim(self) -> str:
        """Remove and return the key to evict now; the cache must not be empty."""

    def __len__(self) -> int: ...


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def admit(self, key: str) -> None:
        self._order[key] = None

    def touch(self, key: str, *, use: bool = True) -> None:
        self._order.move_to_end(key)

    def victim(self) -> str:
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)


class LFU:
    """LFU, and with `aging` LFU-DA: the smallest priority is evicted, ties to the least recently touched.

    A binary heap with lazy deletion: a touch pushes the key's new (priority, clock) and leaves the old pair
    behind, skipped when popped; the heap is rebuilt when stale pairs outnumber live ones. So admit, touch and
    victim cost O(log n), as a model with 15,000 experts needs."""

    def __init__(self, *, aging: bool = False) -> None:
        self.name = "lfu-da" if aging else "lfu"
        self._aging = aging
        self.age = 0  # L: the priority of the last key evicted (stays 0 without aging)
        self._clock = 0
        self._keys: dict[str, tuple[int, int, int]] = {}  # key -> (priority, uses, clock of its last touch)
        self._heap: list[tuple[int, int, str]] = []  # (priority, clock, key); stale when it differs from _keys

    def priority(self, key: str) -> int:
        return self._keys[key][0]

    def admit(self, key: str) -> None:
        self._set(key, 1)

    def touch(self, key: str, *, use: bool = True) -> None:
        self._set(key, self._keys[key][1] + (1 if use else 0))

    def _set(self, key: str, uses: int) -> None:
        self._clock += 1
        priority = uses + self.age
        self._keys[key] = (priority, uses, self._clock)
        heapq.heappush(self._heap, (priority, self._clock, key))
        if len(self._heap) > 2 * len(self._keys) + 64:
            self._heap = [(p, c, k) for k, (p, _, c) in self._keys.items()]
            heapq.heapify(self._heap)

    def victim(self) -> str:
        while self._heap:
            priority, clock, key = heapq.heappop(self._heap)
            live = self._keys.get(key)
            if live is not None and live[0] == priority and live[2] == clock:
                del self._keys[key]
                if self._aging:
                    self.age = priority
                return key
        raise LookupError("victim() of an empty cache")

    def __len__(self) -> int:
        return len(self._keys)


def make_policy(name: str) -> CachePolicy:
    if name == "lru":
        return LRU()
    if name in ("lfu", "lfu-da"):
        return LFU(aging=name == "lfu-da")
    raise ValueError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICIES)}")


class CacheIndex:
    """The bookkeeping of a byte-budgeted cache: which keys are cached, their bytes, and which are evicted
    when a new key must fit. The shard store holds the values; a simulator can replay a trace through the
    same object.

    Trunk shards (every key not marked `expert`: embeddings, head, each layer's attention and router) are
    evicted only when no expert is cached. Every forward step uses every trunk shard and only some experts,
    so an expert is never kept at the price of a trunk shard the next step will read again; under LRU,
    sharing one order had trunk re-reads make 3-9% of the bytes read at budgets of 1/8 and 1/4 of the
    experts, for the same expert hit rate (`benchmarks/bench_cache_policy.py`). When the budget cannot hold
    the whole trunk, trunk shards evict each other by the same policy."""

    def __init__(self, policy: str, budget: int):
        self.policy = policy
        self.budget = budget
        self.used = 0
        self._experts = make_policy(policy)
        self._trunk = make_policy(policy)
        self._where: dict[str, tuple[CachePolicy, int]] = {}  # key -> (its policy, bytes)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def touch(self, key: str, *, use: bool = True) -> None:
        self._where[key][0].touch(key, use=use)

    def insert(self, key: str, size: int, *, expert: bool) -> list[str] | None:
        """Admit `key` (not cached) after evicting until it fits; returns the evicted keys, or None when `key`
        alone is bigger than the budget (then it is not cached and nothing is evicted)."""
        if size > self.budget:
            return None
        evicted = []
        while self._where and self.used + size > self.budget:
            tier = self._experts if len(self._experts) else self._trunk
            victim = tier.victim()
            self.used -= self._where.pop(victim)[1]
            evicted.append(victim)
        tier = self._experts if expert else self._trunk
        tier.admit(key)
        self._where[key] = (tier, size)
        self.used += size
        return evicted
