"""The startup heap kept out of the garbage collector's way, in both services (vLLM does the same).

A full collection walks every object the collector tracks, holding the GIL throughout: in the
engine the busy loop stops (a late token on every running stream), in the gateway the event loop.
It runs whenever the objects that outlived younger collections reach a quarter of the old ones.
After loading even the tiny default model the engine holds ~380k tracked objects (torch,
transformers, the model's modules and parameters): one full collection took 178 ms on the 2-core
CI VM (2026-11-23). The gateway's are its modules, pydantic's schemas and the tokenizer. Frozen
objects are skipped from then on (reference counting still frees them). The engine freezes once
its model is loaded and it serves; the gateway once its first tokenizer is built
(``GatewayState``).
"""

from __future__ import annotations

import gc
import logging
import time


def freeze_startup_heap(log: logging.Logger) -> None:
    """Collect what is garbage now, then freeze every object left (``gc.freeze``); logs to the
    caller's ``log`` what a full collection cost before and after."""
    start = time.perf_counter()
    gc.collect()
    before_ms = (time.perf_counter() - start) * 1000
    gc.freeze()
    start = time.perf_counter()
    gc.collect()
    after_ms = (time.perf_counter() - start) * 1000
    log.info(
        "froze the startup heap (%d objects): a full collection took %.1f ms, now %.1f ms",
        gc.get_freeze_count(),
        before_ms,
        after_ms,
    )
