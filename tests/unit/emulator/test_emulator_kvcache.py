"""Paged KV cache: block accounting, prefix lookup, LRU eviction of unreferenced blocks."""

from __future__ import annotations

import pytest

from fastroute.emulator.kvcache import KVCache


def test_allocate_and_free_private_blocks():
    """Private blocks come from the free pool and go back to it; usage follows."""
    kv = KVCache(10)
    assert kv.allocate(4)
    assert (kv.num_free, kv.num_used, kv.usage) == (6, 4, 0.4)
    assert not kv.allocate(7)
    assert kv.num_free == 6  # a failed allocation changes nothing
    kv.free(4)
    assert kv.num_free == 10 and kv.usage == 0.0


def test_named_blocks_stay_cached_after_release():
    """A released named block is evictable, still found by lookup, and counts as not used."""
    kv = KVCache(8)
    kv.allocate(3)
    for h in (11, 12, 13):
        kv.name_block(h)
    assert kv.num_used == 3 and kv.num_cached == 3
    kv.release([11, 12, 13])
    assert kv.num_used == 0 and kv.num_evictable == 3 and kv.num_available == 8
    assert kv.lookup([11, 12, 99], max_blocks=10) == (2, 2)
    assert kv.lookup([11, 12, 13], max_blocks=1) == (1, 1)


def test_acquire_makes_blocks_unevictable():
    """Referencing a cached block takes it out of the LRU until released again."""
    kv = KVCache(4)
    kv.allocate(2)
    kv.name_block(1)
    kv.name_block(2)
    kv.release([1, 2])
    kv.acquire([1])
    assert kv.num_evictable == 1 and kv.num_used == 1
    assert kv.lookup([1, 2], 5) == (2, 1)


def test_eviction_takes_least_recently_released_first():
    """When free blocks run out, allocation evicts the oldest unreferenced cached block."""
    kv = KVCache(3)
    kv.allocate(3)
    for h in (1, 2, 3):
        kv.name_block(h)
    kv.release([2])
    kv.release([1])
    kv.release([3])
    assert kv.allocate(1)  # evicts 2, the first released
    assert kv.lookup([2], 5) == (0, 0)
    assert kv.lookup([1], 5) == (1, 1)
    assert kv.allocate(2)  # evicts 1 then 3
    assert kv.num_cached == 0 and kv.num_free == 0 and not kv.allocate(1)


def test_naming_an_existing_hash_shares_it_and_frees_the_copy():
    """Two requests computing the same block end up sharing one block."""
    kv = KVCache(4)
    kv.allocate(2)
    kv.name_block(5)
    kv.name_block(5)
    assert kv.num_used == 1 and kv.num_free == 3
    kv.release([5])
    assert kv.num_used == 1
    kv.release([5])
    assert kv.num_used == 0 and kv.num_evictable == 1


def test_capacity_must_be_positive():
    """A cache without blocks is a configuration error."""
    with pytest.raises(ValueError):
        KVCache(0)
