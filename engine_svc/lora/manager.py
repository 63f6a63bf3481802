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
on the worker), so an adapter sits in the same slot on every rank. Only rank 0 reads adapter
directories: each host copy it takes (an add, a read again after ``max_cpu_loras`` dropped it)
goes to every worker before it is used (``mirror``, the executor; :meth:`LoRAManager.keep` on
the worker), and each one it lets go is let go there too (:meth:`LoRAManager.discard`)::

    rank 0   add / read again ── mirror.put_lora ──► worker: keep      (answered: all or none)
             drop (trim, remove) ─ mirror.drop_loras ► worker: discard
             step: placement ──── step message ─────► worker: follow   (host copy -> slot)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from engine_svc.lora.adapter import LoRAAdapter, ModelDims, load_adapter
from engine_svc.lora.config import LoRAConfig, check_lora_name
from engine_svc.lora.errors import LoRAInvalidError, LoRAPathNotFoundError
from engine_svc.lora.registry import Dropped, LoRAInfo, LoRARegistry, Placement
from engine_svc.lora.weights import LoRAWeights
from engine_svc.models.parallel import ShardPlan

logger = logging.getLogger(__name__)


class HostCopyMirror(Protocol):
    """The other tensor-parallel ranks' host copies, kept equal to rank 0's (the executor)."""

    def put_lora(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Every other rank holds ``adapter`` as ``lora_id`` on return; if one cannot, none
        does and this raises (a ``LoRAError`` naming the rank)."""

    def drop_loras(self, lora_ids: list[int]) -> None:
        """The other ranks let the host copies of ``lora_ids`` go (unknown ids: ignored)."""


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
        # Tensor parallelism. Rank 0: the workers' host copies, set by the executor.
        self.mirror: HostCopyMirror | None = None
        # A worker: rank 0's slots, and what this rank's slots hold (None: nothing usable).
        self._followed: Placement | None = None
        self._held: list[int | None] = [None] * self.weights.num_slots

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
        self._release_memory(dropped)
        try:
            self._keep(entry.lora_id, adapter)
        except Exception:  # a tensor-parallel rank cannot hold it: not added after all
            self._release_memory(self.registry.remove(name)[1])
            raise
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

    def follow(self, placement: Placement | None) -> None:
        """A tensor-parallel worker, at each step: make this rank's slots hold what rank 0's
        hold (``placement``; None: what they held at the last step), and from now on take each
        step's slots from rank 0 (:meth:`prepare`) instead of deciding them. Only copies host
        copies (rank 0's, given with :meth:`keep`) into slots: never reads a directory."""
        placement = placement or self._followed
        if placement is None:
            return
        for slot, want in enumerate(placement.slots):
            want_id = None if want is None else want.lora_id
            if want_id == self._held[slot]:
                continue  # ids are never reused: the same id is the same weights
            if want_id is None:
                self.weights.clear(slot)
            else:
                adapter = self._host.get(want_id)
                if adapter is None:  # rank 0 gives every host copy before it fills a slot
                    raise RuntimeError(
                        f"LoRA adapter {want_id} is in rank 0's slot {slot} but this rank "
                        "was never given its host copy"
                    )
                self.weights.load(slot, adapter)
            self._held[slot] = want_id
        self._followed = placement

    def keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """A tensor-parallel worker: hold rank 0's host copy of ``lora_id`` (taken by rank 0
        when it was added or read again). A slot holding an older copy is loaded again at the
        next :meth:`follow`."""
        self._host[lora_id] = adapter
        self._forget_slots([lora_id])

    def discard(self, lora_ids: Iterable[int]) -> None:
        """A tensor-parallel worker: rank 0 let these host copies go (and their slots)."""
        lora_ids = list(lora_ids)
        for lora_id in lora_ids:
            self._host.pop(lora_id, None)
        self._forget_slots(lora_ids)

    def _forget_slots(self, lora_ids: list[int]) -> None:
        for slot, held in enumerate(self._held):
            if held is not None and held in lora_ids:
                self.weights.clear(slot)  # host-side flags only: safe while asleep
                self._held[slot] = None

    # ------------------------------------------------------------------ memory
    def _reload(self, lora_id: int) -> None:
        """Read a registered adapter again (its host copy was dropped: max_cpu_loras)."""
        entry = self.registry.entry(lora_id)
        logger.info("LoRA adapter %r: reading %s again", entry.name, entry.path)
        try:
            adapter = self.read(entry.path)
        except LoRAPathNotFoundError as e:  # a loaded adapter whose files went: cannot be served
            raise LoRAInvalidError(f"LoRA adapter {entry.name!r}: {e}") from e
        self._keep(lora_id, adapter)
        self._release_memory(self.registry.loaded(lora_id))

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Hold a host copy rank 0 has just read: on every rank, or (raising) on none."""
        if self.mirror is not None:
            self.mirror.put_lora(lora_id, adapter)
        self._host[lora_id] = adapter

    def _release_memory(self, dropped: Dropped) -> None:
        lora_ids = [*dropped.host, *dropped.adapters]
        for lora_id in lora_ids:
            self._host.pop(lora_id, None)
        if lora_ids and self.mirror is not None:
            self.mirror.drop_loras(lora_ids)

    @property
    def host_ids(self) -> set[int]:
        """Ids whose weights are in host memory (for tests)."""
        return set(self._host)
