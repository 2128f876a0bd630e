"""The verifying shard store: read -> BLAKE3 check -> parse, a cache under a byte budget (each eviction
policy), a reader pool."""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import blake3
import numpy as np
import pytest
from safetensors.numpy import save as st_save

import shardtool.manifest._files as files_mod
import shardtool.runtime.store._store as store_mod
from shardtool.errors import DigestMismatchError
from shardtool.manifest import Entry, build_manifest
from shardtool.errors import MissingFileError, NotARegularFileError
from shardtool.runtime import CACHE_POLICIES, DEFAULT_CACHE_POLICY, ShardFormatError, ShardStore

ROWS = 64  # every test shard holds one [ROWS, 16] float32 tensor: same size, so budgets count shards


def shard_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return st_save({"w": rng.standard_normal((ROWS, 16)).astype(np.float32), "b": np.full(3, seed, np.int32)})


def expected_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((ROWS, 16)).astype(np.float32), "b": np.full(3, seed, np.int32)}


def entry_for(path: str, data: bytes, expert: int = 0) -> Entry:
    return Entry(path=path, kind="expert", size=len(data), digest=blake3.blake3(data).digest(), layer=0, expert=expert)


@pytest.fixture
def model(tmp_path):
    """Five expert shards on disk and their entries, taken from a manifest built over them."""
    entries = []
    for i in range(5):
        rel = f"experts/layer-000/expert-{i:04d}.safetensors"
        data = shard_bytes(i)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
        entries.append(entry_for(rel, data, i))
    manifest = build_manifest(entries, model_id="test/store")
    return tmp_path, list(manifest.entries)


SIZE = len(shard_bytes(0))


@pytest.fixture
def reads(monkeypatch):
    """Counts, by path, how often the store opens a file (its only way to read one)."""
    counts: dict[str, int] = {}
    real = files_mod.open_beneath

    def counting(root, relpath):
        counts[relpath] = counts.get(relpath, 0) + 1
        return real(root, relpath)

    monkeypatch.setattr(files_mod, "open_beneath", counting)
    return counts


def make_store(root, budget_shards: float = 100, readers: int = 2, policy: str | None = None) -> ShardStore:
    kw = {} if policy is None else {"policy": policy}
    store = ShardStore(root, budget_bytes=int(budget_shards * SIZE), readers=readers, **kw)
    return store


def flip_byte(path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def assert_arrays(got, seed: int) -> None:
    want = expected_arrays(seed)
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array)


# --- reading and verifying ------------------------------------------------------------------------------

def test_get_returns_the_verified_arrays_read_only(model):
    root, entries = model
    store = make_store(root)
    got = store.get(entries[3])
    assert_arrays(got, 3)
    assert all(not a.flags.writeable for a in got.values())
    s = store.stats
    assert (s.hits, s.misses, s.evictions, s.bytes_read) == (0, 1, 0, SIZE)
    assert s.by_kind == {"expert": SIZE}
    assert store.cached_bytes == SIZE
    store.close()


def _flip_header(p):
    flip_byte(p, 20)


def _flip_data(p):
    flip_byte(p, -5)


def _truncate(p):
    p.write_bytes(p.read_bytes()[:-1])


def _extend(p):
    p.write_bytes(p.read_bytes() + b"\0")


def _same_size_other_shard(p):
    p.write_bytes(shard_bytes(99))  # valid safetensors of the same size, other values


def _delete(p):
    p.unlink()


def _symlink(p):
    other = p.with_name("elsewhere")
    other.write_bytes(p.read_bytes())  # the link points at the right bytes: still refused
    p.unlink()
    p.symlink_to(other.name)


TAMPER_CASES = {  # name: (change to the file, exact error, expected, actual) ("digest" = BLAKE3 hex of file)
    "byte flipped in header": (_flip_header, DigestMismatchError, "digest"),
    "byte flipped in tensor data": (_flip_data, DigestMismatchError, "digest"),
    "truncated by one byte": (_truncate, DigestMismatchError, "size"),
    "extended by one byte": (_extend, DigestMismatchError, "size"),
    "replaced by another valid shard": (_same_size_other_shard, DigestMismatchError, "digest"),
    "deleted": (_delete, MissingFileError, None),
    "replaced by a symlink": (_symlink, NotARegularFileError, None),
}


@pytest.mark.parametrize("case", sorted(TAMPER_CASES))
def test_tampered_shard_is_refused_and_nothing_is_cached(model, case, raises_exactly):
    root, entries = model
    change, error, what = TAMPER_CASES[case]
    entry = entries[1]
    path = root / entry.path
    change(path)
    store = make_store(root)
    with raises_exactly(error) as info:
        store.get(entry)
    assert info.value.path == entry.path
    if what == "digest":
        assert info.value.expected == entry.digest.hex()
        assert info.value.actual == blake3.blake3(path.read_bytes()).hexdigest()
        assert info.value.actual in str(info.value) and entry.digest.hex() in str(info.value)
    elif what == "size":
        assert (info.value.expected, info.value.actual) == (str(SIZE), str(path.stat().st_size))
    assert store.cached_bytes == 0 and store.stats.bytes_read == 0
    # Nothing stuck: once the right bytes are back, the same store reads and verifies them.
    path.unlink(missing_ok=True)
    path.write_bytes(shard_bytes(1))
    assert_arrays(store.get(entry), 1)
    store.close()


# A correctly signed shard whose bytes are not valid safetensors: the digest matches, parsing must fail cleanly.
def _header(doc: dict, data_len: int, *, declared_len: int | None = None) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack("<Q", len(body) if declared_len is None else declared_len) + body + b"\0" * data_len


def _raw(body: bytes, data_len: int) -> bytes:
    return struct.pack("<Q", len(body)) + body + b"\0" * data_len


MALFORMED = {
    "overlapping offsets": _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),
    "offsets past the end": _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8),
    "gap between tensors": _header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, 12),
    "shape disagrees with offsets": _header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8),
    "header length beyond file": _header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 4,
                                         declared_len=10**6),
    "huge header length": struct.pack("<Q", 2**63) + b"{}",
    "unknown dtype": _header({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, 4),
    "not json": struct.pack("<Q", 8) + b"{nope!!}",
    "duplicate names": _raw(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                            b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', 1),
    "trailing bytes": _header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 9),
    "shorter than a length prefix": b"\x01\x02\x03",
    "empty file": b"",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_signed_but_malformed_shard_is_a_format_error(tmp_path, case, raises_exactly):
    data = MALFORMED[case]
    rel = "experts/layer-000/expert-0000.safetensors"
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_bytes(data)
    entry = build_manifest([entry_for(rel, data)], model_id="test/bad").entries[0]
    store = ShardStore(tmp_path, budget_bytes=1 << 20)
    with raises_exactly(ShardFormatError) as info:
        store.get(entry)
    assert info.value.path == rel and info.value.exit_code == 1
    assert store.cached_bytes == 0
    store.close()


def test_expert_cache_names_the_cached_shards_and_counts_hits_per_expert(model):
    """The status page's heat map: which shards are cached now, and each (layer, expert)'s hits since start, counted
    by `get` (a request) and `cached` (a warm step) alike; a miss is not a hit, an eviction keeps the count."""
    root, e = model
    store = make_store(root, budget_shards=2.5, policy="lru")  # room for two shards
    assert store.expert_cache() == ([], {})
    store.get(e[1])  # a miss
    store.get(e[1])  # a hit
    assert store.cached([e[1]]) is not None  # a warm step's hit
    store.get(e[2])
    store.get(e[3])  # evicts e[1]
    paths, hits = store.expert_cache()
    assert sorted(paths) == sorted([e[2].path, e[3].path])
    assert hits == {(0, 1): 2}
    store.close()


# --- the LRU cache under a byte budget ------------------------------------------------------------------

def test_lru_eviction_counts_and_order(model, reads):
    root, e = model
    store = make_store(root, budget_shards=2.5, policy="lru")  # room for two shards
    a, b, c = e[0], e[1], e[2]
    store.get(a)
    store.get(b)
    store.get(a)  # hit: a becomes most recently used, b is now the oldest
    store.get(c)  # miss: evicts b
    assert (store.stats.hits, store.stats.misses, store.stats.evictions) == (1, 3, 1)
    store.get(a)  # still cached
    store.get(b)  # miss again: evicts c
    s = store.stats
    assert (s.hits, s.misses, s.evictions) == (2, 4, 2)
    assert reads == {a.path: 1, b.path: 2, c.path: 1}
    assert store.cached_bytes == 2 * SIZE <= store.budget
    assert s.peak_cached_bytes == 2 * SIZE and s.bytes_read == 4 * SIZE
    store.close()


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_every_policy_keeps_the_budget_and_verifies_every_load(model, monkeypatch, policy, raises_exactly):
    root, e = model
    verified = []
    real = store_mod.read_verified_timed

    def counting(root_, entry, *mode):
        verified.append(entry.path)
        return real(root_, entry, *mode)

    monkeypatch.setattr(store_mod, "read_verified_timed", counting)
    store = make_store(root, budget_shards=2.5, readers=2, policy=policy)
    assert store.policy == policy
    rng = np.random.default_rng(7)
    for i in rng.choice(5, size=200, p=[0.4, 0.3, 0.15, 0.1, 0.05]):
        assert_arrays(store.get(e[i]), i)
        assert store.cached_bytes <= store.budget
    s = store.stats
    assert s.peak_cached_bytes <= store.budget and s.hits + s.misses == 200
    assert len(verified) == s.misses == s.bytes_read // SIZE and s.evictions == s.misses - 2
    # An evicted shard changed on disk is caught when it is needed again, whatever the policy kept.
    victim = next(x for x in e if x.path not in store._cache)
    flip_byte(root / victim.path)
    with raises_exactly(DigestMismatchError):
        store.get(victim)
    store.close()


@pytest.mark.parametrize("policy, a_reads", [("lru", 2), ("lfu", 1), ("lfu-da", 1)])
def test_the_policy_decides_which_shard_is_read_again(model, reads, policy, a_reads):
    root, e = model
    store = make_store(root, budget_shards=2.5, policy=policy)
    a, b, c = e[0], e[1], e[2]
    for x in (a, a, a, b, c, a):  # c evicts a (least recent) under lru, b (least used) under lfu and lfu-da
        store.get(x)
    assert reads[a.path] == a_reads
    store.close()


def test_a_prefetch_is_not_counted_as_a_use(model, reads):
    root, e = model
    store = make_store(root, budget_shards=2.5, policy="lfu")
    a, b, c = e[0], e[1], e[2]
    store.get(a)
    store.get(a)  # a: 2 uses
    store.prefetch([b])
    loading = store._inflight.get(b.path)
    if loading is not None:
        loading.result(10)  # b is cached before it is asked for: the request below is a cache hit
    assert b.path in store._cache
    store.get(b)  # b: 1 use (the prefetch's load and this request are one); 2 would tie a and evict a
    store.get(c)  # evicts b, the least used
    store.get(a)
    assert reads == {a.path: 1, b.path: 1, c.path: 1}
    store.get(b)
    assert reads[b.path] == 2
    store.close()


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_a_trunk_shard_is_evicted_only_when_no_expert_is_cached(tmp_path, reads, policy):
    rel = "trunk/layer-000.safetensors"
    (tmp_path / "trunk").mkdir()
    (tmp_path / rel).write_bytes(shard_bytes(9))
    trunk = Entry(path=rel, kind="trunk", size=SIZE, digest=blake3.blake3(shard_bytes(9)).digest(), layer=0)
    experts = []
    for i in range(3):
        path = f"experts/layer-000/expert-{i:04d}.safetensors"
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(shard_bytes(i))
        experts.append(entry_for(path, shard_bytes(i), i))
    store = make_store(tmp_path, budget_shards=2.5, policy=policy)
    store.get(trunk)  # the oldest and least used shard from here on
    for e in (experts[0], experts[0], experts[1], experts[1], experts[2], experts[0], experts[1]):
        store.get(e)
    assert_arrays(store.get(trunk), 9)
    assert reads[rel] == 1 and store.stats.peak_cached_bytes <= store.budget
    store.close()


def test_the_default_policy_is_named(model):
    root, _ = model
    store = make_store(root)
    assert store.policy == DEFAULT_CACHE_POLICY
    store.close()


def test_cache_never_exceeds_budget_under_parallel_loads(model):
    root, e = model
    store = make_store(root, budget_shards=2.5, readers=4)
    for _ in range(3):
        for got, i in zip(store.get_many(e), range(5)):
            assert_arrays(got, i)
        assert store.cached_bytes <= store.budget
    assert store.stats.peak_cached_bytes <= store.budget
    s = store.stats
    assert s.hits + s.misses == 15 and s.misses >= 11  # at most two of five can stay cached per sweep
    assert s.bytes_read == s.misses * SIZE  # a hit never reads; a miss reads once
    assert s.evictions == s.misses - 2
    store.close()


def test_shard_larger_than_budget_is_used_but_never_cached(model, reads):
    root, e = model
    store = make_store(root, budget_shards=0.5)
    assert_arrays(store.get(e[0]), 0)
    assert_arrays(store.get(e[0]), 0)
    assert reads == {e[0].path: 2} and store.cached_bytes == 0 and store.stats.misses == 2
    store.close()


def test_evicted_shard_is_read_and_verified_again(model, raises_exactly):
    root, e = model
    store = make_store(root, budget_shards=1.5)  # one shard
    store.get(e[0])
    store.get(e[1])  # evicts e[0]
    flip_byte(root / e[0].path)
    with raises_exactly(DigestMismatchError):
        store.get(e[0])
    store.close()


def test_a_shard_read_again_is_verified_again_and_its_header_not_parsed_again(model, reads, header_parses,
                                                                             raises_exactly):
    root, e = model
    parsed = header_parses
    store = make_store(root, budget_shards=1.5)  # one shard
    for _ in range(2):
        assert_arrays(store.get(e[0]), 0)
        assert_arrays(store.get(e[1]), 1)  # evicts e[0]
    # four reads, every one verified; the test shards all have the same header bytes: parsed once
    assert reads == {e[0].path: 2, e[1].path: 2} and len(parsed) == 1
    flip_byte(root / e[0].path)  # a data byte: the header is the remembered one, the digest is not the signed one
    with raises_exactly(DigestMismatchError):
        store.get(e[0])
    store.close()


def test_tamper_while_cached_serves_the_verified_arrays_not_the_new_bytes(model, reads):
    root, e = model
    store = make_store(root)
    first = store.get(e[0])
    (root / e[0].path).write_bytes(shard_bytes(42))  # same size, valid, different values
    again = store.get(e[0])
    assert again is first
    assert_arrays(again, 0)
    assert reads == {e[0].path: 1}
    store.close()


# --- reading once, in parallel, in the background ------------------------------------------------------

def test_bytes_are_read_once_and_the_verified_bytes_are_the_parsed_bytes(model, monkeypatch, reads):
    root, e = model
    verified, parsed = {}, {}  # path -> what the read returned / what parse was given (readers run in parallel)
    real_read, real_parse = store_mod.read_verified_timed, store_mod.parse_shard

    def read(r, entry, *mode):
        verified[entry.path] = real_read(r, entry, *mode)
        return verified[entry.path]

    def parse(entry, data, headers):
        parsed[entry.path] = data
        return real_parse(entry, data, headers)

    monkeypatch.setattr(store_mod, "read_verified_timed", read)
    monkeypatch.setattr(store_mod, "parse_shard", parse)
    store = make_store(root)
    for _ in range(3):
        store.get_many(e[:3])
        store.get(e[3])
    assert reads == {x.path: 1 for x in e[:4]}
    assert store.stats.misses == 4 and store.stats.hits == 8
    assert sorted(verified) == sorted(parsed) == [x.path for x in e[:4]]
    for path, loaded in verified.items():
        assert parsed[path] is loaded.data  # the very buffer that was hashed is parsed, never a fresh read
        assert not loaded.data.flags.writeable
    arrays = store.get(e[0])
    assert all(np.shares_memory(a, verified[e[0].path].data) for a in arrays.values())  # zero-copy views of it
    store.close()


def test_read_verified_timed_hashes_every_byte_across_chunks(tmp_path, monkeypatch, raises_exactly):
    monkeypatch.setattr(files_mod, "READ_CHUNK", 1000)  # many chunks, a short last one
    data = os.urandom(10_500)
    (tmp_path / "f").write_bytes(data)
    entry = Entry(path="f", kind="other", size=len(data), digest=blake3.blake3(data).digest())
    loaded = store_mod.read_verified_timed(tmp_path, entry)
    assert loaded.data.tobytes() == data and loaded.read_seconds > 0 and loaded.hash_seconds > 0
    for offset in (0, 999, 1000, 10_499):  # a flip in any chunk, on either side of a boundary, is caught
        bad = bytearray(data)
        bad[offset] ^= 1
        (tmp_path / "f").write_bytes(bytes(bad))
        with raises_exactly(DigestMismatchError):
            store_mod.read_verified_timed(tmp_path, entry)


def test_get_many_loads_in_parallel_and_keeps_order(model, monkeypatch):
    root, e = model
    readers = 3
    barrier = threading.Barrier(readers, timeout=10)  # breaks (and fails the test) unless 3 reads overlap
    real = store_mod.read_verified_timed

    def together(root_, entry, *mode):
        if entry.expert < readers:
            barrier.wait()
        return real(root_, entry, *mode)

    monkeypatch.setattr(store_mod, "read_verified_timed", together)
    store = make_store(root, readers=readers)
    got = store.get_many([e[2], e[0], e[1], e[4]])
    for arrays, i in zip(got, (2, 0, 1, 4)):
        assert_arrays(arrays, i)
    assert not barrier.broken
    store.close()


def test_get_many_raises_for_a_bad_shard_among_good_ones(model, raises_exactly):
    root, e = model
    flip_byte(root / e[2].path)
    store = make_store(root, readers=3)
    with raises_exactly(DigestMismatchError) as info:
        store.get_many(e)
    assert info.value.path == e[2].path
    store.close()


def test_prefetch_error_surfaces_on_get(model, raises_exactly):
    root, e = model
    flip_byte(root / e[1].path)
    store = make_store(root)
    store.prefetch([e[0], e[1]])
    assert_arrays(store.get(e[0]), 0)
    with raises_exactly(DigestMismatchError):
        store.get(e[1])
    store.close()


def test_get_joins_an_inflight_prefetch_and_gets_its_error(model, monkeypatch, raises_exactly, reads):
    root, e = model
    release = threading.Event()
    real = store_mod.read_verified_timed

    def slow(root_, entry, *mode):
        release.wait(10)
        return real(root_, entry, *mode)

    monkeypatch.setattr(store_mod, "read_verified_timed", slow)
    flip_byte(root / e[1].path)
    store = make_store(root)
    store.prefetch([e[1]])
    threading.Timer(0.2, release.set).start()
    with raises_exactly(DigestMismatchError):
        store.get(e[1])  # waits for the prefetch's read rather than starting another
    assert reads == {e[1].path: 1}
    store.close()


def test_concurrent_gets_of_one_shard_share_one_read(model, monkeypatch, reads):
    root, e = model
    release = threading.Event()
    real = store_mod.read_verified_timed
    monkeypatch.setattr(store_mod, "read_verified_timed",
                        lambda r, entry, *mode: release.wait(10) and real(r, entry, *mode))
    store = make_store(root)
    results = []
    threads = [threading.Thread(target=lambda: results.append(store.get(e[0]))) for _ in range(4)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert reads == {e[0].path: 1}
    store.close()


def test_non_positive_budget_is_refused(tmp_path):
    with pytest.raises(ValueError):
        ShardStore(tmp_path, budget_bytes=0)


def test_files_are_opened_read_only_without_following_links(model):
    root, e = model
    # a directory where a shard should be: refused as not a regular file, not read as garbage
    os.unlink(root / e[0].path)
    os.mkdir(root / e[0].path)
    store = make_store(root)
    with pytest.raises(NotARegularFileError):
        store.get(e[0])
    store.close()


def test_file_changing_size_while_it_is_read_is_a_size_mismatch(tmp_path, monkeypatch, raises_exactly):
    data = os.urandom(5000)
    (tmp_path / "f").write_bytes(data)
    entry = Entry(path="f", kind="other", size=len(data), digest=blake3.blake3(data).digest())
    real_readv, real_read = os.readv, os.read
    # Shrinks after the first chunk (fstat said 5000, then EOF early) ...
    monkeypatch.setattr(files_mod, "READ_CHUNK", 1000)
    calls = []
    monkeypatch.setattr(os, "readv", lambda fd, bufs: real_readv(fd, bufs) if not calls.append(1) and len(calls) == 1
                        else 0)
    with raises_exactly(DigestMismatchError) as info:
        store_mod.read_verified_timed(tmp_path, entry)
    assert (info.value.expected, info.value.actual) == ("5000", "1000")
    # ... or grows: one more byte after the last expected one.
    monkeypatch.setattr(os, "readv", real_readv)
    monkeypatch.setattr(os, "read", lambda fd, n: b"x")
    with raises_exactly(DigestMismatchError) as info:
        store_mod.read_verified_timed(tmp_path, entry)
    assert (info.value.expected, info.value.actual) == ("5000", "5000+")
    monkeypatch.setattr(os, "read", real_read)


def test_request_hands_out_each_shard_as_soon_as_it_alone_is_verified(model, monkeypatch):
    """The forward pass computes expert 0 while expert 1 is still being read and hashed."""
    root, e = model
    release = threading.Event()
    real = store_mod.read_verified_timed

    def slow_second(root_, entry, *mode):
        if entry.path == e[1].path:
            assert release.wait(10), "the first waiter did not return while the second shard was loading"
        return real(root_, entry, *mode)

    monkeypatch.setattr(store_mod, "read_verified_timed", slow_second)
    store = make_store(root, readers=2)
    first, second = store.request([e[0], e[1]])
    assert_arrays(first(), 0)  # returns although shard 1 is blocked mid-load
    release.set()
    assert_arrays(second(), 1)
    assert store.stats.misses == 2 and store.stats.hits == 0
    store.close()


def _counts(store: ShardStore) -> tuple:
    s = store.stats
    return s.hits, s.misses, dict(s.requests), dict(s.request_hits), dict(s.prefetched), dict(s.prefetch_used)


def _warm_with_a_prefetched_shard(store: ShardStore, e: list[Entry]) -> None:
    """Shards 0 and 1 read for use, shard 2 read for a guess (cached, not yet asked for)."""
    store.get_many([e[0], e[1]])
    store.prefetch([e[2]])
    loading = store._inflight.get(e[2].path)
    if loading is not None:
        loading.result(10)
    assert e[2].path in store._cache


def test_cached_hands_out_a_warm_set_counted_as_requests_or_nothing(model, reads):
    """`cached` (a warm decode step's experts) counts each shard as `request` counts a hit, a guess's first use
    included, and reads nothing; with one shard not cached it returns None and counts and touches nothing."""
    root, e = model
    fast, slow = make_store(root, budget_shards=4, policy="lfu"), make_store(root, budget_shards=4, policy="lfu")
    for store in (fast, slow):
        _warm_with_a_prefetched_shard(store, e)
    before = _counts(fast)
    assert fast.cached([e[0], e[3]]) is None  # shard 3 not cached
    assert _counts(fast) == before and e[2].path in fast._unused
    got = fast.cached([e[0], e[2]])
    assert got is not None
    assert_arrays(got[0], 0)
    assert_arrays(got[1], 2)
    for wait in slow.request([e[0], e[2]]):  # the same requests by the general path
        wait()
    assert _counts(fast) == _counts(slow)
    assert fast.stats.prefetch_used == {"expert": 1} and e[2].path not in fast._unused
    assert reads == {x.path: 2 for x in e[:3]}  # once by each store: no read for the warm set
    # the same use counts: the next loads evict the same shards from both
    for store in (fast, slow):
        store.get(e[1])
        store.get(e[3])
        store.get(e[4])
    assert sorted(fast._cache) == sorted(slow._cache)
    fast.close()
    slow.close()


def test_provider_experts_of_a_warm_step_read_nothing(model, reads, monkeypatch):
    """VerifiedWeights.experts hands out cached experts at once, without the stream's requests, when there are at
    most `window` of them; otherwise (one not cached, or more than `window`) the stream reads only what is missing."""
    from shardtool.runtime.engine._provider import VerifiedWeights

    root, e = model
    store = make_store(root, readers=2)
    manifest = type("M", (), {"by_path": lambda self: {x.path: x for x in e}})()
    weights = VerifiedWeights(store, manifest, num_layers=1, window=2)
    store.get_many([e[0], e[1], e[2]])
    requests = []
    real = store.request
    monkeypatch.setattr(store, "request", lambda entries: requests.append(len(entries)) or real(entries))
    warm = weights.experts(0, [0, 1])
    assert list(warm) == [0, 1]
    assert_arrays(warm[0], 0)
    assert_arrays(warm[1], 1)
    assert requests == [] and reads == {x.path: 1 for x in e[:3]}
    wide = weights.experts(0, [0, 1, 2])  # more than `window`: the stream, `window` ahead
    assert [x for i in (0, 1, 2) for x in wide[i]["b"]] == [0] * 3 + [1] * 3 + [2] * 3
    assert requests and reads == {x.path: 1 for x in e[:3]}
    mixed = weights.experts(0, [1, 3])
    assert_arrays(mixed[3], 3)
    assert_arrays(mixed[1], 1)
    assert reads == {**{x.path: 1 for x in e[:3]}, e[3].path: 1}
    assert store.stats.requests == {"expert": 10} and store.stats.request_hits == {"expert": 6}
    store.close()


def test_provider_experts_index_waits_per_expert(model, monkeypatch):
    """VerifiedWeights.experts starts every load and blocks only on the expert being indexed."""
    from shardtool.runtime.engine._provider import VerifiedWeights

    root, e = model
    order = []
    real = store_mod.read_verified_timed

    def traced(root_, entry, *mode):
        got = real(root_, entry, *mode)
        order.append(entry.path)
        return got

    monkeypatch.setattr(store_mod, "read_verified_timed", traced)
    store = make_store(root, readers=2)
    manifest = type("M", (), {"by_path": lambda self: {x.path: x for x in e}})()
    layer = e[0].layer
    ids = [x.expert for x in e if x.layer == layer][:3]
    pending = VerifiedWeights(store, manifest, num_layers=1).experts(layer, ids)
    assert list(pending) == ids and len(pending) == 3
    assert_arrays(pending[ids[0]], 0)
    # The other two were started by experts() itself: they finish without anyone indexing them (closing the store
    # now would cancel a load still queued behind the first, as CI once saw).
    deadline = time.monotonic() + 10
    while len(order) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    store.close()
    assert sorted(order) == sorted(x.path for x in e if x.layer == layer and x.expert in ids)  # all started


def _one_blocked_reader(model, monkeypatch):
    """A store with one reader, held inside its first load (shard 0) until `release` is set; `order` lists the
    paths the reader then loads."""
    root, e = model
    release, started, order = threading.Event(), threading.Event(), []
    real = store_mod.read_verified_timed

    def recording(root_, entry, *mode):
        order.append(entry.path)
        if entry.path == e[0].path:
            started.set()
            assert release.wait(10)
        return real(root_, entry, *mode)

    monkeypatch.setattr(store_mod, "read_verified_timed", recording)
    store = make_store(root, readers=1)
    first = store.request([e[0]])[0]
    assert started.wait(10)
    return store, first, release, order


def test_a_load_the_forward_pass_waits_for_goes_before_queued_guesses(model, monkeypatch):
    _, e = model
    store, first, release, order = _one_blocked_reader(model, monkeypatch)
    store.prefetch([e[1], e[2]])  # guesses, queued behind the blocked load
    wait_3, wait_2 = store.request([e[3], e[2]])  # a demand, and a guess the forward pass now needs (promoted)
    release.set()
    assert_arrays(first(), 0)
    assert_arrays(wait_3(), 3)
    assert_arrays(wait_2(), 2)
    store.get_many([e[1]])
    assert order == [e[0].path, e[3].path, e[2].path, e[1].path]
    s = store.stats
    assert s.misses == 4 and s.prefetched == {"expert": 2} and s.prefetch_used == {"expert": 2}
    store.close()


def test_a_newer_guess_withdraws_queued_stale_guesses(model, monkeypatch, reads):
    _, e = model
    store, first, release, order = _one_blocked_reader(model, monkeypatch)
    store.prefetch([e[1], e[2]])  # layer l's guesses, still queued when layer l + 1's arrive
    store.prefetch([e[2], e[3]])  # e[1] withdrawn (never read), e[2] kept and not queued twice
    assert store.stats.misses == 3 and store.stats.prefetched == {"expert": 2}
    release.set()
    first()
    assert_arrays(store.get(e[3]), 3)
    assert_arrays(store.get(e[2]), 2)
    assert e[1].path not in order
    assert_arrays(store.get(e[1]), 1)  # withdrawn, not lost: asked for, it is read and verified then
    assert order == [e[0].path, e[2].path, e[3].path, e[1].path]
    assert store.stats.misses == 4 and reads[e[1].path] == 1
    store.close()


def test_close_cancels_queued_loads(model, monkeypatch):
    _, e = model
    store, first, release, order = _one_blocked_reader(model, monkeypatch)
    queued = store.request([e[4]])[0]
    closer = threading.Thread(target=store.close)
    closer.start()
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert_arrays(first(), 0)  # the running load finished
    with pytest.raises(Exception):
        queued()  # cancelled, never read
    assert e[4].path not in order


@pytest.mark.parametrize("choice, model, cache, mode", [
    ("auto", 100, 100, "keep"), ("auto", 101, 100, "drop"), ("auto", 0, 1, "keep"),
    ("keep", 10**12, 1, "keep"), ("drop", 1, 10**12, "drop"), ("direct", 1, 1, "direct")])
def test_page_cache_mode_keeps_a_model_the_cache_holds_and_drops_a_streamed_one(choice, model, cache, mode):
    assert store_mod.page_cache_mode(choice, model, cache) == mode


@pytest.mark.parametrize("bad", ["", "AUTO", "mmap", None])
def test_page_cache_mode_refuses_what_it_does_not_know(bad):
    with pytest.raises(ValueError, match="page_cache"):
        store_mod.page_cache_mode(bad, 1, 1)
    with pytest.raises(ValueError, match="page_cache"):
        store_mod.ShardStore(".", budget_bytes=1, page_cache=bad)
