"""The verifying shard store: the only way weights reach the forward pass.

`get(entry)` reads a shard into private memory, checks size and BLAKE3 against the signed manifest,
and only then parses those same bytes into read-only arrays. Verified shards live in a cache bounded by a
byte budget, evicted by a `_cache_policy` (LRU, LFU or LFU-DA); an evicted shard needed again is read and
verified again.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from shardtool.errors import CheckpointFormatError, DigestMismatchError, MissingFileError, ShardFormatError
from shardtool.manifest import PAGE_CACHE_CHOICES, PAGE_CACHE_MODES, Entry, read_verified_timed
from shardtool.safetensors_format import HeaderMemo, parse_safetensors

from ._cache_policy import DEFAULT_POLICY, CacheIndex
from ._readers import ReaderPool

Arrays = Mapping[str, np.ndarray]
# Each chunk is hashed right after it is read, while it is still in the CPU cache: one pass over memory
# instead of two (read all, then hash all), measured ~30% faster on 6 MB experts (benchmarks/bench_runtime.py).

# What a verified read leaves in the kernel's page cache: one of `PAGE_CACHE_MODES`, or "auto" (`page_cache_mode`).
DEFAULT_PAGE_CACHE = "auto"


def page_cache_mode(choice: str, model_bytes: int, shard_cache_bytes: int) -> str:
    """The page-cache mode for a store of `shard_cache_bytes` over a model of `model_bytes` (its shard files).
    "auto": a model the shard cache holds whole is read once per process and kept in the page cache (the next process
    starts from memory); a model it cannot hold is streamed, and then each read's pages are dropped ("drop"): the
    shard cache alone decides what stays, each byte is held once under a memory cap that counts the page cache, and
    the disk carries the bytes the shard store reads (benchmarks/bench_seed.py; tests/bench/test_machine.py)."""
    if choice not in PAGE_CACHE_CHOICES:
        raise ValueError(f"page_cache must be one of {PAGE_CACHE_CHOICES}, got {choice!r}")
    if choice != "auto":
        return choice
    return "keep" if model_bytes <= shard_cache_bytes else "drop"

# Parsed shard headers a store keeps for the shards it reads again (`HeaderMemo`): room for every shard of the model
# (a typical expert's header costs about 4 KiB remembered), at least 1 MiB and at most 96 MiB (about 19,000 shards:
# DeepSeek-V3 has about 14,900).
HEADER_MEMO_PER_SHARD = 5 * 1024
HEADER_MEMO_MIN, HEADER_MEMO_MAX = 2**20, 96 * 2**20


def header_memo_bytes(shards: int) -> int:
    """The memory a store of `shards` shards keeps for parsed headers: the memory plan counts it among the working
    buffers (`_plan.plan_budget`, `_cluster_plan.node_memory_floor`)."""
    return min(HEADER_MEMO_MAX, max(HEADER_MEMO_MIN, shards * HEADER_MEMO_PER_SHARD))


@dataclass
class StoreStats:
    hits: int = 0  # requests served without a read: cached, or joining a load already in flight
    misses: int = 0  # loads started (by a request or a prefetch): each reads and verifies the file once
    evictions: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall seconds summed over reader threads: they overlap each other and compute
    verify_seconds: float = 0.0
    read_cpu_seconds: float = 0.0  # CPU seconds of the same: without the time a reader waited for a core
    verify_cpu_seconds: float = 0.0
    parse_seconds: float = 0.0
    wait_seconds: float = 0.0  # time the forward pass actually waited for shards
    wait_by_kind: dict[str, float] = field(default_factory=dict)  # the same, by kind of shard
    fetched: int = 0  # shards fetched from a remote store first (--remote), then read and verified as any other
    fetch_seconds: float = 0.0
    peak_cached_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    # By kind (expert, trunk, ...): shards the forward pass asked for (`request`, `get`), and of those the ones
    # served without starting a read (cached, or already loading: a prefetch that was not done yet counts here and
    # its rest shows in wait_seconds).
    requests: dict[str, int] = field(default_factory=dict)
    request_hits: dict[str, int] = field(default_factory=dict)
    # By kind: loads a `prefetch` started, and of those the ones the forward pass then asked for before they were
    # evicted (the others were guessed wrong, or evicted unused).
    prefetched: dict[str, int] = field(default_factory=dict)
    prefetch_used: dict[str, int] = field(default_factory=dict)

    def hit_rate(self, kind: str) -> float | None:
        asked = self.requests.get(kind, 0)
        return self.request_hits.get(kind, 0) / asked if asked else None

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else dict(v) if isinstance(v, dict) else v)
                for k, v in self.__dict__.items()}


def _count(counts: dict[str, int], kind: str) -> None:
    counts[kind] = counts.get(kind, 0) + 1


class Shard(dict):
    """One verified shard's arrays by name, and `memo`: what its users derive from them (the forward pass keeps its
    checked, packed views of the weights there), so derived data lives exactly as long as the shard, cached or in
    use, and is dropped with it when it is evicted."""

    __slots__ = ("memo",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memo: dict[str, object] = {}


def parse_shard(entry: Entry, data: np.ndarray | bytes, headers: HeaderMemo | None = None) -> Shard:
    """Parse verified bytes (`headers`: headers parsed before). Malformed-but-signed shards fail cleanly as a
    verification error. One `Shard` per load."""
    try:
        arrays, _ = parse_safetensors(data, headers=headers)
    except CheckpointFormatError as e:
        raise ShardFormatError(f"signed shard is not valid safetensors: {e.message}", path=entry.path) from None
    return Shard(arrays)


class ShardStore:
    """A cache of verified, parsed shards under `budget_bytes`, with a pool of reader threads."""

    def __init__(self, root: Path, *, budget_bytes: int, readers: int = 2,
                 fetch_missing: Callable[[Entry], None] | None = None, policy: str = DEFAULT_POLICY,
                 prepare: Callable[[Entry, Arrays], None] | None = None, header_memo: int = HEADER_MEMO_MIN,
                 page_cache: str = "keep"):
        """`fetch_missing(entry)`: brings a listed shard that `root` does not hold into `root` (`--remote`: fetched
        from mirrors, verified, renamed into place); the store then reads it through the same entry check.
        `policy`: which cached shard is evicted first (`_cache_policy.POLICIES`); trunk shards go only when
        no expert is left (`CacheIndex`). `prepare(entry, arrays)`: run by the reader thread on a shard it verified
        and parsed, before anyone is handed it (the forward pass checks and packs an expert's weights there, off its
        own thread); an error it raises fails that load like a format error. `header_memo`: bytes for the headers of
        shards read again (`header_memo_bytes`), outside `budget_bytes`. `page_cache`: what a verified read leaves in
        the kernel's page cache (`PAGE_CACHE_MODES`; a caller that knows the model resolves "auto" with
        `page_cache_mode`)."""
        if budget_bytes <= 0:
            raise ValueError(f"budget must be positive, got {budget_bytes}")
        if page_cache not in PAGE_CACHE_MODES:
            raise ValueError(f"page_cache must be one of {PAGE_CACHE_MODES}, got {page_cache!r}")
        self.page_cache = page_cache
        self.root = Path(root)
        self.budget = budget_bytes
        self.stats = StoreStats()
        self._fetch_missing = fetch_missing
        self._prepare = prepare
        self._index = CacheIndex(policy, budget_bytes)  # which shards are cached, their bytes, the eviction order
        self._cache: dict[str, Arrays] = {}
        self._unused: set[str] = set()  # loaded (or loading) for a prefetch, not yet asked for by a request
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ReaderPool(readers, "shard-reader")  # loads the forward pass waits for before prefetches
        self._headers = HeaderMemo(header_memo)  # a shard read again is not parsed again
        self._expert_hits: dict[tuple[int, int], int] = {}  # (layer, expert) -> requests served from the cache

    def close(self) -> None:
        self._pool.shutdown()

    @property
    def policy(self) -> str:
        return self._index.policy

    @property
    def cached_bytes(self) -> int:
        return self._index.used

    def expert_cache(self) -> tuple[list[str], dict[tuple[int, int], int]]:
        """The paths of the shards cached now, and each expert's cache hits since start ((layer, expert) -> hits):
        a copy of two small maps under the lock, for a status page that asks once a second."""
        with self._lock:
            return list(self._cache), dict(self._expert_hits)

    def _load(self, entry: Entry) -> Arrays:
        """Reader thread: read and verify, parse; then insert into the cache."""
        try:
            try:
                loaded = read_verified_timed(self.root, entry, self.page_cache)
            except (MissingFileError, DigestMismatchError):
                if self._fetch_missing is None:
                    raise  # (a cache directory's wrong or missing file is fetched again, verified, renamed over it)
                t0 = time.perf_counter()
                self._fetch_missing(entry)
                with self._lock:
                    self.stats.fetched += 1
                    self.stats.fetch_seconds += time.perf_counter() - t0
                # what is used is what this read verifies
                loaded = read_verified_timed(self.root, entry, self.page_cache)
            t0 = time.perf_counter()
            arrays = parse_shard(entry, loaded.data, self._headers)
            if self._prepare is not None:
                self._prepare(entry, arrays)
            parse_seconds = time.perf_counter() - t0
        except BaseException:
            with self._lock:
                self._inflight.pop(entry.path, None)
                self._unused.discard(entry.path)
            raise
        with self._lock:
            s = self.stats
            s.read_seconds += loaded.read_seconds
            s.verify_seconds += loaded.hash_seconds
            s.read_cpu_seconds += loaded.read_cpu_seconds
            s.verify_cpu_seconds += loaded.hash_cpu_seconds
            s.parse_seconds += parse_seconds
            s.bytes_read += entry.size
            s.by_kind[entry.kind] = s.by_kind.get(entry.kind, 0) + entry.size
            self._insert(entry, arrays)
            self._inflight.pop(entry.path, None)
        return arrays

    def _insert(self, entry: Entry, arrays: Arrays) -> None:
        # Admitted as its first use: a prefetched shard's first request is not counted again (`_lookup`).
        evicted = self._index.insert(entry.path, entry.size, expert=entry.kind == "expert")
        if evicted is None:
            self._unused.discard(entry.path)
            return  # used once, never cached: it alone would break the budget
        for victim in evicted:
            del self._cache[victim]
            self._unused.discard(victim)
        self.stats.evictions += len(evicted)
        self._cache[entry.path] = arrays
        self.stats.peak_cached_bytes = max(self.stats.peak_cached_bytes, self._index.used)

    def _lookup(self, entry: Entry, use: bool = True) -> Arrays | Future:
        """Caller holds the lock. The cached arrays (a hit), or the new or in-flight load (a miss).

        A hit hands out the arrays at once, under the lock: looking them up again later could find them
        evicted by a concurrent load and force an unaccounted re-read.

        `use`: the forward pass asks for the shard (False: a prefetch). The policy counts uses only: a
        loaded shard is admitted as used once, and the first request after the prefetch that loaded it is
        that use, not a second one (an LFU count is then the requests, however the shard was loaded).
        """
        path = entry.path
        first_use = use and path in self._unused
        if use:
            self._unused.discard(path)
        hit = self._cache.get(path)
        if hit is not None:
            self._index.touch(path, use=use and not first_use)
            return hit
        fut = self._inflight.get(path)
        if fut is None:
            fut = self._pool.submit(self._load, entry, prefetch=not use)
            self._inflight[path] = fut
            self.stats.misses += 1
            if not use:
                self._unused.add(path)
        elif first_use:  # a prefetch still loading (or queued) that the forward pass now waits for
            self._pool.promote(fut)
        return fut

    def prefetch(self, entries: Iterable[Entry]) -> None:
        """Start loading shards in the background; errors surface when they are `get`. A shard already cached is
        touched (its recency refreshed, not counted as a use), so what is about to be used stays.

        Expert guesses replace older ones: expert prefetches still queued (no reader started them) that this call
        does not ask for again are withdrawn, as if never asked for (a wrong guess for a layer the forward pass has
        passed would otherwise take a reader, and a core, from the loads it waits for)."""
        entries = list(entries)
        with self._lock:
            if any(e.kind == "expert" for e in entries):
                wanted = {e.path for e in entries}
                for stale in self._pool.withdraw_prefetches(lambda e: e.kind != "expert" or e.path in wanted):
                    self._inflight.pop(stale.path, None)
                    self._unused.discard(stale.path)
                    self.stats.misses -= 1
                    self.stats.prefetched[stale.kind] -= 1
            for entry in entries:
                misses = self.stats.misses
                self._lookup(entry, use=False)
                if self.stats.misses != misses:
                    _count(self.stats.prefetched, entry.kind)

    def request(self, entries: list[Entry]) -> list[Callable[[], Arrays]]:
        """Start loading every shard now (reader pool) and return one waiter per shard: calling it blocks
        only until that shard is verified and parsed, so compute on one can overlap hashing of the next."""
        with self._lock:
            s, found = self.stats, []
            for entry in entries:
                misses = s.misses
                prefetched = entry.path in self._unused  # loaded (or loading) for a prefetch, not evicted since
                found.append(self._lookup(entry))
                self._count_request(entry, s.misses == misses, prefetched)
        return [self._waiter(got, entry.kind) for got, entry in zip(found, entries)]

    def _count_request(self, entry: Entry, hit: bool, prefetched: bool) -> None:
        """One shard asked for (under the lock): a hit, and a prefetch that paid off, counted as such."""
        s = self.stats
        _count(s.requests, entry.kind)
        if hit:
            s.hits += 1
            _count(s.request_hits, entry.kind)
            if entry.kind == "expert":
                key = (entry.layer, entry.expert)
                self._expert_hits[key] = self._expert_hits.get(key, 0) + 1
            if prefetched:
                _count(s.prefetch_used, entry.kind)

    def _waiter(self, got: Arrays | Future, kind: str) -> Callable[[], Arrays]:
        if not isinstance(got, Future):
            return lambda: got

        def wait() -> Arrays:
            t0 = time.perf_counter()
            try:
                return got.result()  # raises the load's error (digest mismatch, format) here
            finally:
                waited = time.perf_counter() - t0
                with self._lock:
                    self.stats.wait_seconds += waited
                    self.stats.wait_by_kind[kind] = self.stats.wait_by_kind.get(kind, 0.0) + waited
        return wait

    def get_many(self, entries: list[Entry]) -> list[Arrays]:
        """All shards, loaded in parallel by the reader pool; raises the first failure."""
        return [wait() for wait in self.request(entries)]

    def get(self, entry: Entry) -> Arrays:
        with self._lock:
            hit = self._take_hit(entry)
        return hit if hit is not None else self.get_many([entry])[0]

    def cached(self, entries: list[Entry]) -> list[Arrays] | None:
        """Every shard's arrays when every one is cached now, each counted as `request` counts a hit; else None,
        and nothing touched or counted (the caller then `request`s them). A warm decode step asks for its experts
        here: one lock and no waiters."""
        with self._lock:
            if not all(entry.path in self._cache for entry in entries):
                return None
            return [self._take_hit(entry) for entry in entries]  # type: ignore[misc]

    def _take_hit(self, entry: Entry) -> Arrays | None:
        """Caller holds the lock. `request` for a shard that is cached: `_lookup` hands out its arrays and records
        the use, `_count_request` counts the hit (a prefetched shard's first request is its admitted use, not
        another); None, and nothing touched or counted, when it is not cached."""
        if entry.path not in self._cache:
            return None
        prefetched = entry.path in self._unused
        hit = self._lookup(entry)
        self._count_request(entry, True, prefetched)
        return hit  # type: ignore[return-value]
