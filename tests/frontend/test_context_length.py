"""The gateway's context-length rule, once (generation.token_constraints.fit_context), on its
edges: which parameter a refusal names, and the max_tokens it resolves. No engine, no HTTP."""

from __future__ import annotations

import pytest

from frontend_svc.errors import ApiError
from frontend_svc.generation.token_constraints import fit_context, prepare_prompt

LEN = 256  # max_model_len


def refusal(*args: object) -> ApiError:
    with pytest.raises(ApiError) as e:
        fit_context(*args)  # type: ignore[arg-type]
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    return e.value


def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    assert fit_context(255, None, 0, LEN, "prompt", "max_tokens") == 1
    assert fit_context(10, None, 0, LEN, "prompt", "max_tokens") == 246
    assert fit_context(10, 246, 0, LEN, "prompt", "max_tokens") == 246  # exactly the rest
    assert fit_context(10, 3, 3, LEN, "prompt", "max_tokens") == 3


def test_a_prompt_that_leaves_no_room_names_the_prompt() -> None:
    for n, requested in ((256, None), (256, 1), (300, 10)):
        error = refusal(n, requested, 0, LEN, "messages", "max_completion_tokens")
        assert error.param == "messages"
        assert f"your prompt has {n} tokens" in error.message


def test_too_many_tokens_asked_names_the_max_tokens_parameter() -> None:
    error = refusal(10, 247, 0, LEN, "messages", "max_completion_tokens")
    assert error.param == "max_completion_tokens"
    assert "requested 257 tokens (10 in the prompt, 247 in the completion)" in error.message
    assert "'max_completion_tokens'" in error.message


def test_min_tokens_beyond_the_rest_of_the_context_names_min_tokens() -> None:
    assert fit_context(250, None, 6, LEN, "prompt", "max_tokens") == 6
    error = refusal(250, None, 7, LEN, "prompt", "max_tokens")
    assert error.param == "min_tokens" and "leaves room for 6 tokens" in error.message


def test_a_truncated_prompt_is_checked_by_the_same_rule() -> None:
    ids = list(range(1, 301))
    # -1 with max_tokens left to the rest: the last 255 ids, one token of room
    prepared = prepare_prompt(
        ids, None, LEN, 1000, "prompt", "max_tokens", truncate_prompt_tokens=-1
    )
    assert prepared.token_ids == tuple(ids[-255:]) and prepared.max_tokens == 1
    # max_tokens filling the context leaves no prompt (nothing is cut): refused by the rule,
    # naming max_tokens, or the prompt when it is itself too long
    with pytest.raises(ApiError) as e:
        prepare_prompt(ids[:5], LEN, LEN, 1000, "prompt", "max_tokens", truncate_prompt_tokens=-1)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(ApiError) as e:
        prepare_prompt(ids, LEN, LEN, 1000, "prompt", "max_tokens", truncate_prompt_tokens=-1)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    # the parameter's own bound: not above the context less max_tokens
    with pytest.raises(ApiError) as e:
        prepare_prompt(ids[:5], 10, LEN, 1000, "prompt", "max_tokens", truncate_prompt_tokens=247)
    assert e.value.param == "truncate_prompt_tokens" and e.value.code is None


def test_the_length_is_checked_before_the_ids_are_scanned() -> None:
    # an id outside the vocabulary in a prompt that is too long anyway: the length is reported
    with pytest.raises(ApiError) as e:
        prepare_prompt([5000] * 300, None, LEN, 1000, "prompt", "max_tokens")
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ApiError) as e:
        prepare_prompt([5000] * 3, None, LEN, 1000, "prompt", "max_tokens")
    assert e.value.param == "prompt" and "out of the vocabulary" in e.value.message
