"""SamplingParams validation: each invalid value raises ValueError naming its parameter."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine_svc.core.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams

NAN = math.nan

INVALID: list[tuple[str, Any]] = [
    ("temperature", -0.01),
    ("temperature", -1),
    ("temperature", NAN),
    ("temperature", "1.0"),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", NAN),
    ("top_k", -2),
    ("top_k", -100),
    ("top_k", 1.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", NAN),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", DEFAULT_MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", DEFAULT_MAX_LOGPROBS + 1),
    ("n", 0),
    ("n", 129),
    ("n", 2.0),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("presence_penalty", NAN),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", NAN),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 2.01),
    ("repetition_penalty", NAN),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", 1.0),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [3, 1.0]),
]

# A bool is an int to Python; none of these parameters may be given one.
BOOLS: list[Any] = [
    ("temperature", True),
    ("top_p", True),
    ("top_k", True),
    ("min_p", False),
    ("max_tokens", True),
    ("min_tokens", False),
    ("logprobs", True),
    ("prompt_logprobs", True),
    ("presence_penalty", True),
    ("frequency_penalty", False),
    ("repetition_penalty", True),
    ("seed", True),
    ("stop_token_ids", [True]),
    ("n", True),
]


def _raises_naming(name: str, **kwargs: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_value_raises_naming_the_parameter(name: str, value: Any) -> None:
    _raises_naming(name, **{name: value})


@pytest.mark.parametrize(("name", "value"), BOOLS)
def test_bool_is_not_accepted_as_a_number(name: str, value: Any) -> None:
    _raises_naming(name, **{name: value})


def test_min_tokens_above_max_tokens() -> None:
    _raises_naming("min_tokens", min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(min_tokens=1000, max_tokens=None)  # resolved later, against the context


def test_logprobs_limit_follows_max_logprobs() -> None:
    SamplingParams(logprobs=5, max_logprobs=5)
    _raises_naming("logprobs", logprobs=6, max_logprobs=5)
    _raises_naming("prompt_logprobs", prompt_logprobs=6, max_logprobs=5)
    SamplingParams(logprobs=50, prompt_logprobs=50, max_logprobs=50)


def test_n_limit_is_a_verify_argument() -> None:
    params = SamplingParams(n=8)
    params.verify(max_n=8)
    with pytest.raises(ValueError, match=r"^n must be in \[1, 4\]"):
        params.verify(max_n=4)


def test_error_message_shows_the_value() -> None:
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1\.5$"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 0},
        {"temperature": 2.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": 1},
        {"top_k": 50_000},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"min_tokens": 0},
        {"logprobs": 0},
        {"logprobs": DEFAULT_MAX_LOGPROBS},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": DEFAULT_MAX_LOGPROBS},
        {"n": 1},
        {"n": 128},
        {"presence_penalty": -2.0},
        {"presence_penalty": 2},
        {"frequency_penalty": -2},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 2.0},
        {"repetition_penalty": 1e-6},
        {"seed": 0},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"stop_token_ids": [0, 7]},
    ],
)
def test_valid_edge_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_top_k_minus_one_is_normalised_to_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k) == (
        1,
        16,
        0,
        1.0,
        1.0,
        0,
    )
    assert p.max_logprobs == DEFAULT_MAX_LOGPROBS == 20
    assert p.logprobs is None and p.prompt_logprobs is None
    assert not p.greedy and not p.has_penalties


def test_stop_token_ids_none_becomes_empty_list() -> None:
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []  # type: ignore[arg-type]


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_max_logprobs_minus_one_means_the_whole_vocabulary() -> None:
    """--max-logprobs -1 (vLLM's): no limit but the vocabulary's. GetModelInfo then reports
    the vocabulary size, which is what lets a gateway accept -1 from a client."""
    from engine_svc.core.model_info import ModelInfo

    SamplingParams(logprobs=50_000, prompt_logprobs=151_936, max_logprobs=-1)
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=21)
    facts: dict[str, object] = dict(
        served_model_name="m",
        max_model_len=64,
        vocab_size=512,
        eos_token_ids=(2,),
        bos_token_id=None,
        block_size=4,
        num_kv_blocks=16,
    )
    assert ModelInfo.of(max_logprobs=-1, **facts).max_logprobs == 512
    assert ModelInfo.of(max_logprobs=7, **facts).max_logprobs == 7
