"""What the engine connections tell the rest of the gateway, in one interface.

An :class:`~frontend_svc.engine.client.EngineClient` tells its observer (the pool's membership)
about its one engine; the :class:`~frontend_svc.engine.pool.EnginePool` tells its observer (the
gateway: tokenizer, metrics) about every engine. Both speak :class:`EngineEvents`, each event
naming the engine by its address. Every method does nothing here: an observer overrides the
events it needs.

Order for one engine: ``connected`` (then, from the pool, ``accepted``), ``load`` and ``step``
while its stream is open, ``disconnected`` when the stream ends (it reconnects: ``connected``
again), and, from the pool, ``left`` when it is gone for good. ``routed`` (pool) comes with every
request sent to an engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from protos.types import LoadFigures, ModelInfo, TokenizerFiles


class EngineEvents:
    """An observer of engines. The methods run on the gateway's event loop; ``load`` and
    ``step`` come with every engine message, so they must be cheap."""

    async def connected(self, address: str, info: ModelInfo, files: TokenizerFiles) -> None:
        """An engine answered GetModelInfo and sent its tokenizer; its stream opens when this
        returns. Raising refuses it (the client logs the error and tries again later). From the
        pool, ``info.max_model_len`` is the tightest among the engines in rotation."""

    def accepted(self, address: str, info: ModelInfo) -> None:
        """(Pool.) The engine joined the rotation; ``info`` is its own."""

    def disconnected(self, address: str) -> None:
        """The stream of an engine that had connected ended; it will reconnect."""

    def left(self, address: str) -> None:
        """(Pool.) The engine left for good (no longer in DNS): drop what is kept about it."""

    def load(self, address: str, load: LoadFigures) -> None:
        """The load figures that came with an engine message."""

    def step(
        self,
        address: str,
        prompt_tokens: int,
        generation_tokens: int,
        step_tokens: Sequence[int],
    ) -> None:
        """Per engine message that carried tokens of requests still listened to: the prompt
        tokens of those whose first token (or pooled result) it carries, the tokens generated,
        and, when the message merges several engine steps, the engine's count of each one's
        tokens."""

    def routed(self, address: str, affinity_tokens: int) -> None:
        """(Pool.) A request was sent to the engine; ``affinity_tokens``: prompt tokens
        expected to hit its prefix cache."""
