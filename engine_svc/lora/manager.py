"""The engine's LoRA adapters: the registry's decisions carried out on tensors.

``LoRARegistry`` (pure bookkeeping) decides which adapter sits in which device slot and which
host copies go; this class holds the host copies (``LoRAAdapter``) and the device slots
(``LoRAWeights``) and moves the tensors it is told to. It lives on the engine loop thread, like
the scheduler. Reading an adapter directory (:meth:`LoRAManager.read`) touches no state, so the
gRPC layer does it on a worker thread and hands the result to :meth:`LoRAManager.add`; only an
adapter whose host copy was dropped (``max_cpu_loras``) is read again here, when a request or a
pin needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from engine_svc.lora.adapter import LoRAAdapter, ModelDims, load_adapter
from engine_svc.lora.config import LoRAConfig, check_lora_name
from engine_svc.lora.errors import LoRAInvalidError, LoRAPathNotFoundError
from engine_svc.lora.registry import Dropped, LoRAInfo, LoRARegistry
from engine_svc.lora.weights import LoRAWeights

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, config: LoRAConfig, dims: ModelDims, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.dims = dims
        self.dtype = dtype
        self.registry = LoRARegistry(config.max_loras, config.max_cpu_loras)
        self.weights = LoRAWeights(dims, config.max_loras, config.max_lora_rank, dtype, device)
        self._host: dict[int, LoRAAdapter] = {}

    # ------------------------------------------------------------------ any thread
    def read(self, path: str | Path) -> LoRAAdapter:
        """Read and check an adapter directory (no state touched: safe on any thread).
        Raises LoRAInvalidError naming the file."""
        return load_adapter(path, self.dims, self.config.max_lora_rank)

    # ------------------------------------------------------------------ the loop thread
    def add(
        self, name: str, adapter: LoRAAdapter, pin: bool = False, running: Iterable[int] = ()
    ) -> LoRAInfo:
        """Register ``adapter`` (from :meth:`read`) as ``name``. LoRAExistsError for a name in
        use, LoRACapacityError when ``pin`` cannot be honoured; ``running``: the adapters of
        the running requests (a pin never moves them out)."""
        check_lora_name(name)
        entry, dropped = self.registry.add(name, adapter.path, adapter.rank)
        self._host[entry.lora_id] = adapter
        self._release_memory(dropped)
        if pin:
            try:
                self.pin(name, running)
            except Exception:  # not added after all
                self._release_memory(self.registry.remove(name)[1])
                raise
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %s, %.1f MiB)",
            name,
            adapter.path,
            adapter.rank,
            "/".join(adapter.targets),
            adapter.nbytes / 2**20,
        )
        return self._info(name)

    def remove(self, name: str) -> None:
        """Unregister ``name`` (LoRANotFoundError if unknown); requests already holding it
        finish with it, and its memory goes with the last of them."""
        entry, dropped = self.registry.remove(name)
        self._release_memory(dropped)
        logger.info(
            "LoRA adapter %r removed%s",
            name,
            f" (its {entry.users} running request(s) finish first)" if entry.users else "",
        )

    def pin(self, name: str, running: Iterable[int] = ()) -> None:
        """Keep ``name`` on the device from now on (see ``LoRARegistry.pin``)."""
        entry = self.registry.get(name)
        if not entry.pinned and not entry.on_host:
            self._reload(entry.lora_id)
        for load in self.registry.pin(name, running):
            self.weights.load(load.slot, self._host[load.lora_id])

    def infos(self) -> list[LoRAInfo]:
        return self.registry.infos()

    def _info(self, name: str) -> LoRAInfo:
        return next(i for i in self.registry.infos() if i.name == name)

    # ------------------------------------------------------------------ requests
    def acquire(self, name: str) -> int:
        """A request naming ``name`` enters the engine: its adapter's id, held (and kept in host
        memory) until :meth:`release`. LoRANotFoundError for an unknown name."""
        entry = self.registry.acquire(name)
        if not entry.on_host:
            try:
                self._reload(entry.lora_id)
            except Exception:
                self.release(entry.lora_id)
                raise
        return entry.lora_id

    def release(self, lora_id: int) -> None:
        """A request holding ``lora_id`` finished (any way)."""
        self._release_memory(self.registry.release(lora_id))

    def can_admit(self, lora_id: int, running: set[int]) -> bool:
        return self.registry.can_admit(lora_id, running)

    # ------------------------------------------------------------------ one step
    def prepare(self, needed: Iterable[int]) -> dict[int, int]:
        """Put every adapter of the coming step on the device (moving least recently used ones
        out) and return lora id -> slot."""
        needed = list(needed)
        for load in self.registry.assign_slots(needed):
            self.weights.load(load.slot, self._host[load.lora_id])
        slots = {}
        for lora_id in needed:
            slot = self.registry.slot_of(lora_id)
            assert slot is not None, "assign_slots placed every needed adapter"
            slots[lora_id] = slot
        return slots

    # ------------------------------------------------------------------ memory
    def _reload(self, lora_id: int) -> None:
        """Read a registered adapter again (its host copy was dropped: max_cpu_loras)."""
        entry = self.registry.entry(lora_id)
        logger.info("LoRA adapter %r: reading %s again", entry.name, entry.path)
        try:
            self._host[lora_id] = self.read(entry.path)
        except LoRAPathNotFoundError as e:  # a loaded adapter whose files went: cannot be served
            raise LoRAInvalidError(f"LoRA adapter {entry.name!r}: {e}") from e
        self._release_memory(self.registry.loaded(lora_id))

    def _release_memory(self, dropped: Dropped) -> None:
        for lora_id in [*dropped.host, *dropped.adapters]:
            self._host.pop(lora_id, None)

    @property
    def host_ids(self) -> set[int]:
        """Ids whose weights are in host memory (for tests)."""
        return set(self._host)
