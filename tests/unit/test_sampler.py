"""Sampler as pure functions: filters, penalties, seeded draws, logprobs."""

from __future__ import annotations

import torch

from engine_svc.worker.sampler import SamplingMetadata, apply_penalties, sample


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
    md = _md(
        2,
        presence=torch.tensor([0.0, 0.0]),
        frequency=torch.tensor([0.0, 0.0]),
        repetition=torch.tensor([1.3, 1.3]),
        output_counts=counts,
        seen_mask=seen,
    )
    got = apply_penalties(logits.clone(), md)
    proc = RepetitionPenaltyLogitsProcessor(1.3)
    for r in range(2):
        ids = torch.tensor([prompt[r] + output[r]])
        want = proc(ids, logits[r : r + 1].clone())
        assert torch.allclose(got[r], want[0])

    md.repetition = torch.ones(2)
    md.presence = torch.tensor([0.5, 0.0])
    md.frequency = torch.tensor([0.0, 0.25])
    got = apply_penalties(logits.clone(), md)
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
