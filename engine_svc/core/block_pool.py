"""Fixed-size KV blocks: reference counts, an LRU free queue, and the prefix-cache map.

Every block is always in exactly one of three states:

    in use          ref_cnt > 0                 (not in the free queue)
    free, cached    ref_cnt == 0, hash set      (in the free queue; a prefix hit revives it)
    free, empty     ref_cnt == 0, hash None     (in the free queue)

The free queue is in eviction order: allocation takes from its head, ``free`` appends to its tail,
so the least recently freed cached block is evicted first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: it names the block's tokens *and* every token before it.

    sha256 rather than Python's ``hash`` so one tenant cannot craft a collision that reads another
    tenant's cached KV.
    """
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """Owns every block; hands them out and takes them back."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, head = next to allocate / evict.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue in eviction order (for tests and debugging)."""
        return list(self._free)

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its chained hash. First writer wins on duplicates."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Withdraw a block's hash (its KV was never written); the block itself is untouched."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference; blocks reaching zero join the tail of the free queue in order."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget the hash of every free block (its KV stays where it is, unreachable): a later
        request computes its prompt again. Blocks in use keep theirs; returns False when some
        were in use (their entries stay), True when every entry is gone."""
        for block in self._free.values():
            if block.block_hash is not None:
                self.uncache(block)
        return len(self._free) == self.num_blocks
