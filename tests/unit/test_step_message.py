"""The tensor-parallel step message (engine_svc/executor/step_message.py): what a worker decodes
is rank 0's schedule, row for row in rank 0's order, with mirrors holding rank 0's counters and
tokens, through admissions, decodes with new blocks, preemption and finishing; each row's
proposals (speculative decoding), and a worker's batch row taking rank 0's tokens after a
verification (``worker_proc._take_rank0_tokens``)."""

from __future__ import annotations

import pickle

import pytest
import torch

from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import ScheduledRequest, SchedulerOutput
from engine_svc.executor.step_message import RequestMirrors, StepEncoder
from engine_svc.executor.worker_proc import _take_rank0_tokens
from engine_svc.worker.input_batch import InputBatch


def _same(so: SchedulerOutput, got: SchedulerOutput, mirrors: RequestMirrors) -> None:
    assert [
        (s.request.request_id, s.num_tokens, s.admitted, list(s.block_ids)) for s in got.scheduled
    ] == [(s.request.request_id, s.num_tokens, s.admitted, list(s.block_ids)) for s in so.scheduled]
    for s in so.scheduled:
        mirror = mirrors.requests[s.request.request_id]
        assert mirror.all_token_ids == s.request.all_token_ids
        assert mirror.num_computed_tokens == s.request.num_computed_tokens
    assert (got.preempted_ids, got.finished_ids) == (so.preempted_ids, so.finished_ids)


def test_a_worker_decodes_rank_0s_schedule_step_after_step() -> None:
    enc, mirrors = StepEncoder(), RequestMirrors()
    a, b, c = (Request(r, [1, 2, 3, 4], SamplingParams(max_tokens=50)) for r in "abc")

    def send(so: SchedulerOutput) -> None:
        got = mirrors.decode(pickle.loads(pickle.dumps(enc.encode(so))))
        _same(so, got, mirrors)

    send(SchedulerOutput([ScheduledRequest(a, 4, True, [0]), ScheduledRequest(b, 2, True, [1])], 6))
    a.num_computed_tokens, b.num_computed_tokens = 4, 2
    a.append_output_token(9)
    # a decodes; b prefills its second chunk; c is admitted between them (schedule order kept)
    send(SchedulerOutput([ScheduledRequest(a, 1, False, []), ScheduledRequest(c, 4, True, [2]),
                          ScheduledRequest(b, 2, False, [])], 7))  # fmt: skip
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 5, 4, 4
    for r, tokens in ((a, [8, 7, 6]), (b, [5]), (c, [4])):  # a verified proposals: 3 tokens
        for t in tokens:
            r.append_output_token(t)
    send(SchedulerOutput([ScheduledRequest(a, 1, False, [3]), ScheduledRequest(b, 1, False, []),
                          ScheduledRequest(c, 1, False, [4, 5])], 3))  # fmt: skip
    # b is preempted, c finished: their mirrors go; b comes back admitted as a whole copy
    b.num_computed_tokens = 0
    send(SchedulerOutput([ScheduledRequest(a, 1, False, [])], 1, ["b"], ["c"]))
    assert set(mirrors.requests) == {"a"}
    send(SchedulerOutput([ScheduledRequest(b, 5, True, [1])], 5))
    assert set(mirrors.requests) == {"a", "b"}


def test_proposals_reach_the_worker_row_by_row() -> None:
    """Speculative decoding: each running row's proposals, in its ScheduledRequest on the
    worker too; a message without any carries no column for them."""
    enc, mirrors = StepEncoder(), RequestMirrors()
    a, b, c = (Request(r, [1, 2, 3, 4], SamplingParams(max_tokens=50)) for r in "abc")
    first = SchedulerOutput(
        [ScheduledRequest(r, 4, True, [i]) for i, r in enumerate((a, b, c))], 12
    )
    msg = enc.encode(first)
    assert msg.spec_counts == msg.spec_tokens == []
    mirrors.decode(msg)
    for r, t in ((a, 9), (b, 8), (c, 7)):
        r.num_computed_tokens = 4
        r.append_output_token(t)
    so = SchedulerOutput(
        [ScheduledRequest(a, 3, False, [], [11, 12]), ScheduledRequest(b, 1, False, []),
         ScheduledRequest(c, 2, False, [3], [13])], 6,
    )  # fmt: skip
    msg = pickle.loads(pickle.dumps(enc.encode(so)))
    assert (msg.spec_counts, msg.spec_tokens) == ([2, 0, 1], [11, 12, 13])
    got = mirrors.decode(msg)
    _same(so, got, mirrors)
    assert [list(s.spec_token_ids) for s in got.scheduled] == [[11, 12], [], [13]]


def test_a_worker_row_takes_rank_0s_tokens_and_count_after_a_verification() -> None:
    """After a verification the worker may have emitted another number of tokens than rank 0
    (its own draws): its batch row takes rank 0's tokens and count, and a row with penalties
    its output counts; a row that emitted nothing where rank 0 did is out of step."""
    enc, mirrors = StepEncoder(), RequestMirrors()
    batch = InputBatch(4, 64, 4, 32, torch.device("cpu"))
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=20, repetition_penalty=1.2))
    b = Request("b", [5, 6, 7], SamplingParams(max_tokens=20))
    so = SchedulerOutput([ScheduledRequest(a, 4, True, [0]), ScheduledRequest(b, 3, True, [1])], 7)
    for s in mirrors.decode(enc.encode(so)).scheduled:
        batch.add(s.request, s.block_ids)
    # this rank emitted 1 token for a, 3 for b; rank 0 the other way round
    mine = {"a": [20], "b": [21, 22, 23]}
    rank0 = {"a": [30, 31, 30], "b": [24]}
    for rid, tokens in mine.items():
        for t in tokens:
            row = batch.row_of[rid]
            batch.append_sampled([row], [t], torch.tensor([t]))
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        for t in rank0[r.request_id]:
            r.append_output_token(t)
    so = SchedulerOutput([ScheduledRequest(a, 1, False, []), ScheduledRequest(b, 1, False, [])], 2)
    msg = enc.encode(so)
    mirrors.decode(msg)
    _take_rank0_tokens(batch, msg, mirrors)
    for r in (a, b):
        row = batch.row_of[r.request_id]
        assert batch.num_tokens[row] == r.num_tokens
        assert batch.token_ids[row, : r.num_tokens].tolist() == r.all_token_ids
    assert batch.output_counts is not None and batch.seen_mask is not None
    row = batch.row_of["a"]
    want = torch.bincount(torch.tensor([30, 31, 30]), minlength=32).to(torch.int32)
    assert torch.equal(batch.output_counts[row], want)
    assert batch.seen_mask[row].nonzero().view(-1).tolist() == [1, 2, 3, 4, 30, 31]
    # b emitted nothing on this rank where rank 0 emitted a token: out of step
    b.num_computed_tokens = b.num_tokens
    b.append_output_token(25)
    msg = enc.encode(SchedulerOutput([ScheduledRequest(b, 1, False, [])], 1))
    mirrors.decode(msg)
    with pytest.raises(RuntimeError, match="request b: this rank holds 4 tokens, rank 0 5"):
        _take_rank0_tokens(batch, msg, mirrors)
