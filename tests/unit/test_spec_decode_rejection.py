"""Verification of proposed tokens (engine_svc/spec_decode/rejection.py).

Greedy: exactly what token-by-token greedy decoding emits. Sampled: every emitted token is
distributed as the target's (chi-square over many independent rows, fixed seeds), for point-mass
(n-gram) and full draft distributions; seeded rows draw from their own generator only."""

from __future__ import annotations

import torch

from engine_svc.spec_decode.rejection import verify_greedy, verify_sampled

# Chi-square critical value, 5 degrees of freedom (6 tokens), p = 1e-4: a correct sampler fails
# one such check in 10,000 runs; a sampler off by a few percent fails it every time at N rows.
CHI2_DF5 = 25.74
V = 6


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_emits_what_greedy_decoding_would() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, k = 500, 4
    target = torch.randint(0, 3, (rows, k + 1), generator=gen)
    draft = torch.randint(0, 3, (rows, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (rows,), generator=gen)
    got = verify_greedy(target, draft, num_draft)
    for r in range(rows):
        want = []
        for j in range(int(num_draft[r]) + 1):
            want.append(int(target[r, j]))  # what greedy decoding emits at this position
            if j == int(num_draft[r]) or int(draft[r, j]) != want[-1]:
                break
        n = int(got.num_emitted[r])
        assert got.tokens[r, :n].tolist() == want
        assert (got.tokens[r, n:] == -1).all()


def _target(rows: int, k: int, seed: int) -> torch.Tensor:
    """One random distribution per position, the same for every row: [rows, k + 1, V]."""
    gen = torch.Generator().manual_seed(seed)
    per_pos = torch.rand(k + 1, V, generator=gen) + 0.05
    per_pos[torch.arange(k + 1), per_pos.argmax(dim=1)] += 1.5  # one likely token (~0.6)
    per_pos /= per_pos.sum(dim=1, keepdim=True)
    return per_pos.unsqueeze(0).expand(rows, k + 1, V).contiguous()


def _check_distribution(v, target: torch.Tensor, draft: torch.Tensor) -> None:  # noqa: ANN001
    """Position 0 over all rows; position j over the rows that accepted j proposals before it
    (given those, the target at j is the same fixed distribution)."""
    k = draft.shape[1]
    for j in range(k + 1):
        reached = v.num_emitted > j
        assert int(reached.sum()) > 1000, f"too few rows reach position {j}"
        assert _chi2(v.tokens[reached, j], target[0, j]) < CHI2_DF5, f"position {j}"


def test_point_mass_proposals_keep_the_target_distribution() -> None:
    torch.manual_seed(1)
    rows, k = 100_000, 3
    target = _target(rows, k, seed=2)
    # Proposals: each position's most likely token (often accepted) or a fixed other one.
    likely = target[0].argmax(dim=1)[:k]
    draft = torch.where(torch.rand(rows, k) < 0.5, likely, torch.full((rows, k), 3))
    v = verify_sampled(target, draft, torch.full((rows,), k))
    _check_distribution(v, target, draft)
    # Acceptance is p(d): position 0 accepts the likely token at its probability.
    first_likely = draft[:, 0] == likely[0]
    rate = (v.num_emitted[first_likely] > 1).double().mean()
    assert abs(float(rate) - float(target[0, 0, likely[0]])) < 0.02


def test_draft_distributions_keep_the_target_distribution() -> None:
    torch.manual_seed(3)
    rows, k = 60_000, 2
    target = _target(rows, k, seed=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.rand(k, V, generator=gen) ** 3 + 0.01  # a peaked, wrong draft model
    q /= q.sum(dim=1, keepdim=True)
    draft_probs = q.unsqueeze(0).expand(rows, k, V).contiguous()
    draft = torch.multinomial(q.repeat(rows, 1), 1).view(rows, k)  # drawn from q per position
    v = verify_sampled(target, draft, torch.full((rows,), k), draft_probs)
    _check_distribution(v, target, draft)


def test_rows_with_fewer_proposals_end_with_the_bonus_of_their_position() -> None:
    torch.manual_seed(6)
    rows, k = 40_000, 3
    target = _target(rows, k, seed=7)
    draft = target[0].argmax(dim=1)[:k].expand(rows, k).contiguous()
    num_draft = torch.full((rows,), 1)  # only d_0 counts: at most 2 tokens
    v = verify_sampled(target, draft, num_draft)
    assert int(v.num_emitted.max()) == 2 and (v.tokens[:, 2:] == -1).all()
    second = v.num_emitted == 2
    assert _chi2(v.tokens[second, 1], target[0, 1]) < CHI2_DF5  # drawn from p_1


def test_a_seeded_row_draws_from_its_own_generator_only() -> None:
    rows, k = 8, 3
    target = _target(rows, k, seed=8)
    draft = torch.full((rows, k), 3)
    num = torch.full((rows,), k)

    def run(seed_other: int) -> torch.Tensor:
        torch.manual_seed(seed_other)  # the unseeded rows' noise
        gens = {2: torch.Generator().manual_seed(42)}
        return verify_sampled(target, draft, num, generators=gens).tokens[2]

    assert torch.equal(run(0), run(1))


def test_a_seeded_rows_draws_do_not_depend_on_the_batchs_longest_proposal() -> None:
    """A seeded row draws one uniform per proposal of its own: how many the other rows propose
    (the batch's K) does not move its stream."""
    k = 4
    target = _target(2, k, seed=9)
    draft = torch.full((2, k), 3)

    def run(width: int) -> list[int]:  # the batch's K: the other row's proposals
        gen = torch.Generator().manual_seed(7)
        out = []
        for _ in range(20):  # the stream over many steps
            v = verify_sampled(
                target[:, : width + 1],
                draft[:, :width],
                torch.tensor([2, width]),
                generators={0: gen},
                num_draft_host=[2, width],
            )
            out += v.tokens[0, : int(v.num_emitted[0])].tolist()
        return out

    assert run(2) == run(4)
