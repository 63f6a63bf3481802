"""Every engine behind this gateway, and the choice of one per request.

A request goes to the engine :class:`~frontend_svc.engine.router.Router` picks among those in
rotation (:mod:`frontend_svc.engine.membership`: engines joining and leaving). When that engine
fails the request before it produced a token (stream broken, draining, queue full) it is sent to
another engine; once tokens have reached the client, the error is the client's. A request with a
LoRA adapter only goes to an engine that has it. LoRA adapters and utility calls go to every
engine (:mod:`frontend_svc.engine.fanout`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator

from frontend_svc.config import FrontendConfig
from frontend_svc.engine.errors import EngineRequestError, EngineUnavailableError
from frontend_svc.engine.events import EngineEvents
from frontend_svc.engine.fanout import EngineFanOut
from frontend_svc.engine.membership import EngineMembership, Member
from frontend_svc.engine.router import Router
from protos.types import EngineErrorCode, EngineOutput, EngineRequest

logger = logging.getLogger(__name__)

# Failures that leave the request untouched on the engine, so another engine may take it.
_RETRYABLE_CODES = (EngineErrorCode.RESOURCE_EXHAUSTED, EngineErrorCode.UNAVAILABLE)


class EnginePool:
    """Connections to every engine (``members``), calls on all of them (``fanout``), and the
    choice of one per request (:meth:`generate`)."""

    def __init__(self, config: FrontendConfig, events: EngineEvents | None = None) -> None:
        """``events``: told what the gateway should know of the engines (the tokenizer and
        model facts when one connects, load figures and token counts for the metrics)."""
        self.config = config
        self.router = Router(
            config.routing.affinity_min_tokens, config.routing.affinity_max_imbalance
        )
        self._events = events or EngineEvents()
        self.members = EngineMembership(config, self._events, self.router)
        self.fanout = EngineFanOut(self.members)

    def start(self) -> None:
        """Connect to the fixed addresses now; look DNS names up in the background."""
        self.members.start()

    async def close(self) -> None:
        await self.members.close()

    # -- requests ---------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Run ``request`` on the chosen engine (:meth:`EngineClient.generate`), moving it
        while no output has been produced.

        Raises like :meth:`EngineClient.generate`; closing the generator aborts the request.
        """
        tried: set[str] = set()
        last_error: Exception | None = None
        lora = request.lora_name
        while True:
            engine = self._pick(request, tried)
            if engine is None:
                if last_error is None and lora and not self.fanout.has_adapter(lora):
                    last_error = EngineRequestError(
                        EngineErrorCode.NOT_FOUND,
                        f"The LoRA adapter `{lora}` is not loaded on any engine.",
                    )
                raise last_error or EngineUnavailableError(self.members.unavailable_reason())
            address = engine.client.address
            tried.add(address)
            produced = False
            engine.in_flight += 1
            try:
                async with contextlib.aclosing(engine.client.generate(request)) as outputs:
                    async for out in outputs:
                        produced = True
                        yield out
                return
            except (EngineUnavailableError, EngineRequestError) as e:
                retryable = isinstance(e, EngineUnavailableError) or e.code in _RETRYABLE_CODES
                if (
                    lora
                    and isinstance(e, EngineRequestError)
                    and e.code is EngineErrorCode.NOT_FOUND
                ):
                    # Unloaded behind this gateway's back (another gateway): another engine may
                    # still have it.
                    engine.loras.pop(lora, None)
                    retryable = True
                if produced or not retryable:
                    raise
                logger.info("request %s: engine %s failed (%s)", request.request_id, address, e)
                last_error = e
            finally:
                self.members.request_ended(engine)

    def _pick(self, request: EngineRequest, exclude: set[str]) -> Member | None:
        lora = request.lora_name
        candidates = {
            a: e
            for a, e in self.members.engines.items()
            if e.usable and a not in exclude and (not lora or lora in e.loras)
        }
        if not candidates:
            return None
        choice = self.router.choose(
            request.prompt_token_ids, {a: e.load for a, e in candidates.items()}, lora
        )
        self._events.routed(choice.address, choice.affinity_tokens)
        return candidates[choice.address]
