"""The store floor of the runtime: verified reads. A shard is read into private memory, checked for size and BLAKE3
against the signed manifest, and only then parsed into arrays (`Shard`), cached under a byte budget, evicted by a
policy (LRU, LFU, LFU-DA), read by a pool of reader threads that puts the loads the caller waits for first.

It imports nothing of the model or the engine above it: it hands out verified arrays, and its users attach what they
derive from a shard to the shard (`Shard.memo`) or do it on the reader thread (`ShardStore(prepare=...)`).
"""

from ._cache_policy import DEFAULT_POLICY, POLICIES, CacheIndex
from ._store import (DEFAULT_PAGE_CACHE, PAGE_CACHE_CHOICES, Shard, ShardStore, StoreStats, header_memo_bytes,
                     page_cache_mode)

__all__ = ["DEFAULT_PAGE_CACHE", "PAGE_CACHE_CHOICES", "page_cache_mode", "DEFAULT_POLICY", "POLICIES", "CacheIndex",
           "Shard", "ShardStore", "StoreStats", "header_memo_bytes"]
