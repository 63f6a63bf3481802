"""Which engine gets a new request: the least loaded, unless one already holds its prompt prefix.

Pure policy, no I/O (the pool and its membership own the connections and feed this the figures).

- Load of an engine = max(requests this gateway has in flight on it, running + waiting from the
  engine's latest load figures). The local count moves the instant a request is sent, so a burst
  spreads out before any figure comes back; the engine's figures add what other gateways sent.
- Prefix affinity: the prompt is cut into KV blocks and every block-aligned prefix gets a chained
  hash, the same shape as the engine's prefix cache keys. The router remembers (LRU, bounded)
  which engine last received each prefix. A request whose longest remembered prefix covers at
  least ``min_tokens`` goes to that engine, as long as it carries at most ``max_imbalance`` more
  requests than the least-loaded one; past that, balance wins over cache hits. A request with a
  LoRA adapter hashes its prefixes under the adapter's name: engines never share KV blocks
  between adapters, so the same prompt under another adapter (or the base model) is a miss.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    address: str
    affinity_tokens: int  # prompt tokens expected to hit that engine's prefix cache (0: none)


class PrefixAffinity:
    """Block-aligned prompt prefix hash -> the engine that last received that prefix."""

    def __init__(self, block_size: int, capacity: int = 65_536) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def keys(self, token_ids: Sequence[int], lora_name: str = "") -> list[int]:
        """One chained hash per complete block of the prompt, shortest prefix first; the chain
        starts from the adapter's name (none: the base model)."""
        b = self.block_size
        h = hash(("lora", lora_name)) if lora_name else 0
        out = []
        for start in range(0, len(token_ids) - b + 1, b):
            h = hash((h, tuple(token_ids[start : start + b])))
            out.append(h)
        return out

    def lookup(self, keys: Sequence[int], live: Mapping[str, object]) -> tuple[str | None, int]:
        """The engine holding the longest remembered prefix among ``live``, and its length."""
        for n in range(len(keys), 0, -1):
            owner = self._owner.get(keys[n - 1])
            if owner is not None and owner in live:
                return owner, n * self.block_size
        return None, 0

    def record(self, keys: Sequence[int], address: str) -> None:
        """``address`` now holds every prefix in ``keys`` (most recently used)."""
        for k in keys:
            self._owner[k] = address
            self._owner.move_to_end(k)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, address: str) -> None:
        """Drop what an engine held (it restarted or left: its cache is gone)."""
        for k in [k for k, a in self._owner.items() if a == address]:
            del self._owner[k]


class Router:
    """Least-loaded choice with prefix affinity; ties go round-robin."""

    def __init__(self, affinity_min_tokens: int, affinity_max_imbalance: int) -> None:
        self.affinity_min_tokens = affinity_min_tokens
        self.affinity_max_imbalance = affinity_max_imbalance
        self.affinity: PrefixAffinity | None = None  # made once the block size is known
        self._turn = itertools.count()

    def set_block_size(self, block_size: int) -> None:
        if self.affinity is None or self.affinity.block_size != block_size:
            self.affinity = PrefixAffinity(block_size)

    def choose(
        self, token_ids: Sequence[int], loads: Mapping[str, int], lora_name: str = ""
    ) -> Choice:
        """Pick one of ``loads`` (address -> load) for a prompt (run with the LoRA adapter
        ``lora_name``; "": the base model) and remember the choice."""
        if not loads:
            raise ValueError("no engine to choose from")
        least = min(loads.values())
        tied = sorted(a for a, load in loads.items() if load == least)
        address = tied[next(self._turn) % len(tied)]
        affinity_tokens = 0
        if self.affinity is not None and self.affinity_min_tokens > 0:
            keys = self.affinity.keys(token_ids, lora_name)
            owner, matched = self.affinity.lookup(keys, loads)
            if (
                owner is not None
                and matched >= self.affinity_min_tokens
                and loads[owner] - least <= self.affinity_max_imbalance
            ):
                address, affinity_tokens = owner, matched
            self.affinity.record(keys, address)
        return Choice(address, affinity_tokens)

    def forget(self, address: str) -> None:
        if self.affinity is not None:
            self.affinity.forget(address)
