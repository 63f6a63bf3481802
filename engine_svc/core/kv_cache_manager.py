"""The KV cache manager: three verbs over a ``BlockPool``.

    get_computed_blocks(request)  -> blocks of the longest cached prefix, and its token count
    allocate_slots(request, n, …) -> new blocks so n more tokens fit, or None when full
    free(request)                 -> give every block of the request back

Block ownership lives here (request id -> block list), never on the request itself.

    request tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
    block list:      [   b7    ][   b2     ][   b9     ]      block_size = 16
    slot of token i: block_list[i // 16] * 16 + i % 16
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_svc.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from engine_svc.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_root(lora_id: int) -> BlockHash | None:
    """The parent of a request's first block hash: None for the base model, else a value of
    the adapter's engine id (never reused, so an adapter added again under an old name does
    not read the KV of the old weights either)."""
    return None if lora_id == 0 else b"lora:" + str(lora_id).encode()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache

    def reset(self) -> PrefixCacheStats:
        snapshot = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return snapshot


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Chained hashes of each request's full blocks, kept so decode only hashes new blocks.
        self.req_hashes: dict[str, list[BlockHash]] = {}
        # How many of each request's leading blocks are published to the prefix cache already,
        # so a step publishes only the blocks that became full (O(new blocks), not O(blocks)).
        self.num_published: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of every full block of the request's tokens, computed incrementally.

        The chain starts from the request's LoRA adapter (``chain_root``): the same tokens under
        two adapters (or an adapter and the base model) have different KV and never share a
        block."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else chain_root(request.lora_id)
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def _uses_cache(self, request: Request) -> bool:
        # Prompt logprobs (logits at every prompt position) and MEAN / CLS pooling (every
        # position's hidden state) compute the whole prompt. Their blocks are still published.
        return self.enable_caching and not request.skips_prefix_cache

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks already in the prefix cache.

        At least one token is always left to compute, so the model produces logits for the
        next token (or a LAST-pooling request its last hidden state) even when the whole prompt
        is cached.
        """
        if not self._uses_cache(request):
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` (from ``get_computed_blocks``, first allocation only) are shared, not
        copied. Returns the newly allocated blocks, or None — changing nothing — when the pool
        cannot supply them. Full blocks are published to the prefix cache as they fill.

        ``num_lookahead_tokens``: slots past the new tokens that a draft model writes its KV
        at this step (its proposals' positions, vLLM's lookahead); they hold no token of the
        request yet, so they never make a block full for the prefix cache::

            computed | new (this step) | lookahead (draft only, written over later)
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        blocks = self.req_blocks.get(request.request_id, [])
        if blocks and not computed_blocks:
            # The decode step's common case, taken first (it runs for every running request every
            # step): the new tokens fit the blocks held and fill none not yet published.
            total = request.num_computed_tokens + num_new_tokens
            if total + num_lookahead_tokens <= len(blocks) * self.block_size and (
                not self.enable_caching
                or total // self.block_size <= self.num_published.get(request.request_id, 0)
            ):
                return []
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + (
            len(computed_blocks) * self.block_size if not blocks else 0
        )
        total_tokens = num_computed + num_new_tokens
        num_needed = (
            cdiv(total_tokens + num_lookahead_tokens, self.block_size)
            - len(blocks)
            - len(computed_blocks)
        )
        # Cached blocks with no other user sit in the free queue: taking them costs free slots.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None

        if not blocks and self._uses_cache(request):
            # Counted once per admission, not per look-up of a request that did not fit.
            self.stats.queries += request.num_tokens
            self.stats.hits += len(computed_blocks) * self.block_size
        if computed_blocks:
            self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)

        if self.enable_caching:
            # Publish blocks that are full once this step's tokens are written. Their tokens are
            # known now (prompt, or sampled earlier), so the hash can be computed already.
            rid = request.request_id
            hashes = self._block_hashes(request)
            num_full = min(total_tokens // self.block_size, len(hashes))
            # Blocks found in the prefix cache are published already.
            done = self.num_published.get(rid, len(computed_blocks))
            for i in range(done, num_full):
                self.pool.cache(blocks[i], hashes[i])
            self.num_published[rid] = max(done, num_full)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return every block of the request, last block first: tails are evicted before the
        prefixes other requests may share."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.num_published.pop(request.request_id, None)
        # Fix: allocate_slots publishes blocks before the step that fills them runs. A request
        # freed before that step ran (a priority-preemption victim undone in the very step that
        # scheduled it) would leave hashes naming KV that was never written, and a later prefix
        # hit would read it. Only blocks within num_computed_tokens keep their hash.
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            self.pool.uncache(block)
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
