"""Per-step attention metadata, built once by the model runner and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one step's flattened batch.

    Requests are ordered decodes first (one query token each), then multi-token ones::

        tokens:           [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]
        query_start_loc:  [0, 1, 2, 3, 7, 9]
        seq_lens:         context length of each request *including* this step's tokens
        block_tables:     [num_reqs, max_blocks] block ids; entries past a request's own blocks
                          are stale (valid ids, never read: they lie past its context)
        slot_mapping:     [num_tokens] cache slot each new K/V is written to
    """

    num_reqs: int
    num_decodes: int
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64, on device
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32 (int64 in some tests), on device
    seq_lens: torch.Tensor  # [num_reqs] on device
    query_start_loc: torch.Tensor  # [num_reqs + 1] on device
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_decode_seq_len: int
    max_seq_len: int
