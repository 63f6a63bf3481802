"""The routing policy alone: least load, round-robin ties, prefix affinity and its limits."""

from __future__ import annotations

import pytest

from frontend_svc.engine.router import PrefixAffinity, Router


def test_keys_are_per_complete_block_and_chained() -> None:
    aff = PrefixAffinity(block_size=4)
    assert aff.keys([1, 2, 3]) == []
    a = aff.keys(list(range(10)))
    assert len(a) == 2  # tokens 8, 9 do not fill a block
    b = aff.keys([*range(8), 99, 98, 97, 96])
    assert b[:2] == a and len(b) == 3
    # the same block after a different prefix has a different key
    assert aff.keys([9, 9, 9, 9, 4, 5, 6, 7])[1] != a[1]


def test_lookup_takes_the_longest_live_prefix() -> None:
    aff = PrefixAffinity(block_size=2)
    short, long = aff.keys([1, 2]), aff.keys([1, 2, 3, 4])
    aff.record(short, "a")
    aff.record(long[1:], "b")
    assert aff.lookup(long, {"a": 0, "b": 0}) == ("b", 4)
    assert aff.lookup(long, {"a": 0}) == ("a", 2)  # b is gone: fall back to a's shorter match
    assert aff.lookup(long, {}) == (None, 0)
    aff.forget("a")
    assert aff.lookup(short, {"a": 0, "b": 0}) == (None, 0)


def test_affinity_memory_is_bounded_lru() -> None:
    aff = PrefixAffinity(block_size=1, capacity=3)
    aff.record(aff.keys([1, 2, 3]), "a")
    aff.record(aff.keys([7]), "b")
    assert len(aff) == 3
    assert aff.lookup(aff.keys([7]), {"a": 0, "b": 0}) == ("b", 1)
    assert aff.lookup(aff.keys([1]), {"a": 0, "b": 0}) == (None, 0)  # oldest evicted


def test_least_loaded_wins_and_ties_rotate() -> None:
    r = Router(affinity_min_tokens=0, affinity_max_imbalance=0)
    assert r.choose([1], {"a": 3, "b": 1, "c": 2}).address == "b"
    picks = [r.choose([1], {"a": 0, "b": 0}).address for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]
    with pytest.raises(ValueError):
        r.choose([1], {})


def test_prefix_affinity_until_the_imbalance_limit() -> None:
    r = Router(affinity_min_tokens=8, affinity_max_imbalance=2)
    r.set_block_size(4)
    prefix = list(range(100, 112))  # three blocks
    first = r.choose([*prefix, 1], {"a": 0, "b": 0})
    assert first.affinity_tokens == 0
    home, other = first.address, "b" if first.address == "a" else "a"
    # shared prefix: stays home even when home carries up to 2 more requests
    for home_load in (0, 1, 2):
        c = r.choose([*prefix, 2], {home: home_load, other: 0})
        assert (c.address, c.affinity_tokens) == (home, 12)
    # past the limit balance wins, and the new engine now holds the prefix too
    c = r.choose([*prefix, 3], {home: 3, other: 0})
    assert (c.address, c.affinity_tokens) == (other, 0)
    assert r.choose([*prefix, 4], {home: 0, other: 0}).address == other
    # a match shorter than the minimum is ignored
    r2 = Router(affinity_min_tokens=8, affinity_max_imbalance=100)
    r2.set_block_size(4)
    home2 = r2.choose([1, 2, 3, 4, 5], {"a": 0, "b": 0}).address
    loads = {"a": 0, "b": 0, home2: 1}
    assert r2.choose([1, 2, 3, 4, 9], loads).address != home2


def test_affinity_off_and_forget() -> None:
    r = Router(affinity_min_tokens=0, affinity_max_imbalance=100)
    r.set_block_size(4)
    prompt = list(range(32))
    assert {r.choose(prompt, {"a": 0, "b": 0}).address for _ in range(4)} == {"a", "b"}
    r = Router(affinity_min_tokens=4, affinity_max_imbalance=100)
    r.set_block_size(4)
    home = r.choose(prompt, {"a": 0, "b": 0}).address
    assert {r.choose(prompt, {"a": 0, "b": 0}).address for _ in range(4)} == {home}
    r.forget(home)  # the engine restarted: its cache is empty, no reason to prefer it
    assert r.choose(prompt, {"a": 0, "b": 0}).affinity_tokens == 0
