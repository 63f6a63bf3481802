"""Prompt-lookup (n-gram) proposals: the tokens that followed an earlier occurrence of the
context's last few tokens, a good guess wherever the output copies spans of its input (edits,
summaries, code, extraction).

The rule is vLLM's ``NgramProposer`` (``--speculative-config '{"method": "ngram",
"num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}'``): the longest
suffix of the context of length in [a, b] that occurs earlier, its earliest occurrence, and up
to k of the tokens after it (never past the model's length bound)::

    context   A B C D E  A B C        suffix "A B C" (3) occurs at 0
    proposal        D E               (k = 2; with k = 4 also "A B C": the context's own tail)

The batch goes to one C call (``kernels/ngram_cpu.c``, an O(length) KMP pass per row, rows in
parallel with OpenMP at large batches) reading the persistent batch's token array in place, so
proposing for 256 requests costs well under a millisecond. Without a C compiler the same rule
runs in Python (``propose_row``), which is also the tests' reference.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np

# The config lives with the other proposers' (re-exported: its old home).
from engine_svc.spec_decode.config import NgramConfig, parse_speculative_config

logger = logging.getLogger(__name__)

__all__ = ["NgramConfig", "NgramProposer", "parse_speculative_config", "propose_row"]

_I32P = ctypes.POINTER(ctypes.c_int32)


def propose_row(tokens: list[int], min_n: int, max_n: int, k: int, max_len: int) -> list[int]:
    """The proposal for one context, written for clarity (the C kernel's reference)."""
    n = len(tokens)
    k = min(k, max_len - n)
    if n < min_n or k <= 0:
        return []
    for size in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = tokens[n - size :]
        for start in range(n - size):  # occurrences ending before the last token
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + k]
    return []


class NgramProposer:
    """Proposals for a batch of contexts held in a 2-D int32 array (the persistent batch's
    ``token_ids``: one row per request, ``lens`` tokens used)."""

    def __init__(self, config: NgramConfig, max_model_len: int, cache_dir: Path | None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._lib: ctypes.CDLL | None = None
        if cache_dir is not None:
            self._lib = _load(cache_dir)

    @property
    def native(self) -> bool:
        return self._lib is not None

    def propose(
        self, tokens: np.ndarray, rows: np.ndarray, lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(proposals [len(rows), k] int32, counts [len(rows)] int32) for the contexts
        ``tokens[rows[i], :lens[i]]``; entries past a row's count are unspecified."""
        cfg = self.config
        k = cfg.num_speculative_tokens
        n = len(rows)
        out = np.zeros((n, k), dtype=np.int32)
        counts = np.zeros(n, dtype=np.int32)
        if n == 0:
            return out, counts
        if tokens.dtype != np.int32 or tokens.ndim != 2 or tokens.strides[1] != 4:
            raise ValueError("tokens must be a 2-D int32 array with unit stride along a row")
        lens32 = np.ascontiguousarray(lens, dtype=np.int32)
        if len(lens32) != n or lens32.max() > tokens.shape[1] or lens32.min() < 0:
            raise ValueError("lens must give each row's token count within the array")
        if self._lib is None:
            for i, (row, length) in enumerate(zip(rows.tolist(), lens32.tolist(), strict=True)):
                got = propose_row(
                    tokens[row, :length].tolist(), cfg.prompt_lookup_min,
                    cfg.prompt_lookup_max, k, self.max_model_len,
                )  # fmt: skip
                out[i, : len(got)] = got
                counts[i] = len(got)
            return out, counts
        rows64 = np.ascontiguousarray(rows, dtype=np.int64)
        if n and (rows64.min() < 0 or rows64.max() >= tokens.shape[0]):
            raise ValueError("rows out of the token array")
        self._lib.ngram_propose(
            tokens.ctypes.data_as(_I32P), ctypes.c_int64(tokens.strides[0] // 4),
            rows64.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), lens32.ctypes.data_as(_I32P),
            ctypes.c_int32(n), ctypes.c_int32(cfg.prompt_lookup_min),
            ctypes.c_int32(cfg.prompt_lookup_max), ctypes.c_int32(k),
            ctypes.c_int32(self.max_model_len), out.ctypes.data_as(_I32P),
            counts.ctypes.data_as(_I32P),
        )  # fmt: skip
        return out, counts


def _load(cache_dir: Path) -> ctypes.CDLL | None:
    from kernels import cpu

    try:
        lib = cpu.library("ngram_cpu.c", (), cache_dir)
    except cpu.CpuKernelUnavailable as e:
        logger.warning("n-gram proposals in Python (slower): %s", e)
        return None
    lib.ngram_propose.restype = None
    return lib
