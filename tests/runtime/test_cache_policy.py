"""The shard cache's eviction policies, on hand-made sequences whose victims differ between policies, and
LFU-DA against a direct transcription of its definition on random sequences."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from shardtool.runtime import CACHE_POLICIES, DEFAULT_CACHE_POLICY
from shardtool.runtime.store._cache_policy import LFU, CacheIndex, make_policy


def simulate(policy: str, capacity: int, keys: Sequence[str]) -> list[str]:
    """A cache of `capacity` one-sized items over a sequence of uses; returns the victims in order."""
    p = make_policy(policy)
    cached: set[str] = set()
    victims = []
    for key in keys:
        if key in cached:
            p.touch(key)
            continue
        if len(cached) >= capacity:
            victim = p.victim()
            cached.remove(victim)
            victims.append(victim)
        cached.add(key)
        p.admit(key)
    return victims


def test_the_default_is_one_of_the_policies():
    assert DEFAULT_CACHE_POLICY in CACHE_POLICIES == ("lru", "lfu", "lfu-da")


def test_lru_evicts_the_least_recently_used():
    # a is used three times, then b and c once: LRU drops a (oldest use), LFU keeps it (most uses).
    assert simulate("lru", 2, "aaabc") == ["a"]
    assert simulate("lfu", 2, "aaabc") == ["b"]


def test_lru_order_follows_touches():
    p = make_policy("lru")
    for key in "abc":
        p.admit(key)
    p.touch("a")
    assert [p.victim() for _ in range(3)] == ["b", "c", "a"]
    assert len(p) == 0


def test_lfu_evicts_the_least_used_and_breaks_ties_by_recency():
    p = make_policy("lfu")
    for key in "abcd":
        p.admit(key)
    p.touch("a")
    p.touch("a")
    p.touch("c")
    p.touch("b")  # b and c both used twice; c's last use is older
    assert [p.victim() for _ in range(4)] == ["d", "c", "b", "a"]


def test_lfu_keeps_a_once_popular_key_forever_and_lfu_da_ages_it_out():
    # a is used 3 times (K = 3), then each new key is used twice. Under LFU a is never evicted again; under
    # LFU-DA the cache's age L climbs to a's priority and a goes.
    seq = "aaa" + "bb" + "cc" + "dd"
    assert simulate("lfu", 2, seq) == ["b", "c"]
    assert simulate("lfu-da", 2, seq) == ["b", "a"]
    assert simulate("lru", 2, seq) == ["a", "b"]


def test_lfu_da_priority_is_uses_plus_the_age_of_the_last_eviction():
    p = LFU(aging=True)
    p.admit("a")
    p.touch("a")
    p.touch("a")
    assert (p.priority("a"), p.age) == (3, 0)
    p.admit("b")
    p.touch("b")
    assert p.victim() == "b" and p.age == 2  # L := K of the evicted key
    p.admit("c")
    assert p.priority("c") == 1 + 2  # K = F + L at admission
    assert p.priority("a") == 3  # a key's K is computed when it is used, not when L moves
    p.touch("a")
    assert p.priority("a") == 4 + 2
    p.touch("c", use=False)  # a prefetch: recency and the current age, no use counted
    assert p.priority("c") == 3
    assert p.victim() == "c" and p.age == 3


def test_a_touch_without_use_is_not_counted_by_lfu():
    p = make_policy("lfu")
    p.admit("a")
    p.admit("b")
    for _ in range(5):
        p.touch("a", use=False)
    p.touch("b")
    assert p.victim() == "a"


def _lfu_da_by_definition(capacity: int, keys: list[str]) -> list[str]:
    """Arlitt et al.'s LFU-DA written out directly: K = F + L recomputed on each use, evict the smallest K (the
    least recently used among equal K), L := the victim's K."""
    age, clock = 0, 0
    state: dict[str, list[int]] = {}  # key -> [K, F, last use]
    victims = []
    for key in keys:
        clock += 1
        if key in state:
            k = state[key]
            k[1] += 1
            k[0], k[2] = k[1] + age, clock
            continue
        if len(state) >= capacity:
            victim = min(state, key=lambda x: (state[x][0], state[x][2]))
            age = state.pop(victim)[0]
            victims.append(victim)
        state[key] = [1 + age, 1, clock]
    return victims


@pytest.mark.parametrize("seed", range(5))
def test_lfu_da_matches_its_definition_on_random_sequences(seed):
    rng = random.Random(seed)
    alphabet = [f"k{i}" for i in range(40)]
    keys = [rng.choice(alphabet[:rng.choice([5, 40])]) if rng.random() < 0.9 else rng.choice(alphabet)
            for _ in range(3000)]
    victims = simulate("lfu-da", 8, keys)
    assert victims == _lfu_da_by_definition(8, keys) and len(victims) > 100


def test_victim_of_an_empty_cache_and_unknown_names_are_errors():
    for name in CACHE_POLICIES:
        p = make_policy(name)
        p.admit("x")
        assert p.victim() == "x"
        with pytest.raises((LookupError, KeyError)):
            p.victim()
    with pytest.raises(ValueError, match="unknown cache policy 'mru'"):
        make_policy("mru")


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_index_evicts_experts_before_any_trunk_shard_and_keeps_the_budget(policy):
    index = CacheIndex(policy, budget=100)
    assert index.insert("t0", 30, expert=False) == []
    assert index.insert("e0", 20, expert=True) == []
    assert index.insert("e1", 20, expert=True) == []
    for _ in range(3):
        index.touch("e0")  # e0 and e1 are used far more often than t0...
        index.touch("e1")
    assert index.insert("t1", 30, expert=False) == []  # 100 of 100
    # ...yet a new shard evicts the experts first, whatever the policy's order among them.
    evicted = index.insert("e2", 40, expert=True)
    assert sorted(evicted) == ["e0", "e1"] and index.used == 100
    # Only experts left to go: the new expert's room comes from e2, not from the trunk.
    assert index.insert("e3", 40, expert=True) == ["e2"]
    # With no expert cached but e3, the trunk evicts by the policy too, once experts are gone.
    assert index.insert("t2", 70, expert=False) == ["e3", "t0"] and index.used == 100
    assert "t1" in index and "t2" in index and len(index) == 2


def test_index_never_caches_a_key_bigger_than_the_budget():
    index = CacheIndex("lru", budget=50)
    assert index.insert("a", 30, expert=True) == []
    assert index.insert("big", 51, expert=True) is None
    assert "big" not in index and "a" in index and index.used == 30
