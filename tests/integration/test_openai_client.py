"""The official ``openai`` client against the real gateway in front of the real engine."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.harness import MODEL, Gateway

pytestmark = pytest.mark.timeout(60)
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _prompt_len(gateway: Gateway, text: str) -> int:
    r = httpx.post(f"{gateway.url}/tokenize", json={"prompt": text}, headers=gateway.headers)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "tandem"


def test_completion(client: openai.OpenAI, gateway: Gateway) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, **GREEDY)
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text
    assert r.usage is not None
    assert r.usage.prompt_tokens == _prompt_len(gateway, "Hello world")
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
        **GREEDY,
    )
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 6  # the chat template's markers are in the prompt


def test_streaming_completion_with_usage(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="The quick", max_tokens=12, **GREEDY)
    stream = client.completions.create(
        model=MODEL,
        prompt="The quick",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    body, last = chunks[:-1], chunks[-1]
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage is not None
    assert full.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.total_tokens == full.usage.prompt_tokens + 12


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about Tandem"}]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        **GREEDY,  # type: ignore[arg-type]
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    body, last = chunks[:-1], chunks[-1]
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in body if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body if c.choices][-1] == "length"
    assert last.choices == [] and last.usage is not None and full.usage is not None
    assert last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_n2(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="Numbers:",
        max_tokens=7,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 14


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        # 3 alternatives, fewer only where distinct ids render as the same text
        assert 1 <= len(top) <= 3
        assert top[token] == pytest.approx(logprob, abs=1e-5)
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the top one


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert math.isfinite(item.logprob) and item.logprob <= 0.0


def test_stop_string(client: openai.OpenAI) -> None:
    prompt = "Hello world! The quick"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    text = full.choices[0].text
    # a stop string of two visible characters somewhere past the start of the text
    starts = [i for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2]]
    assert starts, text
    stop = text[starts[0] : starts[0] + 2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first  # the seed is really used (16 tokens over a 512 vocab)


def test_greedy_matches_offline_llm(client: openai.OpenAI, cache_dir: Path) -> None:
    from engine_svc import LLM, SamplingParams

    prompt = "The engine schedules every request"
    llm = LLM(max_num_seqs=4, kv_cache_memory="16MiB")
    offline = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **GREEDY)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.outputs[0].token_ids) == 20
    assert r.choices[0].text == offline.outputs[0].text
    # and token for token: the same ids sent as a token-id prompt give the same text
    r_ids = client.completions.create(
        model=MODEL, prompt=offline.prompt_token_ids, max_tokens=20, **GREEDY
    )
    assert r_ids.choices[0].text == offline.outputs[0].text
