"""The engine's LoRA adapters: the registry's decisions carried out on tensors.

``LoRARegistry`` (pure bookkeeping) decides which adapter sits in which device slot and which
host copies go; this class holds the host copies (``LoRAAdapter``) and the device slots
(``LoRAWeights``) and moves the tensors it is told to. It lives on the engine loop thread, like
the scheduler. Reading an adapter directory (:meth:`LoRAManager.read`) touches no state, so the
gRPC layer does it on a worker thread and hands the result to :meth:`LoRAManager.add`; only an
adapter whose host copy was dropped (``max_cpu_loras``) is read again here, when a request or a
pin needs it.

Tensor parallelism: every rank has a manager whose slots hold its slice of the adapters
(``LoRAWeights``). Rank 0's decides; a worker's registry stays empty and its slots follow rank
0's (:meth:`LoRAManager.placement` travels with the step message, :meth:`LoRAManager.follow`
on the worker), so an adapter sits in the same slot on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from engine_svc.lora.adapter import LoRAAdapter, ModelDims, load_adapter
from engine_svc.lora.config import LoRAConfig, check_lora_name
from engine_svc.lora.errors import LoRAInvalidError, LoRAPathNotFoundError
from engine_svc.lora.registry import Dropped, LoRAInfo, LoRARegistry, Placement
from engine_svc.lora.weights import LoRAWeights
from engine_svc.models.parallel import ShardPlan

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        dims: ModelDims,
        dtype: torch.dtype,
        device: torch.device,
        plan: ShardPlan | None = None,
    ) -> None:
        """``dims``: the whole model's (what an adapter is checked against); ``plan``: the
        tensor-parallel rank whose slice of each adapter the device slots hold (None: all)."""
        self.config = config
        self.dims = dims
        self.dtype = dtype
        self.registry = LoRARegistry(config.max_loras, config.max_cpu_loras)
        self.weights = LoRAWeights(
            dims, config.max_loras, config.max_lora_rank, dtype, device, plan
        )
        self._host: dict[int, LoRAAdapter] = {}
        self._followed: Placement | None = None  # a tensor-parallel worker: rank 0's slots

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
        out) and return lora id -> slot. A tensor-parallel worker: the slots rank 0 chose."""
        if self._followed is not None:
            return {lora_id: self._followed.slot_of(lora_id) for lora_id in needed}
        needed = list(needed)
        for load in self.registry.assign_slots(needed):
            self.weights.load(load.slot, self._host[load.lora_id])
        slots = {}
        for lora_id in needed:
            slot = self.registry.slot_of(lora_id)
            assert slot is not None, "assign_slots placed every needed adapter"
            slots[lora_id] = slot
        return slots

    # ------------------------------------------------------------------ tensor parallelism
    def placement(self) -> Placement:
        """Rank 0: what its slots and host memory hold (for :meth:`follow` on the workers)."""
        return self.registry.placement()

    def follow(self, placement: Placement) -> None:
        """A tensor-parallel worker: make this rank's slots hold what rank 0's hold, and from
        now on take each step's slots from rank 0 (:meth:`prepare`) instead of deciding them.
        An adapter not in this rank's host memory is read from its directory (and its slice
        copied to the device); host copies rank 0 dropped are dropped here too."""
        self._host = {i: a for i, a in self._host.items() if i in placement.host_ids}
        followed = self._followed
        held = (None,) * self.weights.num_slots if followed is None else followed.slots
        for slot, (now, want) in enumerate(zip(held, placement.slots, strict=True)):
            if want == now:
                continue  # ids are never reused: the same id is the same weights
            if want is None:
                self.weights.clear(slot)
                continue
            adapter = self._host.get(want.lora_id)
            if adapter is None:
                logger.info("LoRA adapter %d: reading %s", want.lora_id, want.path)
                adapter = self.read(want.path)
                if want.lora_id in placement.host_ids:
                    self._host[want.lora_id] = adapter
            self.weights.load(slot, adapter)
        self._followed = placement

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
