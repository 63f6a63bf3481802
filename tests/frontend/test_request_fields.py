"""logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens, the completions max_tokens
default, echo with max_tokens 0 and suffix, at the gateway (against the scripted engine): each
invalid value is a 400 naming its parameter; valid ones reach the engine as the contract says."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(30)
MESSAGES = [{"role": "user", "content": "Hi"}]
VOCAB = 420  # the tiny tokenizer's, which the scripted engine serves


def post(gateway: GatewayServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=10)


def assert_400(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


INVALID: list[tuple[str, Any]] = [
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"1.5": 1}),
    ("logit_bias", {"": 1}),
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": -101}),
    ("logit_bias", {"5": "1"}),
    ("logit_bias", {"5": True}),
    ("logit_bias", {"5": None}),
    ("logit_bias", [5, 1]),
    ("logit_bias", {str(VOCAB): 1}),  # outside the vocabulary
    ("logit_bias", {"99999999999": 1}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [1, -1]),
    ("allowed_token_ids", [1, VOCAB]),
    ("allowed_token_ids", "1"),
    ("bad_words", "hello"),
    ("bad_words", ["ok", " "]),
    ("bad_words", ["ok", 5]),
    ("bad_words", ["x"] * 129),
    ("bad_words", ["x" * 257]),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 2.5),
    ("truncate_prompt_tokens", 257),  # over the context length (256)
    ("truncate_prompt_tokens", 250),  # over the context length less max_tokens (10)
]


@pytest.mark.parametrize(("field", "value"), INVALID)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_invalid_values_are_400_naming_the_parameter(
    gateway: GatewayServer, route: str, field: str, value: Any
) -> None:
    if route == "completions":
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 10}
    else:
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10}
    body[field] = value
    assert_400(post(gateway, f"/v1/{'chat/' if route == 'chat' else ''}completions", body), field)


def test_messages_say_what_is_wrong(gateway: GatewayServer) -> None:
    base = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 10}
    message = assert_400(
        post(gateway, "/v1/completions", {**base, "logit_bias": {"7": 1, "500": 2, "421": 3}}),
        "logit_bias",
    )
    assert "421, 500" in message and f"size {VOCAB}" in message
    message = assert_400(
        post(gateway, "/v1/completions", {**base, "logit_bias": {"7": 150}}), "logit_bias"
    )
    assert "[-100, 100]" in message and "150" in message
    message = assert_400(
        post(gateway, "/v1/completions", {**base, "truncate_prompt_tokens": 250}),
        "truncate_prompt_tokens",
    )
    assert "256" in message and "'max_tokens' (10), 246" in message
    body = {"model": MODEL_NAME, "messages": MESSAGES, "truncate_prompt_tokens": 300}
    message = assert_400(post(gateway, "/v1/chat/completions", body), "truncate_prompt_tokens")
    assert "context length (256)" in message


def test_suffix_and_max_tokens_0_without_echo_are_400(gateway: GatewayServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "def f(", "suffix": "return 1", "max_tokens": 5}
    assert "fill-in-the-middle" in assert_400(post(gateway, "/v1/completions", body), "suffix")
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 0}
    assert "echo" in assert_400(post(gateway, "/v1/completions", body), "max_tokens")
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 0, "echo": True, "min_tokens": 1}
    assert_400(post(gateway, "/v1/completions", body), "min_tokens")


def _sent(engine: FakeEngine, response_id: str) -> Any:
    """The AddRequest the engine received for the response's first choice."""
    return engine.add_messages[f"{response_id}-0"]


def test_constraints_reach_the_engine(
    client: openai.OpenAI, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=2,
        logit_bias={"7": 100, "12": -100, "0": 0.5},
        extra_body={"allowed_token_ids": [7, 12, 30], "bad_words": ["quick brown", " fox", "fox"]},
    )
    p = _sent(engine, r.id).sampling_params
    assert dict(p.logit_bias) == {7: 100.0, 12: -100.0, 0: 0.5}
    assert list(p.allowed_token_ids) == [7, 12, 30]

    def ids(text: str) -> list[int]:
        return list(hf_tokenizer.encode(text, add_special_tokens=False).ids)

    want = []
    for word in ("quick brown", "fox"):  # " fox" is "fox" stripped: one word, not two
        want.append(ids(word))
        spaced = ids(" " + word)
        if spaced[0] != want[-1][0] and len(spaced) == len(want[-1]):
            want.append(spaced)
    assert [list(w.token_ids) for w in p.bad_words] == want
    assert any(len(w) > 1 for w in want)

    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, logit_bias={"9": 3}
    )
    p = _sent(engine, r.id).sampling_params
    assert dict(p.logit_bias) == {9: 3.0} and not p.allowed_token_ids and not p.bad_words


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: openai.OpenAI, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    ids = list(range(10, 60))
    r = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 8}
    )
    assert r.usage is not None and r.usage.prompt_tokens == 8
    assert list(_sent(engine, r.id).prompt_token_ids) == ids[-8:]

    # A text prompt keeps the BOS its tokenizer put first, as the tokenizer's own truncation.
    text = "The quick brown fox jumps over the lazy dog."
    full = hf_tokenizer.encode(text).ids
    assert full[0] == 0 and len(full) > 6
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=text,
        max_tokens=2,
        echo=True,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert list(_sent(engine, r.id).prompt_token_ids) == [0, *full[-4:]]
    assert r.choices[0].text.startswith(hf_tokenizer.decode(full[-4:]))

    # -1: as many as the context holds with max_tokens; shorter prompts are left alone.
    long_ids = list(range(10, 300)) * 1
    r = client.completions.create(
        model=MODEL_NAME, prompt=long_ids, max_tokens=6, extra_body={"truncate_prompt_tokens": -1}
    )
    assert r.usage is not None and r.usage.prompt_tokens == 250
    r = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 100}
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)

    # Chat: the rendered prompt is cut too (a chat over the context fits once truncated).
    long_chat = [{"role": "user", "content": "hello world " * 200}]
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=long_chat,  # type: ignore[arg-type]
        max_tokens=3,
        extra_body={"truncate_prompt_tokens": 20},
    )
    assert r.usage is not None and r.usage.prompt_tokens == 20
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=long_chat,  # type: ignore[arg-type]
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (255, 1)


def test_echo_with_max_tokens_0_returns_the_scored_prompt(
    client: openai.OpenAI, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    prompt = "Hello world"
    n = len(hf_tokenizer.encode(prompt).ids)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and c.logprobs is None
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 0)
    assert _sent(engine, r.id).sampling_params.max_tokens == 1

    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    c = r.choices[0]
    assert c.text == prompt and c.logprobs is not None and c.logprobs.tokens is not None
    assert len(c.logprobs.tokens) == n and c.logprobs.token_logprobs is not None
    assert c.logprobs.token_logprobs[0] is None
    assert _sent(engine, r.id).sampling_params.prompt_logprobs == 2

    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=0,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == prompt
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (n, 0)


def test_booleans_sent_as_strings_or_numbers_are_read_as_vllm_reads_them(
    client: openai.OpenAI, gateway: GatewayServer
) -> None:
    """``"logprobs": "true"`` (pydantic's lax bool, as vLLM's models read it) asks for logprobs;
    "off" and 0 do not; a string outside vLLM's words is still a 400 naming the field."""
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"logprobs": "true", "top_logprobs": 1, "echo": "No"},
    )
    assert r.choices[0].logprobs is not None and len(r.choices[0].logprobs.content or []) == 2
    for off in ("off", 0, "FALSE"):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body={"logprobs": off}
        )
        assert r.choices[0].logprobs is None
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "stream": "Y"}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=10) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        assert "data: [DONE]" in s.read().decode()
    message = assert_400(
        post(gateway, "/v1/chat/completions", {**body, "stream": "sure"}), "stream"
    )
    assert message == "'stream' must be a boolean."
