"""The LoRA registry's bookkeeping, without torch: exact slots, eviction order, pinning, deferred
removal, host-memory trimming and the scheduler's admission rule."""

from __future__ import annotations

import pytest

from engine_svc.lora.errors import LoRACapacityError, LoRAExistsError, LoRANotFoundError
from engine_svc.lora.registry import LoRARegistry, SlotLoad


def registry(max_loras: int, names: str, max_cpu_loras: int | None = None) -> LoRARegistry:
    reg = LoRARegistry(max_loras, max_cpu_loras)
    for name in names:
        reg.add(name, f"/adapters/{name}", rank=8)
    return reg


def ids(reg: LoRARegistry, names: str) -> list[int]:
    return [reg.get(n).lora_id for n in names]


def test_ids_are_sequential_never_reused_and_names_unique() -> None:
    reg = registry(2, "ab")
    assert ids(reg, "ab") == [1, 2]
    with pytest.raises(LoRAExistsError, match="'a'"):
        reg.add("a", "/x", 8)
    reg.remove("a")
    entry, _ = reg.add("a", "/adapters/a2", 8)
    assert entry.lora_id == 3  # a new adapter: the prefix cache never confuses the two
    assert [(i.name, i.lora_id, i.path) for i in reg.infos()] == [
        ("b", 2, "/adapters/b"),
        ("a", 3, "/adapters/a2"),
    ]
    with pytest.raises(LoRANotFoundError, match="'zz'"):
        reg.get("zz")


def test_free_slots_first_then_least_recently_used_moves_out() -> None:
    reg = registry(2, "abc")
    a, b, c = ids(reg, "abc")
    assert reg.assign_slots([a]) == [SlotLoad(a, 0)]
    assert reg.assign_slots([b]) == [SlotLoad(b, 1)]
    assert reg.assign_slots([a, b]) == []  # both resident: nothing moves
    # b was used after a: a is the least recently used and leaves slot 0
    assert reg.assign_slots([c]) == [SlotLoad(c, 0)]
    assert reg.slots() == [c, b]
    # now b is the least recently used
    assert reg.assign_slots([a]) == [SlotLoad(a, 1)]
    assert reg.slots() == [c, a]
    assert reg.lru_order() == [b, c, a]
    assert [i.on_device for i in reg.infos()] == [True, False, True]


def test_the_steps_own_adapters_are_never_moved_out_for_each_other() -> None:
    reg = registry(2, "abc")
    a, b, c = ids(reg, "abc")
    reg.assign_slots([a, b])
    reg.acquire("a")  # a used more recently than b, but both needed below
    assert reg.assign_slots([b, c]) == [SlotLoad(c, 0)]  # a leaves, not b (needed)
    with pytest.raises(RuntimeError, match="3 LoRA adapters but there are 2 slots"):
        reg.assign_slots([a, b, c])


def test_acquire_counts_as_use() -> None:
    reg = registry(2, "abc")
    a, b, c = ids(reg, "abc")
    reg.assign_slots([a])
    reg.assign_slots([b])
    reg.acquire("a")  # a request for a arrives: b is now the least recently used
    assert reg.assign_slots([c]) == [SlotLoad(c, 1)]


def test_pinned_adapters_are_never_moved_out() -> None:
    reg = registry(2, "abcd")
    a, b, c, d = ids(reg, "abcd")
    assert reg.pin("a") == [SlotLoad(a, 0)]  # a free slot: moves in at once
    assert reg.pin("a") == []  # no-op
    for lora_id in (b, c, d, b, c):
        loads = reg.assign_slots([lora_id])
        assert loads == [SlotLoad(lora_id, 1)]  # only the unpinned slot churns
        assert reg.slots() == [a, lora_id]
    assert reg.infos()[0].pinned and reg.infos()[0].on_device


def test_pin_waits_for_a_slot_the_running_requests_do_not_need() -> None:
    reg = registry(2, "abc")
    a, b, c = ids(reg, "abc")
    reg.assign_slots([a, b])
    assert reg.pin("c", running=[a, b]) == []  # both slots busy: c waits, pinned
    assert reg.get("c").pinned and reg.get("c").slot is None
    # b's requests finished: the next step needs only a, and c takes b's slot
    assert reg.assign_slots([a]) == [SlotLoad(c, 1)]
    assert reg.slots() == [a, c]


def test_pin_refused_when_it_would_strand_requests_or_every_slot_is_pinned() -> None:
    reg = registry(2, "abc")
    reg.acquire("c")  # a request waits for the unpinned c
    reg.pin("a")
    with pytest.raises(LoRACapacityError, match=r"last of 2 .* \bc\b"):
        reg.pin("b")
    assert not reg.get("b").pinned
    reg.release(reg.get("c").lora_id)
    reg.pin("b")  # nobody waits for an unpinned adapter now
    with pytest.raises(LoRACapacityError, match="all 2 LoRA device slots are pinned"):
        reg.pin("c")
    with pytest.raises(LoRACapacityError, match="'c' cannot run"):
        reg.acquire("c")  # it could never get a slot: refused rather than left waiting
    reg.acquire("a")  # pinned adapters still serve
    with pytest.raises(LoRACapacityError):
        reg.add("d", "/d", 8, pin=True)
    assert "d" not in [i.name for i in reg.infos()]


def test_can_admit_counts_running_and_pinned_adapters() -> None:
    reg = registry(2, "abcd")
    a, b, c, d = ids(reg, "abcd")
    assert reg.can_admit(a, set())
    assert reg.can_admit(b, {a})
    assert not reg.can_admit(c, {a, b})
    assert reg.can_admit(a, {a, b})  # its adapter already runs
    reg.pin("d")
    assert not reg.can_admit(b, {a})  # a, d (pinned) and b: three adapters, two slots
    assert reg.can_admit(d, {a})
    assert reg.can_admit(a, set())


def test_remove_unused_drops_at_once() -> None:
    reg = registry(2, "ab")
    a, b = ids(reg, "ab")
    reg.assign_slots([a, b])
    entry, dropped = reg.remove("a")
    assert dropped.adapters == [a] and entry.removed
    assert reg.slots() == [None, b]
    with pytest.raises(LoRANotFoundError):
        reg.remove("a")


def test_remove_in_use_is_deferred_until_the_last_request_ends() -> None:
    reg = registry(2, "ab")
    a, _ = ids(reg, "ab")
    reg.acquire("a")
    reg.acquire("a")
    reg.assign_slots([a])
    _, dropped = reg.remove("a")
    assert dropped.adapters == []
    with pytest.raises(LoRANotFoundError):
        reg.acquire("a")  # new requests naming it are refused at once
    assert [i.name for i in reg.infos()] == ["b"]
    assert reg.assign_slots([a]) == []  # the running ones keep their slot and weights
    assert reg.release(a).adapters == []
    assert reg.release(a).adapters == [a]  # the last one: gone, slot free
    assert reg.slots() == [None, None]
    with pytest.raises(KeyError):
        reg.entry(a)


def test_release_more_than_acquired_is_a_bug() -> None:
    reg = registry(1, "a")
    with pytest.raises(RuntimeError, match="released more often"):
        reg.release(reg.get("a").lora_id)


def test_host_copies_beyond_max_cpu_loras_are_dropped_lru_first() -> None:
    reg = LoRARegistry(2, max_cpu_loras=2)
    a = reg.add("a", "/a", 8)[0].lora_id
    b = reg.add("b", "/b", 8)[0].lora_id
    entry, dropped = reg.add("c", "/c", 8)
    assert dropped.host == [a]  # a is the least recently used
    assert not reg.get("a").on_host and reg.get("b").on_host and entry.on_host
    # a request for a: it is read again, and b (now least recent) makes room
    reg.acquire("a")
    assert reg.loaded(a).host == [b]
    # adapters in use or pinned stay, even above the bound
    reg.pin("c")
    entry_d, dropped = reg.add("d", "/d", 8)
    assert dropped.host == []
    d = entry_d.lora_id
    assert [i.name for i in reg.infos()] == ["a", "b", "c", "d"]
    assert {e: reg.entry(e).on_host for e in (a, b, d)} == {a: True, b: False, d: True}
    # a's request ends: a is idle now, and the trim can take it
    assert reg.release(a).host == [a]


def test_dropping_a_host_copy_frees_its_slot() -> None:
    reg = LoRARegistry(1, max_cpu_loras=1)
    a = reg.add("a", "/a", 8)[0].lora_id
    reg.assign_slots([a])
    b = reg.add("b", "/b", 8)[0]
    assert reg.slots() == [None] and not reg.get("a").on_host
    with pytest.raises(RuntimeError, match="not in host memory"):
        reg.assign_slots([a])
    assert reg.assign_slots([b.lora_id]) == [SlotLoad(b.lora_id, 0)]


def test_bad_limits() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        LoRARegistry(0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRARegistry(4, max_cpu_loras=2)


def test_a_pin_never_takes_the_slot_of_an_adapter_requests_hold() -> None:
    """A pin placed while a running request's adapter sits out a step (its tokens did not fit
    the budget) would leave that adapter no slot in the next step."""
    reg = registry(2, "abc")
    a, b, c = ids(reg, "abc")
    reg.acquire("a")
    reg.acquire("b")
    reg.assign_slots([a, b])
    reg.pin("c", running=[a, b])
    assert reg.assign_slots([a]) == []  # b is not in this step but still held: c waits
    assert reg.assign_slots([a, b]) == []
    reg.release(b)
    assert reg.assign_slots([a]) == [SlotLoad(c, 1)]  # b idle now: c takes its slot


def test_idle_adapters_move_out_before_ones_in_use() -> None:
    reg = registry(2, "abc")
    a, b, c = ids(reg, "abc")
    reg.assign_slots([a])
    reg.assign_slots([b])
    reg.acquire("a")  # a is held by a request; b is idle though more recently used
    reg.assign_slots([b])  # b most recent
    reg.acquire("c")
    assert reg.assign_slots([c]) == [SlotLoad(c, 1)]  # b (idle) leaves, not a (in use)
