"""The verifying shard store: the only way weights reach the forward pass.

`get(entry)` reads a shard into private memory, checks size and BLAKE3 against the signed manifest,
and only then parses those same bytes into read-only arrays. Verified shards live in an LRU cache
bounded by a byte budget; an evicted shard needed again is read and verified again.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import blake3
import numpy as np

from shardtool.errors import CheckpointFormatError, DigestMismatchError, StorageError, VerificationError
from shardtool.manifest._files import open_beneath
from shardtool.manifest._records import Entry

Arrays = Mapping[str, np.ndarray]
# Each chunk is hashed right after it is read, while it is still in the CPU cache: one pass over memory
# instead of two (read all, then hash all), measured ~30% faster on 6 MB experts (benchmarks/bench_runtime.py).
CHUNK = 1 << 20


class ShardFormatError(VerificationError):
    """A shard whose bytes match the signed digest but do not parse as safetensors, or do not hold the
    tensors the signed config.json implies."""


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
    peak_cached_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Loaded:
    """Verified bytes of one shard (private, read-only) and where the reading thread spent its time:
    wall seconds (include waiting for a core) and CPU seconds (the work itself)."""

    data: np.ndarray  # uint8 [entry.size]
    read_seconds: float
    hash_seconds: float
    read_cpu_seconds: float = 0.0
    hash_cpu_seconds: float = 0.0


def read_verified_shard(root: Path, entry: Entry) -> Loaded:
    """Read `entry` into private memory, hashing each chunk as it arrives; return it only if its size and
    BLAKE3 digest are the manifest's. The bytes returned are exactly the bytes hashed: no mmap, no re-read.

    Hashing runs on the calling thread only (max_threads=1): the store's reader pool already loads
    several shards at once, and BLAKE3's own threads on top would oversubscribe the cores that compute.
    """
    read_s = hash_s = read_cpu = hash_cpu = 0.0
    t, c = time.perf_counter(), time.thread_time()
    fd = open_beneath(Path(root), entry.path)
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            raise DigestMismatchError(f"size is {size} bytes, manifest says {entry.size}", path=entry.path,
                                      expected=str(entry.size), actual=str(size))
        data = np.empty(entry.size, np.uint8)  # not zero-filled: every byte is overwritten by the read
        view = memoryview(data)
        hasher = blake3.blake3()
        done = 0
        while done < entry.size:
            n = os.readv(fd, [view[done:done + CHUNK]])
            if n == 0:
                break
            t1, c1 = time.perf_counter(), time.thread_time()
            read_s, read_cpu = read_s + t1 - t, read_cpu + c1 - c
            hasher.update(view[done:done + n])
            t, c = time.perf_counter(), time.thread_time()
            hash_s, hash_cpu = hash_s + t - t1, hash_cpu + c - c1
            done += n
        extra = len(os.read(fd, 1)) if done == entry.size else 0
        read_s, read_cpu = read_s + time.perf_counter() - t, read_cpu + time.thread_time() - c
    except OSError as e:
        raise StorageError(f"read failed: {e.strerror}", path=entry.path) from e
    finally:
        os.close(fd)
    if done != entry.size or extra:
        actual = f"{done}{'+' if extra else ''}"
        raise DigestMismatchError(f"size changed while reading: expected {entry.size} bytes, read {actual}",
                                  path=entry.path, expected=str(entry.size), actual=actual)
    digest = hasher.digest()
    if digest != entry.digest:
        raise DigestMismatchError(f"BLAKE3 is {digest.hex()}, manifest says {entry.digest.hex()}", path=entry.path,
                                  expected=entry.digest.hex(), actual=digest.hex())
    data.flags.writeable = False
    return Loaded(data, read_s, hash_s, read_cpu, hash_cpu)


def parse_shard(entry: Entry, data: np.ndarray | bytes) -> Arrays:
    """Parse verified bytes. Malformed-but-signed shards fail cleanly as a verification error."""
    from shardtool.checkpoint._safetensors import parse_safetensors

    try:
        arrays, _ = parse_safetensors(data)
    except CheckpointFormatError as e:
        raise ShardFormatError(f"signed shard is not valid safetensors: {e.message}", path=entry.path) from None
    return arrays


class ShardStore:
    """LRU cache of verified, parsed shards under `budget_bytes`, with a pool of reader threads."""

    def __init__(self, root: Path, *, budget_bytes: int, readers: int = 2):
        if budget_bytes <= 0:
            raise ValueError(f"budget must be positive, got {budget_bytes}")
        self.root = Path(root)
        self.budget = budget_bytes
        self.stats = StoreStats()
        self._cache: OrderedDict[str, tuple[Arrays, int]] = OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="shard-reader")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def _load(self, entry: Entry) -> Arrays:
        """Reader thread: read and verify, parse; then insert into the cache."""
        try:
            loaded = read_verified_shard(self.root, entry)
            t0 = time.perf_counter()
            arrays = parse_shard(entry, loaded.data)
            parse_seconds = time.perf_counter() - t0
        except BaseException:
            with self._lock:
                self._inflight.pop(entry.path, None)
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
        if entry.size > self.budget:
            return  # used once, never cached: it alone would break the budget
        while self._cache and self._cached_bytes + entry.size > self.budget:
            _, (_, size) = self._cache.popitem(last=False)
            self._cached_bytes -= size
            self.stats.evictions += 1
        self._cache[entry.path] = (arrays, entry.size)
        self._cached_bytes += entry.size
        self.stats.peak_cached_bytes = max(self.stats.peak_cached_bytes, self._cached_bytes)

    def _lookup(self, entry: Entry) -> Arrays | Future:
        """Caller holds the lock. The cached arrays (a hit), or the new or in-flight load (a miss).

        A hit hands out the arrays at once, under the lock: looking them up again later could find them
        evicted by a concurrent load and force an unaccounted re-read.
        """
        hit = self._cache.get(entry.path)
        if hit is not None:
            self._cache.move_to_end(entry.path)
            return hit[0]
        fut = self._inflight.get(entry.path)
        if fut is None:
            fut = self._pool.submit(self._load, entry)
            self._inflight[entry.path] = fut
            self.stats.misses += 1
        return fut

    def prefetch(self, entries: Iterable[Entry]) -> None:
        """Start loading shards in the background; errors surface when they are `get`."""
        with self._lock:
            for entry in entries:
                self._lookup(entry)

    def get_many(self, entries: list[Entry]) -> list[Arrays]:
        """All shards, loaded in parallel by the reader pool; raises the first failure."""
        with self._lock:
            misses = self.stats.misses
            found = [self._lookup(entry) for entry in entries]
            self.stats.hits += len(found) - (self.stats.misses - misses)
        t0 = time.perf_counter()
        try:
            return [got.result() if isinstance(got, Future) else got for got in found]
        finally:
            self.stats.wait_seconds += time.perf_counter() - t0

    def get(self, entry: Entry) -> Arrays:
        return self.get_many([entry])[0]
