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
        import xgrammar as xgr

        if not all(g.constraining for g in grammars):
            active = [(r, g) for r, g in zip(rows, grammars, strict=True) if g.constraining]
            if not active:
                return
            rows, grammars = [r for r, _ in active], [g for _, g in active]
        host = self._host_buffer()
        for row, grammar in zip(rows, grammars, strict=True):
            grammar.fill_bitmask(host, row)
        mask = host[: logits.shape[0]]
        if logits.device.type != "cpu":
            if self._device is None:
                self._device = torch.empty_like(host, device=logits.device)
            # Non-blocking from pinned memory: the host buffer is written again only after the
            # step's one sync (the sampled tokens), by when this copy has long finished.
            mask = self._device[: logits.shape[0]]
            mask.copy_(host[: logits.shape[0]], non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, mask, vocab_size=min(self.vocab_size, logits.shape[-1]), indices=list(rows)
        )

    def _host_buffer(self) -> torch.Tensor:
        if self._host is None:
            import xgrammar as xgr

            host = xgr.allocate_token_bitmask(self.max_rows, self.vocab_size)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
        return self._host
