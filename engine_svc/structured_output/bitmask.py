"""The token bitmask of one step: one row per sampling row, filled by the constrained rows'
matchers on the host, applied to the logits in place before the sampler sees them.

    logits rows     0      1      2      3          (this step's sampling rows)
    grammar         -      g1     -      g3
    bitmask rows    .      fill   .      fill       [max_rows, ceil(vocab / 32)] int32, host
    applied to      -      1      -      3          indices=[1, 3]: the free rows are untouched

A forbidden token's logit becomes -inf, so temperature, penalties, top-k/top-p and min-p all
work on the constrained distribution, and logprobs report it. A step without constrained rows
never gets here; a row whose output is still in its reasoning (``RequestGrammar.constraining``
False) is left out, like a free row.

A verification step (speculative decoding, ``apply_ahead``) has ``k + 1`` logits rows per
request; its constrained requests' rows are masked position by position, each with what the
grammar allows after the proposals before it (``RequestGrammar.fill_bitmask_ahead``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_svc.structured_output.grammar import RequestGrammar


class GrammarBitmask:
    """Buffers for the bitmask, made on first use: a host buffer the matchers write to (pinned
    when the logits live on an accelerator) and, then, a device buffer it is copied into."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = device
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None

    def apply(
        self, logits: torch.Tensor, rows: Sequence[int], grammars: Sequence[RequestGrammar]
    ) -> None:
        """Mask ``logits[rows[i]]`` with what ``grammars[i]`` allows next, in place."""
        if not all(g.constraining for g in grammars):
            active = [(r, g) for r, g in zip(rows, grammars, strict=True) if g.constraining]
            if not active:
                return
            rows, grammars = [r for r, _ in active], [g for _, g in active]
        host = self._host_buffer(logits.shape[0])
        for row, grammar in zip(rows, grammars, strict=True):
            grammar.fill_bitmask(host, row)
        self._apply(logits, host, rows)

    def apply_ahead(
        self,
        logits: torch.Tensor,
        positions: int,
        requests: Sequence[tuple[int, RequestGrammar, Sequence[int]]],
    ) -> list[int]:
        """Verification rows: ``logits`` holds ``positions`` rows per request. For each
        ``(i, grammar, proposals)`` mask row ``i * positions + j`` with what the grammar allows
        after the proposals before j, up to the first proposal it refuses; returns how many of
        each request's proposals it accepts (the rows after are left alone: never reached). The
        matchers are left as they were."""
        host = self._host_buffer(logits.shape[0])
        rows: list[int] = []
        accepted = []
        for i, grammar, proposals in requests:
            first = i * positions
            m = grammar.fill_bitmask_ahead(host, first, proposals)
            rows.extend(range(first, first + m + 1))
            accepted.append(m)
        self._apply(logits, host, rows)
        return accepted

    def _apply(self, logits: torch.Tensor, host: torch.Tensor, rows: Sequence[int]) -> None:
        import xgrammar as xgr

        mask = host[: logits.shape[0]]
        if logits.device.type != "cpu":
            if self._device is None or self._device.shape[0] < host.shape[0]:
                self._device = torch.empty_like(host, device=logits.device)
            # Non-blocking from pinned memory: the host buffer is written again only after the
            # step's one sync (the sampled tokens), by when this copy has long finished.
            mask = self._device[: logits.shape[0]]
            mask.copy_(host[: logits.shape[0]], non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, mask, vocab_size=min(self.vocab_size, logits.shape[-1]), indices=list(rows)
        )

    def _host_buffer(self, num_rows: int) -> torch.Tensor:
        """At least ``num_rows`` rows (``max_rows``, more for a verification step's)."""
        if self._host is None or self._host.shape[0] < num_rows:
            import xgrammar as xgr

            host = xgr.allocate_token_bitmask(max(self.max_rows, num_rows), self.vocab_size)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
        return self._host
