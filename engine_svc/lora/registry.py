"""Which adapters the engine knows, which device slot each sits in, and which to move out.

Pure bookkeeping (no torch, like the scheduler and the KV cache manager): it decides, and
``LoRAManager`` moves the tensors it is told to. Three tiers::

    registered   every adapter added and not removed: name -> LoRAEntry (id, path, rank, pin)
    host         its weights in host memory; at most max_cpu_loras (None: all). Dropped from
                 here (least recently used first, idle and unpinned only), an adapter stays
                 registered and is read again from its directory when a request names it
    device       one of max_loras slots; the least recently used unpinned adapter no request of
                 the coming step needs is moved out when another one needs its slot

Ids are never reused: a removed adapter added again under its old name is a new adapter (the
prefix cache keys blocks by id, so it never reads the KV the old weights produced).

Removing an adapter that unfinished requests use is deferred: the name is freed at once (new
requests naming it are NOT_FOUND, and the name may be added again), the requests already taken
in finish with the old weights, and its memory goes when the last one ends (the contract's
RemoveLora). Pinned adapters are never moved out of the device (nor dropped from host memory).

The scheduler keeps a step within the slots with :meth:`LoRARegistry.can_admit`: the adapters of
running requests plus the pinned ones never exceed max_loras once a request with a new adapter
is admitted, so every step's adapters fit the device together.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_svc.lora.errors import LoRACapacityError, LoRAExistsError, LoRANotFoundError


@dataclass
class LoRAEntry:
    """One registered adapter (mutable: the registry's own record)."""

    lora_id: int
    name: str
    path: str
    rank: int
    pinned: bool = False
    slot: int | None = None  # device slot, None: not on the device
    on_host: bool = True  # its weights are in host memory (else: read from path when needed)
    users: int = 0  # unfinished requests that hold it
    removed: bool = False  # RemoveLora'd while in use: dropped when ``users`` reaches 0


@dataclass(frozen=True)
class LoRAInfo:
    """A snapshot of one adapter, as ListLoras reports it."""

    lora_id: int
    name: str
    path: str
    rank: int
    pinned: bool
    on_device: bool


@dataclass(frozen=True)
class SlotLoad:
    """Copy adapter ``lora_id``'s weights into device slot ``slot`` (over whatever was there)."""

    lora_id: int
    slot: int


@dataclass(frozen=True)
class SlotAdapter:
    """The adapter a device slot holds: its id and the directory it was read from."""

    lora_id: int
    path: str


@dataclass(frozen=True)
class Placement:
    """What the device slots and host memory hold: tensor parallelism's workers hold the same as
    rank 0 (whose registry decides for every rank)."""

    slots: tuple[SlotAdapter | None, ...]  # slot -> its adapter (None: free)
    host_ids: frozenset[int]  # the adapters whose weights are in host memory

    def slot_of(self, lora_id: int) -> int:
        for slot, held in enumerate(self.slots):
            if held is not None and held.lora_id == lora_id:
                return slot
        raise KeyError(f"LoRA adapter {lora_id} is in no device slot")


@dataclass
class Dropped:
    """Memory to release after a registry change: host copies, and whole adapters."""

    host: list[int] = field(default_factory=list)  # ids whose host weights go (still registered)
    adapters: list[int] = field(default_factory=list)  # ids gone entirely (host and device)


class LoRARegistry:
    def __init__(self, max_loras: int, max_cpu_loras: int | None = None) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) < max_loras ({max_loras})")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._by_name: dict[str, LoRAEntry] = {}  # live names, in load order
        self._by_id: dict[int, LoRAEntry] = {}  # live and removed-but-in-use adapters
        self._slots: list[int | None] = [None] * max_loras  # slot -> lora id
        # Order of use, least recent first: which adapter leaves the device / host memory next.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._next_id = 1

    # ------------------------------------------------------------------ looking up
    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> LoRAEntry:
        entry = self._by_name.get(name)
        if entry is None:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded")
        return entry

    def entry(self, lora_id: int) -> LoRAEntry:
        return self._by_id[lora_id]

    def infos(self) -> list[LoRAInfo]:
        """Every registered adapter, in load order."""
        return [
            LoRAInfo(e.lora_id, e.name, e.path, e.rank, e.pinned, e.slot is not None)
            for e in self._by_name.values()
        ]

    def slot_of(self, lora_id: int) -> int | None:
        return self._by_id[lora_id].slot

    def slots(self) -> list[int | None]:
        """Slot -> lora id (None: free), for tests and debugging."""
        return list(self._slots)

    def placement(self) -> Placement:
        """What every device slot holds now, and which adapters are in host memory."""
        return Placement(
            tuple(None if i is None else SlotAdapter(i, self._by_id[i].path) for i in self._slots),
            frozenset(e.lora_id for e in self._by_id.values() if e.on_host),
        )

    def lru_order(self) -> list[int]:
        """Ids from least to most recently used."""
        return list(self._lru)

    def pinned_ids(self) -> set[int]:
        return {e.lora_id for e in self._by_id.values() if e.pinned}

    # ------------------------------------------------------------------ adding and removing
    def add(self, name: str, path: str, rank: int, pin: bool = False) -> tuple[LoRAEntry, Dropped]:
        """Register an adapter whose weights the caller holds in host memory now.

        Raises LoRAExistsError for a name in use, LoRACapacityError when ``pin`` cannot be
        honoured (see :meth:`pin`). Returns the entry and the host copies to drop to stay within
        max_cpu_loras (never the new one)."""
        if name in self._by_name:
            raise LoRAExistsError(f"a LoRA adapter named {name!r} is already loaded")
        if pin:
            self._check_pin(None)
        entry = LoRAEntry(self._next_id, name, path, rank, pinned=pin)
        self._next_id += 1
        self._by_name[name] = entry
        self._by_id[entry.lora_id] = entry
        self._lru[entry.lora_id] = None
        return entry, Dropped(host=self._trim_host(keep=entry.lora_id))

    def remove(self, name: str) -> tuple[LoRAEntry, Dropped]:
        """Unregister ``name`` (LoRANotFoundError if unknown). The name is free at once; the
        adapter itself goes now when no request holds it, else when the last one finishes."""
        entry = self.get(name)
        del self._by_name[name]
        entry.removed = True
        entry.pinned = False
        dropped = Dropped()
        if entry.users == 0:
            self._drop(entry)
            dropped.adapters.append(entry.lora_id)
        return entry, dropped

    def _drop(self, entry: LoRAEntry) -> None:
        if entry.slot is not None:
            self._slots[entry.slot] = None
            entry.slot = None
        entry.on_host = False
        del self._by_id[entry.lora_id]
        self._lru.pop(entry.lora_id, None)

    # ------------------------------------------------------------------ pinning
    def pin(self, name: str, running: Iterable[int] = ()) -> list[SlotLoad]:
        """Pin ``name`` on the device; returns the load that puts it there now, if a slot is
        free or held by an adapter none of the ``running`` requests use (else it moves in at the
        first step that leaves one). Pinning twice is a no-op.

        Raises LoRANotFoundError, or LoRACapacityError when every slot is pinned already, or
        when this pin would take the last slot while requests wait for an unpinned adapter."""
        entry = self.get(name)
        if entry.pinned:
            return []
        self._check_pin(entry)
        entry.pinned = True
        return self._place_pinned(set(running))

    def _check_pin(self, entry: LoRAEntry | None) -> None:
        pinned = sum(1 for e in self._by_id.values() if e.pinned)
        if pinned >= self.max_loras:
            raise LoRACapacityError(f"all {self.max_loras} LoRA device slots are pinned already")
        if pinned + 1 == self.max_loras:
            waiting = [
                e.name
                for e in self._by_id.values()
                if not e.pinned and e.users and e is not entry and not e.removed
            ]
            if waiting:
                raise LoRACapacityError(
                    f"pinning would take the last of {self.max_loras} LoRA device slots while "
                    f"requests use the unpinned adapter(s) {', '.join(sorted(waiting))}"
                )

    # ------------------------------------------------------------------ requests
    def can_admit(self, lora_id: int, running: set[int]) -> bool:
        """Whether a request with adapter ``lora_id`` may join the running set, whose requests
        use the adapters ``running``: yes if its adapter is among them, else only if the running
        adapters, the pinned ones and this one fit in max_loras slots together."""
        if lora_id in running:
            return True
        return len(running | self.pinned_ids() | {lora_id}) <= self.max_loras

    def acquire(self, name: str) -> LoRAEntry:
        """A request naming ``name`` enters the engine: hold the adapter until :meth:`release`.

        Raises LoRANotFoundError, or LoRACapacityError when the adapter is unpinned while every
        slot is pinned (it could never run). The caller must make sure its weights are in host
        memory (``entry.on_host``; :meth:`loaded` once read again)."""
        entry = self.get(name)
        if not entry.pinned and len(self.pinned_ids()) >= self.max_loras:
            raise LoRACapacityError(
                f"LoRA adapter {name!r} cannot run: all {self.max_loras} device slots are "
                "pinned by other adapters"
            )
        entry.users += 1
        self._lru.move_to_end(entry.lora_id)
        return entry

    def release(self, lora_id: int) -> Dropped:
        """A request holding ``lora_id`` finished. A removed adapter goes with its last user."""
        entry = self._by_id[lora_id]
        if entry.users <= 0:
            raise RuntimeError(f"LoRA adapter {entry.name!r} released more often than acquired")
        entry.users -= 1
        dropped = Dropped()
        if entry.users == 0 and entry.removed:
            self._drop(entry)
            dropped.adapters.append(lora_id)
        elif entry.users == 0:
            dropped.host = self._trim_host(keep=None)
        return dropped

    def loaded(self, lora_id: int) -> Dropped:
        """The weights of ``lora_id`` are in host memory again; returns the host copies to drop
        to stay within max_cpu_loras."""
        entry = self._by_id[lora_id]
        entry.on_host = True
        self._lru.move_to_end(lora_id)
        return Dropped(host=self._trim_host(keep=lora_id))

    def _trim_host(self, keep: int | None) -> list[int]:
        """Drop least recently used idle, unpinned host copies beyond max_cpu_loras (a soft
        bound: adapters in use or pinned always stay). A dropped copy leaves its slot too."""
        if self.max_cpu_loras is None:
            return []
        on_host = sum(1 for e in self._by_id.values() if e.on_host)
        out = []
        for lora_id in list(self._lru):
            if on_host <= self.max_cpu_loras:
                break
            e = self._by_id[lora_id]
            if not e.on_host or e.pinned or e.users or lora_id == keep:
                continue
            e.on_host = False
            if e.slot is not None:
                self._slots[e.slot] = None
                e.slot = None
            on_host -= 1
            out.append(lora_id)
        return out

    # ------------------------------------------------------------------ one step
    def assign_slots(self, needed: Iterable[int]) -> list[SlotLoad]:
        """Give every adapter of the coming step a device slot; returns the loads to do, in
        order. A free slot is used first, else the least recently used unpinned adapter that
        the step does not need moves out. The step's adapters become the most recently used.
        Pinned adapters waiting for a slot take the ones still free afterwards.

        Raises RuntimeError if they cannot fit (the scheduler's ``can_admit`` prevents it)."""
        needed_ids = list(dict.fromkeys(needed))
        if len(needed_ids) > self.max_loras:
            raise RuntimeError(
                f"a step needs {len(needed_ids)} LoRA adapters but there are {self.max_loras} slots"
            )
        keep = set(needed_ids)
        loads = []
        for lora_id in needed_ids:
            entry = self._by_id[lora_id]
            self._lru.move_to_end(lora_id)
            if entry.slot is not None:
                continue
            if not entry.on_host:
                raise RuntimeError(f"LoRA adapter {entry.name!r} is not in host memory")
            slot = self._free_slot(keep)
            if slot is None:
                raise RuntimeError(
                    f"no LoRA device slot for {entry.name!r}: the others are pinned or in use"
                )
            self._put(entry, slot)
            loads.append(SlotLoad(lora_id, slot))
        return loads + self._place_pinned(keep)

    def _place_pinned(self, keep: set[int]) -> list[SlotLoad]:
        """Move pinned adapters waiting for a slot in, never at the cost of a slot that
        requests holding an unpinned adapter need: the adapters in use plus the pinned ones
        on the device stay within max_loras, so every later step still fits."""
        loads = []
        for entry in self._by_id.values():
            if not entry.pinned or entry.slot is not None or not entry.on_host:
                continue
            busy = {e.lora_id for e in self._by_id.values() if e.users and not e.pinned}
            placed = sum(1 for e in self._by_id.values() if e.pinned and e.slot is not None)
            if len(busy) + placed + 1 > self.max_loras:
                break
            slot = self._free_slot(keep | busy)
            if slot is None:
                break
            self._put(entry, slot)
            loads.append(SlotLoad(entry.lora_id, slot))
        return loads

    def _free_slot(self, keep: set[int]) -> int | None:
        """A free slot, else the slot of the least recently used unpinned adapter not in
        ``keep`` (moved out), an idle one (no request holds it) before one in use, else
        None."""
        for slot, lora_id in enumerate(self._slots):
            if lora_id is None:
                return slot
        movable = [
            e
            for e in (self._by_id[i] for i in self._lru)
            if e.slot is not None and not e.pinned and e.lora_id not in keep
        ]
        movable.sort(key=lambda e: e.users > 0)  # stable: LRU order within idle, then busy
        if not movable:
            return None
        victim = movable[0]
        freed = victim.slot
        assert freed is not None
        victim.slot = None
        self._slots[freed] = None
        return freed

    def _put(self, entry: LoRAEntry, slot: int) -> None:
        self._slots[slot] = entry.lora_id
        entry.slot = slot
