"""The tensor-parallel step message (engine_svc/executor/step_message.py): what a worker decodes
is rank 0's schedule, row for row in rank 0's order, with mirrors holding rank 0's counters and
tokens, through admissions, decodes with new blocks, preemption and finishing."""

from __future__ import annotations

import pickle

from engine_svc.core.request import Request
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import ScheduledRequest, SchedulerOutput
from engine_svc.executor.step_message import RequestMirrors, StepEncoder


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
