"""BlockPool: exact block ids, free-queue order, LRU eviction of cached blocks, ref counts."""

from __future__ import annotations

import pytest

from engine_svc.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _h(*tokens: int) -> bytes:
    return hash_block_tokens(None, list(tokens))


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = BlockPool(10)
    assert pool.free_block_ids() == list(range(10))
    assert _ids(pool.allocate(3)) == [0, 1, 2]
    assert _ids(pool.allocate(2)) == [3, 4]
    assert pool.num_free_blocks == 5
    assert pool.free_block_ids() == [5, 6, 7, 8, 9]
    assert all(b.ref_cnt == 1 for b in pool.blocks[:5])
    assert all(b.ref_cnt == 0 for b in pool.blocks[5:])


def test_allocate_zero_and_too_many() -> None:
    pool = BlockPool(4)
    assert pool.allocate(0) == []
    pool.allocate(3)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [3]  # a failed allocation takes nothing


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(10)
    blocks = pool.allocate(4)  # 0 1 2 3
    pool.free([blocks[2], blocks[0]])
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 0]
    pool.free(reversed([blocks[1], blocks[3]]))
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 0, 3, 1]
    assert pool.num_free_blocks == 10


def test_free_queue_order_over_several_rounds() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)  # 0 1
    b = pool.allocate(2)  # 2 3
    pool.free(a)
    assert pool.free_block_ids() == [4, 5, 0, 1]
    c = pool.allocate(3)  # head first: 4 5 0
    assert _ids(c) == [4, 5, 0]
    assert pool.free_block_ids() == [1]
    pool.free(b[::-1])
    pool.free([c[1]])
    assert pool.free_block_ids() == [1, 3, 2, 5]
    assert _ids(pool.allocate(2)) == [1, 3]
    assert pool.free_block_ids() == [2, 5]


def test_usage() -> None:
    pool = BlockPool(10)
    assert pool.usage() == 0.0
    blocks = pool.allocate(4)
    assert pool.usage() == pytest.approx(0.4)
    pool.free(blocks)
    assert pool.usage() == 0.0


def test_cache_publishes_and_lookup_finds() -> None:
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    h = _h(1, 2, 3, 4)
    assert pool.lookup(h) is None
    pool.cache(blk, h)
    assert pool.lookup(h) is blk
    assert blk.block_hash == h


def test_cache_first_writer_wins_and_no_rehash() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    h1, h2 = _h(1), _h(2)
    pool.cache(first, h1)
    pool.cache(second, h1)  # duplicate content: the first block stays the cached one
    assert pool.lookup(h1) is first
    assert second.block_hash is None
    pool.cache(first, h2)  # a block keeps the hash it was published under
    assert first.block_hash == h1
    assert pool.lookup(h2) is None


def test_cache_disabled_publishes_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    (blk,) = pool.allocate(1)
    pool.cache(blk, _h(1))
    assert blk.block_hash is None
    assert pool.lookup(_h(1)) is None


def test_freed_cached_block_stays_cached_until_reallocated() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [_h(i) for i in range(3)]
    for blk, h in zip(blocks, hashes, strict=True):
        pool.cache(blk, h)
    pool.free(blocks)
    assert pool.free_block_ids() == [0, 1, 2]
    assert all(pool.lookup(h) is not None for h in hashes)
    assert pool.num_evictions == 0


def test_eviction_takes_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = [_h(10 + i) for i in range(4)]
    for blk, h in zip(blocks, hashes, strict=True):
        pool.cache(blk, h)
    # Freed in the order 2, 0, 3, 1: block 2 is the least recently freed.
    pool.free([blocks[2], blocks[0]])
    pool.free([blocks[3]])
    pool.free([blocks[1]])
    assert pool.free_block_ids() == [2, 0, 3, 1]

    (got,) = pool.allocate(1)
    assert got.block_id == 2
    assert got.block_hash is None
    assert pool.lookup(hashes[2]) is None
    assert [pool.lookup(h) is not None for h in hashes] == [True, True, False, True]
    assert pool.num_evictions == 1

    assert _ids(pool.allocate(2)) == [0, 3]
    assert [pool.lookup(h) is not None for h in hashes] == [False, True, False, False]
    assert pool.num_evictions == 3


def test_allocating_uncached_blocks_is_not_an_eviction() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], _h(1))
    pool.free(blocks)
    pool.allocate(2)  # blocks 2, 3: never cached
    assert pool.num_evictions == 0
    pool.allocate(2)  # blocks 0 (cached) and 1 (not)
    assert pool.num_evictions == 1


def test_touch_revives_free_cached_block() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    h = _h(7, 7)
    pool.cache(blocks[0], h)
    pool.free(blocks)
    assert pool.free_block_ids() == [2, 3, 4, 0, 1]

    hit = pool.lookup(h)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free_blocks == 4
    assert pool.free_block_ids() == [2, 3, 4, 1]
    # A revived block is never handed out again while in use.
    assert 0 not in _ids(pool.allocate(4))
    assert pool.lookup(h) is hit


def test_touch_in_use_block_only_adds_a_reference() -> None:
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    assert pool.num_free_blocks == 3
    pool.free([blk])
    assert blk.ref_cnt == 1
    assert pool.free_block_ids() == [1, 2, 3]  # still in use: not in the free queue
    pool.free([blk])
    assert blk.ref_cnt == 0
    assert pool.free_block_ids() == [1, 2, 3, 0]


def test_double_free_asserts() -> None:
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([blk])


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], _h(1))
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(_h(1)) is blocks[0]
    pool.free(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(_h(1)) is None
    assert blocks[0].block_hash is None


def test_hash_is_chained_and_content_sensitive() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    b_after_a = hash_block_tokens(a, [5, 6, 7, 8])
    b_after_other = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert b_after_a != b_after_other
    assert b_after_a != hash_block_tokens(None, [5, 6, 7, 8])
