"""KVCacheManager: which block ids each verb hands out, prefix hits, eviction order on free."""

from __future__ import annotations

import pytest

from engine_svc.core.block_pool import hash_block_tokens
from engine_svc.core.kv_cache_manager import KVCacheManager, cdiv
from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams

BS = 4
PREFIX = [11, 12, 13, 14, 21, 22, 23, 24]  # two full blocks


def _req(rid: str, tokens: list[int], **params: object) -> Request:
    return Request(rid, tokens, SamplingParams(**params))  # type: ignore[arg-type]


def _ids(blocks: list | None) -> list[int] | None:  # type: ignore[type-arg]
    return None if blocks is None else [b.block_id for b in blocks]


def _admit(kv: KVCacheManager, req: Request) -> list[int]:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    hits, num_computed = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_computed, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in new]


def _decode(kv: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """Append a sampled token and make room for it (the next step's one new token)."""
    req.append_output_token(token)
    new = kv.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return _ids(new)


def _probe_hits(kv: KVCacheManager, tokens: list[int], rid: str) -> tuple[list[int], int]:
    hits, n = kv.get_computed_blocks(_req(rid, tokens))
    return [b.block_id for b in hits], n


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(10, 0)


def test_allocate_returns_exact_new_block_ids() -> None:
    kv = KVCacheManager(10, BS)
    r1 = _req("r1", list(range(100, 110)))  # 10 tokens -> 3 blocks
    assert _ids(kv.allocate_slots(r1, 10)) == [0, 1, 2]
    r1.num_computed_tokens = 10
    assert kv.get_block_ids("r1") == [0, 1, 2]
    assert kv.num_free_blocks == 7

    r2 = _req("r2", list(range(200, 205)))
    assert _ids(kv.allocate_slots(r2, 5)) == [3, 4]

    assert _decode(kv, r1, 1) == []  # token 10 -> block 2 slot 2
    assert _decode(kv, r1, 2) == []  # token 11 -> block 2 slot 3
    assert _decode(kv, r1, 3) == [5]  # token 12 -> new block
    assert kv.get_block_ids("r1") == [0, 1, 2, 5]
    assert kv.num_free_blocks == 4


def test_chunked_allocation_grows_block_list() -> None:
    kv = KVCacheManager(10, BS)
    r = _req("r", list(range(100, 110)))
    assert _ids(kv.allocate_slots(r, 3)) == [0]
    r.num_computed_tokens = 3
    assert _ids(kv.allocate_slots(r, 4)) == [1]
    r.num_computed_tokens = 7
    assert _ids(kv.allocate_slots(r, 3)) == [2]
    assert kv.get_block_ids("r") == [0, 1, 2]


def test_allocate_none_when_full_changes_nothing() -> None:
    kv = KVCacheManager(4, BS)
    r1 = _req("r1", list(range(100, 112)))
    assert _ids(kv.allocate_slots(r1, 12)) == [0, 1, 2]
    r2 = _req("r2", list(range(200, 208)))
    assert kv.allocate_slots(r2, 8) is None
    assert kv.num_free_blocks == 1
    assert kv.get_block_ids("r2") == []
    assert kv.pool.free_block_ids() == [3]
    r3 = _req("r3", [1, 2, 3, 4])
    assert _ids(kv.allocate_slots(r3, 4)) == [3]
    assert kv.allocate_slots(_req("r4", [5]), 1) is None
    assert kv.num_free_blocks == 0


def test_allocate_rejects_non_positive_token_count() -> None:
    kv = KVCacheManager(4, BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(_req("r", [1]), 0)


def test_prefix_hit_returns_the_same_block_ids() -> None:
    kv = KVCacheManager(10, BS)
    r1 = _req("r1", PREFIX + [31, 32])
    assert _admit(kv, r1) == [0, 1, 2]

    r2 = _req("r2", PREFIX + [41, 42, 43])
    hits, num_computed = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1]
    assert num_computed == 8
    assert _ids(kv.allocate_slots(r2, 3, hits)) == [3]
    assert kv.get_block_ids("r2") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert kv.num_free_blocks == 6


def test_whole_prompt_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(10, BS)
    _admit(kv, _req("r1", list(PREFIX)))
    # Same 8-token prompt: only the first block is reused, the last block is recomputed.
    assert _probe_hits(kv, list(PREFIX), "r2") == ([0], 4)
    # One more token and both blocks are reused.
    assert _probe_hits(kv, PREFIX + [99], "r3") == ([0, 1], 8)
    # A prompt ending inside the first block reuses nothing.
    assert _probe_hits(kv, PREFIX[:4], "r4") == ([], 0)


def test_whole_prompt_hit_allocation() -> None:
    kv = KVCacheManager(10, BS)
    _admit(kv, _req("r1", list(PREFIX)))
    r2 = _req("r2", list(PREFIX))
    hits, n = kv.get_computed_blocks(r2)
    assert _ids(kv.allocate_slots(r2, r2.num_tokens - n, hits)) == [2]
    assert kv.get_block_ids("r2") == [0, 2]


def test_hashes_are_chained_over_the_prefix() -> None:
    kv = KVCacheManager(10, BS)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    _admit(kv, _req("r1", a + b + c + [0]))
    # Block b after a different first block is a different block.
    assert _probe_hits(kv, [4, 3, 2, 1] + b + c + [0], "p1") == ([], 0)
    # Same first block, different second: the third block does not hit either.
    assert _probe_hits(kv, a + [8, 7, 6, 5] + c + [0], "p2") == ([0], 4)
    assert _probe_hits(kv, a + b + c + [0], "p3") == ([0, 1, 2], 12)
    assert kv.pool.lookup(hash_block_tokens(None, b)) is None


def test_free_returns_blocks_last_first() -> None:
    kv = KVCacheManager(10, BS)
    r1 = _req("r1", list(range(100, 110)))
    _admit(kv, r1)
    kv.free(r1)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.get_block_ids("r1") == []
    assert kv.num_free_blocks == 10
    kv.free(r1)  # a second free of a released request is a no-op
    assert kv.num_free_blocks == 10


def test_tails_are_evicted_before_shared_prefix() -> None:
    kv = KVCacheManager(10, BS)
    tail1, tail2 = [31, 32, 33, 34], [41, 42, 43, 44]
    r1 = _req("r1", PREFIX + tail1)
    r2 = _req("r2", PREFIX + tail2)
    assert _admit(kv, r1) == [0, 1, 2]
    assert _admit(kv, r2) == [3]  # blocks 0, 1 shared
    assert kv.get_block_ids("r2") == [0, 1, 3]

    kv.free(r1)  # only the unshared tail joins the free queue
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    kv.free(r2)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]

    # A 7-block request evicts the six never-used blocks and then r1's tail (block 2).
    big = _req("big", list(range(500, 528)))
    assert _admit(kv, big) == [4, 5, 6, 7, 8, 9, 2]
    assert _probe_hits(kv, PREFIX + tail1 + [0], "p1") == ([0, 1], 8)
    assert _probe_hits(kv, PREFIX + tail2 + [0], "p2") == ([0, 1, 3], 12)
    assert kv.pool.num_evictions == 1


def test_eviction_order_after_free_and_reuse() -> None:
    kv = KVCacheManager(10, BS)
    r1 = _req("r1", PREFIX + [31, 32, 33, 34])
    _admit(kv, r1)  # 0 1 2
    kv.free(r1)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    # Reuse the prefix: blocks 0, 1 leave the free queue, the new block comes from its head.
    r2 = _req("r2", PREFIX + [51, 52])
    assert _admit(kv, r2) == [3]
    assert kv.get_block_ids("r2") == [0, 1, 3]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    kv.free(r2)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_revived_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(4, BS)
    r1 = _req("r1", PREFIX + [31, 32, 33, 34])
    _admit(kv, r1)  # 0 1 2, all three full and cached
    other = _req("other", [7])
    assert _admit(kv, other) == [3]
    kv.free(r1)
    assert kv.pool.free_block_ids() == [2, 1, 0]

    # 13 tokens: 2 cached blocks revived + 2 new = 4 > 3 free -> None, nothing touched.
    r2 = _req("r2", PREFIX + [41, 42, 43, 44, 45])
    hits, n = kv.get_computed_blocks(r2)
    assert ([b.block_id for b in hits], n) == ([0, 1], 8)
    assert kv.allocate_slots(r2, 5, hits) is None
    assert kv.pool.free_block_ids() == [2, 1, 0]
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 0, 1]
    assert kv.get_block_ids("r2") == []

    # 12 tokens: 2 revived + 1 new = 3 -> fits; the new block evicts r1's cached tail.
    r3 = _req("r3", PREFIX + [41, 42, 43, 44])
    hits, n = kv.get_computed_blocks(r3)
    assert _ids(kv.allocate_slots(r3, 4, hits)) == [2]
    assert kv.get_block_ids("r3") == [0, 1, 2]
    assert kv.num_free_blocks == 0
    assert _probe_hits(kv, PREFIX + [31, 32, 33, 34, 0], "p") == ([0, 1], 8)


def test_decode_publishes_blocks_as_they_fill() -> None:
    kv = KVCacheManager(10, BS)
    r1 = _req("r1", [1, 2, 3, 4, 5, 6])
    assert _admit(kv, r1) == [0, 1]
    assert _probe_hits(kv, [1, 2, 3, 4, 5, 6, 70, 80, 0], "p1") == ([0], 4)
    assert _decode(kv, r1, 70) == []
    assert _probe_hits(kv, [1, 2, 3, 4, 5, 6, 70, 80, 0], "p2") == ([0], 4)
    assert _decode(kv, r1, 80) == []  # block 1 fills with this step's token
    assert _probe_hits(kv, [1, 2, 3, 4, 5, 6, 70, 80, 0], "p3") == ([0, 1], 8)


def test_each_step_publishes_only_the_blocks_that_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing is O(new blocks) per step, not O(all blocks of the request): decoding 400
    tokens publishes each full block once (it used to re-publish every full block every step)."""
    kv = KVCacheManager(200, BS)
    calls: list[int] = []
    real = kv.pool.cache
    monkeypatch.setattr(kv.pool, "cache", lambda b, h: (calls.append(b.block_id), real(b, h)))
    r1 = _req("r1", [1, 2, 3, 4, 5, 6])
    _admit(kv, r1)
    assert calls == [0]
    for i in range(400):
        _decode(kv, r1, 100 + i % 50)
    assert len(calls) == len(set(calls)) == (6 + 400) // BS
    # A request resuming from the prefix cache does not publish its hits again.
    r2 = _req("r2", r1.all_token_ids[:40] + [7])
    calls.clear()
    _admit(kv, r2)
    assert calls == []  # blocks 0..9 are hits; the tail block is not full


def test_a_decode_step_that_fills_no_block_takes_the_short_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode step's common case (room left in the last block, nothing to publish) neither
    hashes nor allocates; the step whose token fills a block still publishes it, and the next
    block is taken when the token after it comes."""
    kv = KVCacheManager(10, BS)
    r1 = _req("r1", [1, 2, 3, 4, 5])
    assert _admit(kv, r1) == [0, 1]
    hashed: list[str] = []
    real = kv._block_hashes
    monkeypatch.setattr(kv, "_block_hashes", lambda r: (hashed.append(r.request_id), real(r))[1])
    assert _decode(kv, r1, 60) == [] and hashed == []  # 6 of 8 slots
    assert _decode(kv, r1, 70) == [] and hashed == []  # 7 of 8
    assert _decode(kv, r1, 80) == [] and hashed == ["r1"]  # 8 of 8: block 1 fills, published
    assert _probe_hits(kv, [1, 2, 3, 4, 5, 60, 70, 80, 0], "p") == ([0, 1], 8)
    assert _decode(kv, r1, 90) == [2]  # the 9th token needs a third block
    assert kv.get_block_ids("r1") == [0, 1, 2]


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(10, BS, enable_caching=False)
    r1 = _req("r1", PREFIX + [31])
    assert _admit(kv, r1) == [0, 1, 2]
    assert _probe_hits(kv, PREFIX + [31], "p") == ([], 0)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    r2 = _req("r2", PREFIX + [31])
    assert _admit(kv, r2) == [3, 4, 5]


def test_prompt_logprobs_request_skips_the_cache() -> None:
    kv = KVCacheManager(10, BS)
    _admit(kv, _req("r1", PREFIX + [31]))
    kv.stats.reset()
    r2 = _req("r2", PREFIX + [31], prompt_logprobs=1)
    assert kv.get_computed_blocks(r2) == ([], 0)
    assert kv.stats.queries == 0 and kv.stats.hits == 0
    assert _admit(kv, r2) == [3, 4, 5]


def test_prefix_stats_count_queries_and_hits() -> None:
    kv = KVCacheManager(10, BS)
    _admit(kv, _req("r1", PREFIX + [31, 32]))  # 10 tokens, no hit
    assert (kv.stats.queries, kv.stats.hits) == (10, 0)
    _admit(kv, _req("r2", PREFIX + [41, 42, 43]))  # 11 tokens, 8 hit
    assert (kv.stats.queries, kv.stats.hits) == (21, 8)
    snap = kv.stats.reset()
    assert (snap.queries, snap.hits) == (21, 8)
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(10, BS)
    r1 = _req("r1", PREFIX + [31])
    _admit(kv, r1)
    assert kv.reset_prefix_cache() is False
    kv.free(r1)
    assert kv.reset_prefix_cache() is True
    assert _probe_hits(kv, PREFIX + [31], "p") == ([], 0)


def test_usage_and_unknown_request() -> None:
    kv = KVCacheManager(10, BS)
    assert kv.get_block_ids("nope") == []
    _admit(kv, _req("r1", list(range(100, 110))))
    assert kv.usage() == pytest.approx(0.3)
    assert kv.num_blocks == 10


def test_free_withdraws_hashes_of_blocks_never_computed() -> None:
    """Blocks are published at allocation, before their step runs. A request freed before that
    step ran (the scheduler undoing a preemption victim) keeps only hashes of computed blocks."""
    kv = KVCacheManager(10, BS)
    r = _req("r", PREFIX + [31, 32, 33, 34, 35])
    assert _ids(kv.allocate_slots(r, 4)) == [0]
    r.num_computed_tokens = 4
    assert _ids(kv.allocate_slots(r, 9)) == [1, 2, 3]  # publishes blocks 1 and 2 already
    assert _probe_hits(kv, PREFIX + [31, 32, 33, 34, 0], "p1") == ([0, 1, 2], 12)
    kv.free(r)  # the 9-token step never ran: r.num_computed_tokens is still 4
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    assert _probe_hits(kv, PREFIX + [31, 32, 33, 34, 0], "p2") == ([0], 4)
    assert [b.block_hash is not None for b in kv.pool.blocks[:4]] == [True, False, False, False]
