"""The engine's utility calls in process: reset_prefix_cache (exact block-pool state), sleep
levels 1 and 2 then wake_up (same greedy tokens, KV cache freed and reallocated, memory measured
on the CPU), and the torch profiler."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import pytest
import torch

from engine_svc.core.errors import EngineAsleepError
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.entrypoints.llm import LLM
from engine_svc.profiler import ProfilerError
from engine_svc.worker import sleep_mode

BS = 4
PREFIX = [11, 12, 13, 14, 21, 22, 23, 24]  # two full blocks
OTHER = [41, 42, 43, 44, 45, 46, 47, 48]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    {"prompt_token_ids": [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 137, 149, 161, 173, 185]},
    {"prompt_token_ids": [7, 8, 9, 10, 11, 12, 13]},
]


def _admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams())
    hits, num_computed = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_computed, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return req


def _hits(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    probe = Request("probe", tokens, SamplingParams())
    hits, _ = kv.get_computed_blocks(probe)
    kv.free(probe)  # holds nothing; forgets the hashes it computed under its id
    return [b.block_id for b in hits]


# ------------------------------------------------------------------ reset_prefix_cache
def test_reset_prefix_cache_drops_free_entries_and_keeps_those_in_use() -> None:
    kv = KVCacheManager(10, BS)
    r1 = _admit(kv, "r1", PREFIX + [31])  # blocks 0 1 2; 0 and 1 published
    r2 = _admit(kv, "r2", OTHER + [49])  # blocks 3 4 5; 3 and 4 published
    kv.free(r2)  # last block first: 5 4 3 join the free queue, 3 and 4 still cached
    assert _hits(kv, OTHER + [50]) == [3, 4]

    assert kv.reset_prefix_cache() is False  # r1's blocks are in use
    assert _hits(kv, OTHER + [50]) == []  # the free blocks' entries are gone ...
    assert [kv.pool.blocks[i].block_hash for i in (3, 4)] == [None, None]
    assert _hits(kv, PREFIX + [32]) == [0, 1]  # ... those in use kept theirs
    assert kv.pool.free_block_ids() == [6, 7, 8, 9, 5, 4, 3]  # eviction order untouched
    assert kv.num_free_blocks == 7

    kv.free(r1)
    assert kv.reset_prefix_cache() is True
    assert _hits(kv, PREFIX + [32]) == []
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.pool.free_block_ids() == [6, 7, 8, 9, 5, 4, 3, 2, 1, 0]


def test_reset_prefix_cache_of_an_empty_pool() -> None:
    assert KVCacheManager(4, BS).reset_prefix_cache() is True


# ------------------------------------------------------------------ the offline LLM
def _llm(model: Path, **kw: object) -> LLM:
    kw = {"block_size": 4, "num_kv_blocks": 64, **kw}
    return LLM(model, dtype="float32", device="cpu", **kw)  # type: ignore[arg-type]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def test_llm_reset_prefix_cache_makes_the_next_request_compute_its_prompt(llama: Path) -> None:
    llm = _llm(llama)
    prompt = PROMPTS[:1]
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 12  # 3 full blocks of 4 (the last token is computed)
    assert llm.reset_prefix_cache() is True
    after = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_up_gives_the_same_tokens(llama: Path, level: int) -> None:
    llm = _llm(llama)
    runner = llm.engine.runner
    before = _tokens(llm)
    weights = {k: v.clone() for k, v in runner.model.state_dict().items()}
    kv_bytes = runner.kv_cache_nbytes()
    assert kv_bytes == 64 * runner.layout.bytes_per_block

    llm.sleep(level)
    assert llm.is_sleeping()
    assert runner.sleep_level == level
    assert runner.kv_caches == [] and runner.kv_cache_nbytes() == 0
    params = list(runner.model.parameters())
    if level == 2:  # weights dropped
        assert all(p.numel() == 0 for p in params)
    else:  # on the CPU the weights stay in host memory, where they are
        assert all(p.numel() > 0 for p in params)
    assert all(b.block_hash is None for b in llm.engine.kv.pool.blocks)  # prefix cache reset
    with pytest.raises(EngineAsleepError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.engine.has_unfinished_requests()  # the refused requests left nothing behind

    llm.wake_up()
    assert not llm.is_sleeping()
    assert runner.kv_cache_nbytes() == kv_bytes  # the same number of blocks ...
    assert all(int(t.count_nonzero()) == 0 for kv in runner.kv_caches for t in kv)  # ... empty
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    after_weights = runner.model.state_dict()
    assert after_weights.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(after_weights[name], w), name
    assert _tokens(llm) == before


def test_sleep_again_and_wake_up_when_awake_are_no_ops(llama: Path) -> None:
    llm = _llm(llama)
    before = _tokens(llm)
    llm.wake_up()  # awake: nothing happens
    llm.sleep(1)
    llm.sleep(2)  # asleep already: stays at level 1
    assert llm.engine.runner.sleep_level == 1
    llm.wake_up()
    llm.wake_up()
    assert _tokens(llm) == before


def test_a_sleep_that_fails_part_way_leaves_the_engine_awake(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Level 2 empties the parameters one by one; the fifth emptying fails (as a pinned host
    copy can on a GPU): the four taken are read back from the checkpoint, the KV cache comes
    back, and the engine serves the same tokens."""
    llm = _llm(llama)
    runner = llm.engine.runner
    before = _tokens(llm)
    weights = {k: v.clone() for k, v in runner.model.state_dict().items()}
    real_empty = torch.empty
    calls = 0

    def failing_empty(*args: object, **kw: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("out of memory (injected)")
        return real_empty(*args, **kw)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(sleep_mode.torch, "empty", failing_empty)
    with pytest.raises(RuntimeError, match="injected"):
        llm.sleep(2)
    monkeypatch.undo()
    assert not llm.is_sleeping() and runner.sleep_level == 0
    assert runner.kv_cache_nbytes() == 64 * runner.layout.bytes_per_block
    after = runner.model.state_dict()
    for name, w in weights.items():
        assert torch.equal(after[name], w), name
    assert _tokens(llm) == before
    llm.sleep(2)  # and it can still go to sleep, and wake up
    llm.wake_up()
    assert _tokens(llm) == before


def test_a_wake_up_that_fails_can_be_tried_again(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No memory for the KV cache on wake up: the engine stays asleep (refusing work), and the
    next wake up brings it back whole."""
    llm = _llm(llama)
    runner = llm.engine.runner
    before = _tokens(llm)
    llm.sleep(2)

    def no_memory() -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(runner, "_allocate_kv_caches", no_memory)
    with pytest.raises(RuntimeError, match="injected"):
        llm.wake_up()
    monkeypatch.undo()
    assert llm.is_sleeping()
    with pytest.raises(EngineAsleepError):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _tokens(llm) == before


def test_sleep_rejects_a_bad_level(llama: Path) -> None:
    llm = _llm(llama)
    for level in (0, 3):
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            llm.sleep(level)
    assert not llm.is_sleeping()


def test_sleep_refuses_while_requests_are_in_flight(llama: Path) -> None:
    llm = _llm(llama)
    llm.engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.engine.sleep(1)
    assert not llm.is_sleeping()
    llm.engine.run_until_idle()
    llm.engine.sleep(1)
    assert llm.is_sleeping()


def test_lora_slots_survive_sleep(llama: Path) -> None:
    llm = _llm(llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    lora = llm.engine.runner.lora
    assert lora is not None
    slots = lora.weights.tensors()
    for t in slots:  # what adapters in device slots would hold
        t.copy_(torch.randn_like(t))
    saved = [t.clone() for t in slots]
    llm.sleep(2)
    llm.wake_up()
    assert all(torch.equal(t, s) for t, s in zip(lora.weights.tensors(), saved, strict=True))
    assert all(a is b for a, b in zip(lora.weights.tensors(), slots, strict=True))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_frees_the_kv_cache_memory(llama: Path) -> None:
    # 256 MiB of KV cache: 2 layers x (K, V) = four 64 MiB tensors.
    llm = LLM(llama, dtype="float32", device="cpu", kv_cache_memory="256MiB")
    runner = llm.engine.runner
    kv_bytes = runner.kv_cache_nbytes()
    assert kv_bytes > 250 * 2**20
    before = _tokens(llm)
    alive = [weakref.ref(t) for kv in runner.kv_caches for t in kv]
    awake = _rss()
    llm.sleep(1)
    asleep = _rss()
    assert all(ref() is None for ref in alive)  # nothing else held a KV tensor
    # Its memory went back to the system: even a tensor glibc placed in a free region of its
    # heap (the process's earlier garbage) rather than in a mapping of its own.
    assert awake - asleep > 0.9 * kv_bytes, (awake, asleep, kv_bytes)
    llm.wake_up()
    assert _rss() - asleep > 0.9 * kv_bytes  # zeroed again: every page touched
    assert runner.kv_cache_nbytes() == kv_bytes
    assert _tokens(llm) == before


# ------------------------------------------------------------------ profiler
def test_profile_without_a_directory_is_refused(llama: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TANDEM_PROFILE_DIR", raising=False)
    llm = _llm(llama)
    with pytest.raises(ProfilerError, match="--profile-dir"):
        llm.start_profile()
    with pytest.raises(ProfilerError, match="no profile is running"):
        llm.stop_profile()


def test_profile_writes_a_chrome_trace(llama: Path, tmp_path: Path) -> None:
    llm = _llm(llama, profile_dir=tmp_path / "traces")
    llm.start_profile()
    with pytest.raises(ProfilerError, match="already running"):
        llm.start_profile()
    _tokens(llm)
    path = Path(llm.stop_profile())
    assert path.parent == tmp_path / "traces" and path.is_file()
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)  # the steps' torch ops are in it
    with pytest.raises(ProfilerError, match="no profile is running"):
        llm.stop_profile()
    llm.start_profile()  # a second profile, into a second file
    assert Path(llm.stop_profile()) != path
