"""The startup heap kept out of the garbage collector's way (vLLM does the same).

A full collection walks every object the collector tracks: the gateway's modules, pydantic's
schemas, the tokenizer. It runs whenever the objects that outlived younger collections reach a
quarter of the old ones, holding the GIL throughout: the event loop stops for that long. Frozen
objects are skipped from then on (reference counting still frees them). The gateway freezes
its heap once the first tokenizer is built (``GatewayState``), when serving starts."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then freeze every object left (``gc.freeze``); logs what a
    full collection cost before and after."""
    start = time.perf_counter()
    gc.collect()
    before_ms = (time.perf_counter() - start) * 1000
    gc.freeze()
    start = time.perf_counter()
    gc.collect()
    after_ms = (time.perf_counter() - start) * 1000
    logger.info(
        "froze the startup heap (%d objects): a full collection took %.1f ms, now %.1f ms",
        gc.get_freeze_count(),
        before_ms,
        after_ms,
    )
