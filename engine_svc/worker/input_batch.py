"""The model runner's persistent batch: one row per running request, kept from step to step.

A step builds its inputs from these rows with a few vectorized numpy operations instead of
walking every request's token and block lists, so its cost follows what changed, not how much
context the batch holds. A request gets a row when the scheduler admits it (new, or back after a
preemption: everything is copied in once) and loses it when it finishes or is preempted; the last
row moves into the hole, so rows [0, num_rows) stay dense::

    row   req   token_ids (prompt + sampled)      num_tokens   block_table        num_blocks
    0     a     [t t t t t t t t t . . . .]       9            [7 2 9 . . .]      3
    1     c     [t t t t . . . . . . . . .]       4            [4 . . . . .]      1
    2     b     [t t t t t t t . . . . . .]       7            [1 5 . . . .]      2

Per step only new blocks are appended (``ScheduledRequest.block_ids``) and the token the runner
sampled is written where it belongs. Penalty state (token counts of each row's output, and the
prompt-or-output mask) lives on the device and is updated in place as tokens are sampled.
A row's allowed-token mask is written to the device once, when the row is added; its logit bias
(as two small arrays) and bad words stay on the host. A row moves its own state only: rows
without penalties, allowed token ids, bias or bad words carry none of it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.core.request import Request
from engine_svc.worker.uploads import upload


class InputBatch:
    def __init__(
        self,
        max_rows: int,
        max_model_len: int,
        max_blocks_per_row: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = device
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_rows, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_rows, dtype=np.int32)
        self.block_table = np.zeros((max_rows, max_blocks_per_row), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int32)
        # Sampling parameters, one entry per row.
        self.temperature = np.ones(max_rows, dtype=np.float32)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.top_k = np.zeros(max_rows, dtype=np.int32)  # 0: disabled
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.presence = np.zeros(max_rows, dtype=np.float32)
        self.frequency = np.zeros(max_rows, dtype=np.float32)
        self.repetition = np.ones(max_rows, dtype=np.float32)
        self.has_penalty = np.zeros(max_rows, dtype=bool)
        self.min_tokens = np.zeros(max_rows, dtype=np.int32)
        self.has_grammar = np.zeros(max_rows, dtype=bool)  # structured output: a matcher masks it
        self.is_pooling = np.zeros(max_rows, dtype=bool)  # a pooling request: never samples
        self.lora_id = np.zeros(max_rows, dtype=np.int64)  # its LoRA adapter's id (0: none)
        self.has_allowed = np.zeros(max_rows, dtype=bool)  # allowed_token_ids: see allowed_mask
        self.has_bias = np.zeros(max_rows, dtype=bool)
        self.has_bad_words = np.zeros(max_rows, dtype=bool)
        # logit_bias of each row with one: (token ids int64, values float32).
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_rows
        # bad words of each row with them: (all but the last token, the last token).
        self.bad_words: list[list[tuple[list[int], int]] | None] = [None] * max_rows
        self.requests: list[Request | None] = [None] * max_rows
        self.row_of: dict[str, int] = {}
        self.num_rows = 0
        # [max_rows, vocab] on the device, made when the first request with a penalty arrives.
        self.output_counts: torch.Tensor | None = None
        self.seen_mask: torch.Tensor | None = None
        # [max_rows, vocab] bool on the device (True: may be sampled), made when the first
        # request with allowed_token_ids arrives; only rows with has_allowed are meaningful.
        self.allowed_mask: torch.Tensor | None = None

    # ------------------------------------------------------------------ rows in and out
    def add(self, request: Request, block_ids: list[int]) -> int:
        """Give ``request`` a row holding all its tokens and ``block_ids`` (all its blocks)."""
        rid = request.request_id
        if rid in self.row_of:
            raise ValueError(f"request {rid!r} already has a row")
        if self.num_rows == self.max_rows:
            raise RuntimeError(f"the persistent batch is full ({self.max_rows} rows)")
        row = self.num_rows
        self.num_rows += 1
        self.row_of[rid] = row
        self.requests[row] = request
        tokens = request.all_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        p = request.sampling_params
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.has_penalty[row] = p.has_penalties
        self.min_tokens[row] = p.min_tokens
        self.has_grammar[row] = request.grammar is not None
        self.is_pooling[row] = request.is_pooling
        self.lora_id[row] = request.lora_id
        if p.has_penalties:
            self.count_penalties(row, request)
        self.has_allowed[row] = p.allowed_token_ids is not None
        if p.allowed_token_ids is not None:
            self._init_allowed(row, p.allowed_token_ids)
        self.has_bias[row] = bool(p.logit_bias)
        self.bias[row] = (
            (
                np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias)),
                np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias)),
            )
            if p.logit_bias
            else None
        )
        self.has_bad_words[row] = bool(p.bad_words_token_ids)
        self.bad_words[row] = (
            [(list(w[:-1]), w[-1]) for w in p.bad_words_token_ids]
            if p.bad_words_token_ids
            else None
        )
        return row

    def remove(self, request_id: str) -> None:
        """Drop a request's row (finished or preempted); unknown ids are ignored."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        last = self.num_rows - 1
        if row != last:
            self._move(last, row)
        self.requests[last] = None
        self.bias[last] = self.bad_words[last] = None
        self.num_rows -= 1

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for a in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_blocks,
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.presence,
            self.frequency,
            self.repetition,
            self.has_penalty,
            self.min_tokens,
            self.has_grammar,
            self.is_pooling,
            self.lora_id,
            self.has_allowed,
            self.has_bias,
            self.has_bad_words,
        ):
            a[dst] = a[src]
        if self.has_penalty[src]:
            assert self.output_counts is not None and self.seen_mask is not None
            self.output_counts[dst] = self.output_counts[src]
            self.seen_mask[dst] = self.seen_mask[src]
        if self.has_allowed[src]:
            assert self.allowed_mask is not None
            self.allowed_mask[dst] = self.allowed_mask[src]
        self.bias[dst] = self.bias[src]
        self.bad_words[dst] = self.bad_words[src]
        request = self.requests[src]
        assert request is not None
        self.requests[dst] = request
        self.row_of[request.request_id] = dst

    # ------------------------------------------------------------------ a running row grows
    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        n = self.num_blocks[row]
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def append_sampled(self, rows: list[int], tokens: list[int], tokens_dev: torch.Tensor) -> None:
        """Write this step's sampled tokens after each row's known ones. ``tokens_dev`` is the
        same tokens on the device (penalty counts are updated there, without a host sync)."""
        r = np.asarray(rows, dtype=np.int64)
        self.token_ids[r, self.num_tokens[r]] = tokens
        self.num_tokens[r] += 1
        penalized = self.has_penalty[r]
        if penalized.any():
            assert self.output_counts is not None and self.seen_mask is not None
            which = upload(np.flatnonzero(penalized), self.device)
            prow = upload(r[penalized], self.device)
            tok = tokens_dev.index_select(0, which).to(torch.int64)
            self.output_counts.index_put_(
                (prow, tok), torch.ones_like(tok, dtype=torch.int32), accumulate=True
            )
            self.seen_mask[prow, tok] = True

    # ------------------------------------------------------------------ allowed token ids
    def _init_allowed(self, row: int, token_ids: list[int]) -> None:
        if self.allowed_mask is None:
            shape = (self.max_rows, self.vocab_size)
            self.allowed_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        mask = self.allowed_mask[row]
        mask.zero_()
        mask[upload(np.asarray(token_ids, dtype=np.int64), self.device)] = True

    # ------------------------------------------------------------------ penalties
    def count_penalties(self, row: int, request: Request) -> None:
        """Row ``row``'s penalty state from ``request``'s tokens: its output counts and the
        tokens seen in prompt and output (on admission, and on a tensor-parallel worker whose
        row took rank 0's tokens)."""
        if self.output_counts is None:
            shape = (self.max_rows, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.seen_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.seen_mask is not None
        counts, seen = self.output_counts[row], self.seen_mask[row]
        counts.zero_()
        seen.zero_()
        out = upload(np.asarray(request.output_token_ids, dtype=np.int64), self.device)
        counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        seen[upload(np.asarray(request.all_token_ids, dtype=np.int64), self.device)] = True
