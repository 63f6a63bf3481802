"""Sampler as pure functions: filters, penalties, seeded draws, logprobs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine_svc.worker.sampler import Penalties, SamplingMetadata, apply_penalties, sample


def _md(b: int, **kw: object) -> SamplingMetadata:
    base: dict[str, object] = dict(
        temperature=torch.ones(b),
        all_greedy=False,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
    )
    base.update(kw)
    return SamplingMetadata(**base)  # type: ignore[arg-type]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    out = sample(logits, _md(5, temperature=torch.zeros(5), all_greedy=True))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(4, 50)
    temp = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = sample(logits, _md(4, temperature=temp))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_filters_that_keep_one_token_equal_greedy() -> None:
    logits = torch.randn(6, 100)
    greedy = logits.argmax(-1).tolist()
    for kw in (
        {"top_k": torch.ones(6, dtype=torch.int64)},
        {"top_p": torch.full((6,), 1e-6)},
        {"min_p": torch.ones(6)},
    ):
        for _ in range(5):
            assert sample(logits, _md(6, **kw)).token_ids.tolist() == greedy


def test_top_k_restricts_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 30).repeat(400, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    out = sample(logits, _md(400, top_k=torch.full((400,), 5)))
    drawn = set(out.token_ids.tolist())
    assert drawn <= top5 and len(drawn) > 1


def test_top_p_restricts_support() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(500, 1)
    out = sample(logits, _md(500, top_p=torch.full((500,), 0.7)))
    assert set(out.token_ids.tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7


def test_draws_follow_the_distribution() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 20000
    out = sample(probs.log().repeat(n, 1), _md(n))
    freq = torch.bincount(out.token_ids, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_temperature_sharpens() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -1.0]]).repeat(5000, 1)
    cold = sample(logits, _md(5000, temperature=torch.full((5000,), 0.2))).token_ids
    hot = sample(logits, _md(5000, temperature=torch.full((5000,), 2.0))).token_ids
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 64)

    def draw(batch: int, row: int) -> list[int]:
        g = torch.Generator().manual_seed(99)
        big = torch.randn(batch, 64)
        big[row] = logits[0]
        out = []
        for _ in range(10):
            out.append(int(sample(big, _md(batch, generators={row: g})).token_ids[row]))
        return out

    assert draw(1, 0) == draw(7, 3) == draw(16, 15)


def test_penalties_match_definitions() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    prompt = [[1, 2], [3]]
    output = [[2, 2, 5], [7]]
    counts = torch.zeros(2, 10, dtype=torch.int32)
    seen = torch.zeros(2, 10, dtype=torch.bool)
    for r in range(2):
        for t in output[r]:
            counts[r, t] += 1
        seen[r, prompt[r] + output[r]] = True
    pen = Penalties(
        rows=torch.tensor([0, 1]),
        presence=torch.tensor([0.0, 0.0]),
        frequency=torch.tensor([0.0, 0.0]),
        repetition=torch.tensor([1.3, 1.3]),
        output_counts=counts,
        seen_mask=seen,
    )
    got = apply_penalties(logits, pen)
    proc = RepetitionPenaltyLogitsProcessor(1.3)
    for r in range(2):
        ids = torch.tensor([prompt[r] + output[r]])
        want = proc(ids, logits[r : r + 1].clone())
        assert torch.allclose(got[r], want[0])

    pen.repetition = torch.ones(2)
    pen.presence = torch.tensor([0.5, 0.0])
    pen.frequency = torch.tensor([0.0, 0.25])
    got = apply_penalties(logits, pen)
    want = logits.clone()
    want[0, [2, 5]] -= 0.5  # presence: once per distinct output token
    want[1, 7] -= 0.25  # frequency: per occurrence
    assert torch.allclose(got, want)


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(3, 5)
    logits[:, 2] = 10.0
    md = _md(3, temperature=torch.zeros(3), all_greedy=True, banned=[(0, [2]), (2, [2, 3])])
    out = sample(logits, md).token_ids.tolist()
    assert out[1] == 2 and out[0] != 2 and out[2] not in (2, 3)


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = torch.randn(3, 40)
    md = _md(3, temperature=torch.full((3,), 0.5), max_num_logprobs=4)
    out = sample(logits, md)
    ref = torch.log_softmax(logits, -1)
    assert out.top_logprobs is not None and out.top_ids is not None
    assert out.sampled_logprobs is not None and out.sampled_ranks is not None
    assert torch.allclose(out.top_logprobs, ref.topk(4).values)
    chosen = ref.gather(1, out.token_ids[:, None])[:, 0]
    assert torch.allclose(out.sampled_logprobs, chosen)
    assert out.sampled_ranks.tolist() == [int((ref[i] > chosen[i]).sum()) + 1 for i in range(3)]


def _largest_allocation(fn: Callable[[], object]) -> int:
    """Bytes of the largest CPU allocation made while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((int(e.cpu_memory_usage) for e in prof.events()), default=0)


def _dense_penalized(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Float copy of ``logits`` with the penalties written out row by row, as defined."""
    out = logits.float().clone()
    for i, row in enumerate(pen.rows.tolist()):
        x = out[row]
        rep = float(pen.repetition[i])
        seen = pen.seen_mask[i]
        x[seen] = torch.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        counts = pen.output_counts[i].float()
        x -= float(pen.frequency[i]) * counts
        x -= float(pen.presence[i]) * (counts > 0).float()
    return out


def _penalties(rows: list[int], vocab: int, seed: int) -> Penalties:
    g = torch.Generator().manual_seed(seed)
    p = len(rows)
    counts = torch.randint(0, 3, (p, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(p, vocab, generator=g) < 0.2
    seen = (counts > 0) | (torch.rand(p, vocab, generator=g) < 0.2)
    return Penalties(
        rows=torch.tensor(rows),
        presence=torch.rand(p, generator=g) * 2 - 1,
        frequency=torch.rand(p, generator=g) * 2 - 1,
        repetition=torch.rand(p, generator=g) * 1.5 + 0.5,
        output_counts=counts,
        seen_mask=seen,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_apply_to_listed_rows_only_and_leave_logits_unmodified(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(0)
    b, vocab = 6, 40
    logits = (torch.randn(b, vocab) * 2).to(dtype)
    before = logits.clone()
    pen = _penalties([1, 4], vocab, seed=1)
    want = _dense_penalized(logits, pen)
    assert not torch.equal(want.argmax(-1), logits.float().argmax(-1))  # penalties matter here

    greedy = sample(logits, _md(b, temperature=torch.zeros(b), all_greedy=True, penalties=pen))
    assert greedy.token_ids.tolist() == want.argmax(-1).tolist()
    assert torch.equal(logits, before)

    def seeded(x: torch.Tensor, seed: int, penalties: Penalties | None) -> list[int]:
        gens = {r: torch.Generator().manual_seed(seed + r) for r in range(b)}
        temp = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 0.0])
        md = _md(b, temperature=temp, generators=gens, penalties=penalties)
        return sample(x, md).token_ids.tolist()

    for seed in range(0, 50, 10):
        assert seeded(logits, seed, pen) == seeded(want, seed, None)
    assert torch.equal(logits, before)


def test_penalties_copy_only_the_penalised_rows() -> None:
    b, vocab = 64, 4096
    logits = torch.randn(b, vocab)
    pen = _penalties([3, 60], vocab, seed=2)
    md = _md(b, temperature=torch.zeros(b), all_greedy=True, penalties=pen)
    # A [2, V] float row copy and its temporaries; never a [B, V] one (1 MiB here).
    assert _largest_allocation(lambda: sample(logits, md)) <= 2 * vocab * 4


def test_greedy_bf16_takes_no_float_copy() -> None:
    b, vocab = 64, 4096
    logits = torch.randn(b, vocab).to(torch.bfloat16)
    md = _md(b, temperature=torch.zeros(b), all_greedy=True)
    assert _largest_allocation(lambda: sample(logits, md)) < b * vocab  # a float copy: 4 bytes each
    assert sample(logits, md).token_ids.tolist() == logits.float().argmax(-1).tolist()


def test_greedy_ties_pick_the_first_maximum_in_any_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (32, 50), generator=g).float()  # many tied maxima per row
    first_max = [int((row == row.max()).nonzero()[0]) for row in logits]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        md = _md(32, temperature=torch.zeros(32), all_greedy=True)
        assert sample(logits.to(dtype), md).token_ids.tolist() == first_max
        # The greedy rows of a mixed batch go through the float path: same answer.
        temp = torch.zeros(32)
        temp[::2] = 1.0
        mixed = sample(logits.to(dtype), _md(32, temperature=temp)).token_ids.tolist()
        assert mixed[1::2] == first_max[1::2]


def test_bf16_logits_sample_like_their_float_copy() -> None:
    torch.manual_seed(0)
    b, vocab = 8, 300
    logits = (torch.randn(b, vocab) * 3).to(torch.bfloat16)
    pen = _penalties([0, 5], vocab, seed=3)

    def draw(x: torch.Tensor) -> list[int]:
        gens = {r: torch.Generator().manual_seed(7 + r) for r in range(b)}
        md = _md(
            b,
            temperature=torch.linspace(0.0, 1.5, b),
            top_k=torch.tensor([5, 300, 40, 1, 300, 17, 100, 8]),
            top_p=torch.tensor([0.9, 1.0, 0.5, 0.7, 1.0, 0.95, 0.3, 1.0]),
            min_p=torch.full((b,), 0.01),
            generators=gens,
            penalties=pen,
            banned=[(2, [int(x[2].float().argmax())]), (5, [0, 1])],
        )
        return sample(x, md).token_ids.tolist()

    assert draw(logits) == draw(logits.float())
