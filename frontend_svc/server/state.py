"""What every route needs: config, engine client, tokenizer, model facts and metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging

from frontend_svc.config import FrontendConfig
from frontend_svc.engine.pool import EnginePool
from frontend_svc.errors import engine_unavailable, model_not_found
from frontend_svc.reasoning import ReasoningParser, get_reasoning_parser
from frontend_svc.server.load_report import ServerLoad
from frontend_svc.server.metrics import Metrics, MetricsEvents
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.tool_parsers import ToolParser, get_tool_parser
from protos.gc_heap import freeze_startup_heap
from protos.types import LoadFigures, ModelInfo, TokenizerFiles

logger = logging.getLogger(__name__)

# A request naming a model nobody here knows makes the gateway read the engines' adapter lists
# again (it may have been loaded through another gateway or worker), at most this often.
ADAPTER_REFRESH_S = 1.0


class GatewayState(MetricsEvents):
    """Holds the engine connections and what was learned from the engines when they connected;
    it is the pool's observer (:class:`~frontend_svc.engine.events.EngineEvents`): an engine
    connecting brings the tokenizer and model facts, the rest goes to the metrics."""

    def __init__(self, config: FrontendConfig, freeze_gc_heap: bool = False) -> None:
        """``freeze_gc_heap``: freeze the heap once the first tokenizer is built
        (``frontend_svc.gc_heap``), as a server process wants; not in a test's process."""
        super().__init__(Metrics(config.served_model_name or ""))
        self.config = config
        self._freeze_gc_heap = freeze_gc_heap
        self.tokenizer: Tokenizer | None = None
        self._tokenizer_source: object = None  # what self.tokenizer was built from
        self.model_info: ModelInfo | None = None
        # What reads tool_choice "auto" output; None: "auto" is refused (both flags, as in vLLM).
        self.tool_parser: ToolParser | None = None
        if config.enable_auto_tool_choice and config.tool_call_parser is not None:
            self.tool_parser = get_tool_parser(config.tool_call_parser)
        # What splits chat output into reasoning and content; None: all of it is content.
        self.reasoning_parser: ReasoningParser | None = None
        if config.reasoning_parser is not None:
            self.reasoning_parser = get_reasoning_parser(config.reasoning_parser)
        self.engines = EnginePool(config, self)
        # /load and ORCA load reports (server.load_report); the tokenizer files for
        # /tokenizer_info.
        self.server_load = ServerLoad()
        self.tokenizer_files: TokenizerFiles | None = None

    async def connected(self, address: str, info: ModelInfo, files: TokenizerFiles) -> None:
        # An engine reconnecting (restarted, or one more replica) usually brings the tokenizer
        # already loaded; building a large one again would cost a second before serving.
        source = (files, info.vocab_size, info.bos_token_id, info.eos_token_ids)
        if self.tokenizer is not None and source == self._tokenizer_source:
            tokenizer = self.tokenizer
        else:
            tokenizer = await asyncio.to_thread(Tokenizer.from_files, files, info)
            self._tokenizer_source = source
            if self._freeze_gc_heap:
                self._freeze_gc_heap = False  # once: what is built later is not startup heap
                freeze_startup_heap(logger)
        await asyncio.to_thread(tokenizer.prepare_truncation, info.max_model_len)
        self.tokenizer, self.model_info = tokenizer, info
        self.tokenizer_files = files
        self.metrics.model_name = self.config.served_model_name or info.served_model_name
        logger.info(
            "engine model %s: max_model_len=%d vocab=%d",
            info.served_model_name,
            info.max_model_len,
            info.vocab_size,
        )

    def load(self, address: str, load: LoadFigures) -> None:
        self.server_load.engines[address] = load
        super().load(address, load)

    def left(self, address: str) -> None:
        self.server_load.engines.pop(address, None)
        super().left(address)

    @property
    def ready(self) -> bool:
        return self.engines.members.serving and self.tokenizer is not None

    @property
    def served_model_name(self) -> str | None:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.model_info.served_model_name if self.model_info else None

    def require_engine(self) -> tuple[Tokenizer, ModelInfo]:
        """The tokenizer and model info, or a 503 when the engine is not connected."""
        if not self.ready or self.tokenizer is None or self.model_info is None:
            raise engine_unavailable(self.engines.members.unavailable_reason())
        return self.tokenizer, self.model_info

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names, None for the served model (or no model, where it
        is optional); 404 for anything else. No rpc: the adapters the engines reported."""
        if model is None or model == self.served_model_name:
            return None
        if self.engines.fanout.has_adapter(model):
            return model
        raise model_not_found(model)

    async def resolve_model(self, model: str | None) -> str | None:
        """:meth:`check_model`, but a name nobody here knows is looked for again on the engines
        first (at most every ``ADAPTER_REFRESH_S``), so an adapter loaded through another
        gateway or worker is found."""
        fanout = self.engines.fanout
        if model is None or model == self.served_model_name or fanout.has_adapter(model):
            return self.check_model(model)
        await fanout.refresh_adapters(max_age_s=ADAPTER_REFRESH_S)
        return self.check_model(model)

    def api_key_ok(self, authorization: str | None) -> bool:
        key = self.config.api_key
        if key is None:
            return True
        if not authorization or not authorization.startswith("Bearer "):
            return False
        return hmac.compare_digest(authorization[len("Bearer ") :].encode(), key.encode())
