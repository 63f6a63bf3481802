"""Beam search as vLLM runs it in its front end (``generation.beam_search``): the search over a
scripted model, and the route's answers through the gateway and the fake engine."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
import pytest

from frontend_svc.generation.beam_search import Beam, score, search
from tests.frontend.fake_engine import MODEL_NAME
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(30)

# A tiny language model: the next-token distribution after each generated prefix.
TREE: dict[tuple[int, ...], dict[int, float]] = {
    (): {1: 0.5, 2: 0.4, 3: 0.1},
    (1,): {4: 0.3, 5: 0.3, 6: 0.4},  # greedy: 1 then 6 (0.5 * 0.4 = 0.20)
    (2,): {7: 0.9, 4: 0.05, 5: 0.05},  # 2 then 7 is better (0.4 * 0.9 = 0.36)
    (3,): {0: 1.0},
}
EOS = 0


async def step(tokens: tuple[int, ...]) -> list[tuple[int, float]]:
    probs = TREE.get(tokens, {EOS: 0.6, 8: 0.4})
    return [(t, math.log(p)) for t, p in sorted(probs.items(), key=lambda kv: -kv[1])]


def greedy(max_tokens: int) -> tuple[int, ...]:
    """The most likely token at each step (EOS a token like the others: ignore_eos)."""
    tokens: tuple[int, ...] = ()
    for _ in range(max_tokens):
        probs = TREE.get(tokens, {EOS: 0.6, 8: 0.4})
        tokens = (*tokens, max(probs, key=lambda t: probs[t]))
    return tokens


def run(width: int, max_tokens: int, eos: tuple[int, ...], penalty: float) -> list[Beam]:
    return asyncio.run(search(step, 5, width, max_tokens, eos, penalty))


def test_width_one_is_greedy() -> None:
    for max_tokens in (1, 2, 3, 4):
        (beam,) = run(1, max_tokens, (), 1.0)
        assert beam.tokens == greedy(max_tokens)
        assert beam.finish_reason == "length"


def test_width_two_finds_the_sequence_greedy_misses() -> None:
    best, second = run(2, 2, (), 1.0)
    assert best.tokens == (2, 7) and math.isclose(best.cum_logprob, math.log(0.4 * 0.9))
    assert second.tokens == (1, 6)
    assert greedy(2) == (1, 6)  # what a width of one gives


def test_eos_finishes_a_beam_that_then_competes_with_the_rest() -> None:
    # After (2, 7) the model ends with p 0.6: that beam is set aside finished, without the
    # EOS, and still beats the live ones (length penalty 0: the cumulative logprob decides).
    beams = run(2, 3, (EOS,), 0.0)
    best = beams[0]
    assert (best.tokens, best.finish_reason, best.stop_reason) == ((2, 7), "stop", EOS)
    assert math.isclose(best.cum_logprob, math.log(0.4 * 0.9 * 0.6))
    assert [b.cum_logprob for b in beams] == sorted((b.cum_logprob for b in beams), reverse=True)


def test_score_is_vllms() -> None:
    beam = Beam((1, 2, 3), -6.0)
    assert score(beam, 5, 1.0) == -6.0 / 8  # the prompt counts in the length
    assert score(beam, 5, 0.0) == -6.0
    assert score(beam, 5, 2.0) == -6.0 / 64


# ---- through the gateway (the fake engine answers each one-token step with its logprobs) ----


def completion(gateway: GatewayServer, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, **fields}
    return httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)


def test_the_route_answers_n_beams(gateway: GatewayServer) -> None:
    r = completion(gateway, use_beam_search=True, n=2, ignore_eos=True)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["finish_reason"] == "length" and c["text"] for c in choices)
    assert choices[0]["text"] != choices[1]["text"]  # two different beams
    assert r.json()["usage"]["completion_tokens"] == 6
    chat = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "use_beam_search": True,
            "n": 2,
        },
        timeout=10,
    )
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 1}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 11}, "n"),  # 22 logprobs per step; the fake engine allows 20
    ],
)
def test_what_beam_search_does_not_do_is_refused(
    gateway: GatewayServer, fields: dict[str, Any], param: str
) -> None:
    r = completion(gateway, use_beam_search=True, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
