"""FlashAttention-2 prefill's plumbing on the CPU (``kernels.flash_prefill``): the rows it packs,
the context it gathers from the paged cache, the cumulative lengths and the mask alignment it
relies on, checked with an independent variable-length attention in place of the CUDA kernel.
The kernel itself runs in tests/gpu/test_flash_prefill.py and in the engine's start-up check.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import attention_backends, flash_prefill, reference, self_check
from tests.gpu.helpers import make_case


def varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    *,
    top_left: bool = False,
) -> torch.Tensor:
    """Causal attention per packed row in float32, the mask aligned to the row's last key as
    FlashAttention-2 does (``top_left``: aligned to the first, which is wrong for a chunk after
    a cached prefix)."""
    assert cu_q.dtype == cu_k.dtype == torch.int32
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for r in range(cu_q.shape[0] - 1):
        qa, qb, ka, kb = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        assert qb - qa <= max_q and kb - ka <= max_k and qb - qa <= kb - ka
        qr = q[qa:qb].float().transpose(0, 1)  # [H, q, D]
        kr = k[ka:kb].float().repeat_interleave(group, 1).transpose(0, 1)
        vr = v[ka:kb].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = qr @ kr.transpose(1, 2) * scale
        shift = 0 if top_left else (kb - ka) - (qb - qa)
        qpos = torch.arange(qb - qa)[:, None] + shift
        scores.masked_fill_(torch.arange(kb - ka)[None, :] > qpos, float("-inf"))
        out[qa:qb] = (scores.softmax(-1) @ vr).transpose(0, 1).to(q.dtype)
    return out


# (q_lens, seq_lens): leading single tokens are decodes.
CASES = [
    ([5], [5]),  # one whole prompt
    ([7, 16, 17], [7, 16, 17]),  # whole prompts across block boundaries
    ([6], [40]),  # a chunk after a cached prefix
    ([1, 1, 6, 19], [700, 33, 40, 19]),  # decodes, a chunk after a prefix, a whole prompt
    ([3, 32, 1], [35, 32, 64]),  # a decode-sized chunk after the first row is still a chunk
]


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("with_new_kv", [False, True])
def test_prefill_rows_match_the_reference(
    q_lens: list[int], seq_lens: list[int], heads: tuple[int, int], with_new_kv: bool
) -> None:
    case = make_case(q_lens, seq_lens, *heads, 32, torch.float32, device="cpu", seed=3)
    meta = case.meta
    case.poison_unused_slots()
    new_kv = None
    if with_new_kv:
        flat = (case.key_cache.flatten(0, 1), case.value_cache.flatten(0, 1))
        new_kv = (flat[0][meta.slot_mapping], flat[1][meta.slot_mapping])
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache, meta, case.scale)
    out = torch.full_like(case.query, float("nan"))
    flash_prefill.prefill(
        out, case.query, case.key_cache, case.value_cache, meta, case.scale, new_kv,
        varlen_reference,
    )  # fmt: skip
    first_prefill_token = meta.query_start_loc_cpu[meta.num_decodes]
    assert out[:first_prefill_token].isnan().all(), "decode rows are not the prefill's to write"
    rows = slice(first_prefill_token, meta.num_tokens)
    assert not out[rows].isnan().any()
    torch.testing.assert_close(out[rows], want[rows], atol=1e-5, rtol=1e-5)


def test_whole_prompts_read_the_steps_own_kv_and_chunks_gather() -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # type: ignore[no-untyped-def]
        seen.append((k, cu_k))
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    own_k: list[torch.Tensor] = []
    for q_lens, seq_lens in (([1, 9, 12], [50, 9, 12]), ([1, 9, 4], [50, 9, 12])):
        case = make_case(q_lens, seq_lens, 4, 2, 32, torch.float32, device="cpu")
        flat = case.key_cache.flatten(0, 1)
        new_k = flat[case.meta.slot_mapping]
        own_k.append(new_k)
        new_kv = (new_k, case.value_cache.flatten(0, 1)[case.meta.slot_mapping])
        out = torch.empty_like(case.query)
        flash_prefill.prefill(
            out, case.query, case.key_cache, case.value_cache, case.meta, case.scale, new_kv, spy
        )
    (whole_k, whole_cu), (chunk_k, chunk_cu) = seen
    # No prefix anywhere: the step's own K/V of the prefill rows, not a gathered copy.
    assert whole_k.data_ptr() == own_k[0][1:].data_ptr() and whole_k.shape[0] == 21
    assert whole_cu.tolist() == [0, 9, 21]
    # The second row starts 8 tokens into its context: whole contexts gathered, 9 + 12 keys.
    assert chunk_k.shape[0] == 21 and chunk_cu.tolist() == [0, 9, 21]


def test_context_slots_walk_each_rows_blocks() -> None:
    tables = torch.tensor([[5, 2, 9], [7, 3, 0]], dtype=torch.int32)
    lens = torch.tensor([35, 17])
    got = flash_prefill.context_slots(tables, lens, 52, block_size=16)
    want = [int(tables[r, t // 16]) * 16 + t % 16 for r in range(2) for t in range(int(lens[r]))]
    assert got.dtype == torch.int64 and got.tolist() == want


def test_a_decode_only_step_calls_nothing() -> None:
    case = make_case([1, 1], [30, 4], 4, 2, 32, torch.float32, device="cpu")

    def never(*args: object) -> torch.Tensor:
        raise AssertionError("no prefill rows: the kernel must not be called")

    out = torch.zeros_like(case.query)
    flash_prefill.prefill(
        out, case.query, case.key_cache, case.value_cache, case.meta, case.scale, None, never
    )
    assert not out.any()


def test_start_up_check_catches_a_top_left_mask() -> None:
    cpu = torch.device("cpu")
    self_check.check_flash_prefill(cpu, torch.float32, 32, 16, (4, 2), varlen_reference)

    def top_left(*args):  # type: ignore[no-untyped-def]
        return varlen_reference(*args, top_left=True)

    with pytest.raises(self_check.KernelCheckFailed, match="flash prefill"):
        self_check.check_flash_prefill(cpu, torch.float32, 32, 16, (4, 2), top_left)


@pytest.mark.parametrize(
    "dtype,head_dim,capability,built,reason",
    [
        (torch.float32, 128, (9, 0), True, "float16 and bfloat16"),
        (torch.bfloat16, 260, (9, 0), True, "head sizes"),
        (torch.bfloat16, 100, (9, 0), True, "head sizes"),
        (torch.float16, 128, (7, 5), True, "sm_80"),
        (torch.bfloat16, 128, (9, 0), False, "no FlashAttention-2"),
        (torch.bfloat16, 128, (9, 0), True, None),
        (torch.float16, 256, (8, 0), True, None),
    ],
)
def test_where_it_runs(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int],
    built: bool,
    reason: str | None,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: built)
    got = flash_prefill.unsupported(torch.device("cuda"), dtype, head_dim)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got
    assert "CUDA device" in (flash_prefill.unsupported(torch.device("cpu"), dtype, 128) or "")


@pytest.mark.parametrize("check_fails", [False, True])
def test_backend_takes_flash_only_when_it_passes_its_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, check_fails: bool
) -> None:
    monkeypatch.setattr(flash_prefill, "unsupported", lambda *a: None)

    def check(*args: object) -> None:
        if check_fails:
            raise self_check.KernelCheckFailed("flash prefill disagrees with its reference")

    monkeypatch.setattr(self_check, "check_flash_prefill", check)
    with caplog.at_level(logging.INFO, logger="kernels.attention_backends"):
        took = attention_backends._flash_prefill(
            torch.device("cuda"), torch.bfloat16, 128, 16, (16, 8)
        )
    assert took is not check_fails
    if check_fails:
        assert "paged_prefill.cu" in caplog.text and "disagrees" in caplog.text
    else:
        assert "FlashAttention-2" in caplog.text


def test_unsupported_is_logged_and_the_scalar_kernel_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kernels.attention_backends"):
        took = attention_backends._flash_prefill(
            torch.device("cuda"), torch.float32, 128, 16, (16, 8)
        )
    assert not took and "float16 and bfloat16" in caplog.text
