"""The gateway against the scripted engine, through the official openai client and httpx."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.frontend.fake_engine import MODEL_NAME, SCRIPT, FakeEngine
from tests.frontend.harness import GatewayServer, wait_for

pytestmark = pytest.mark.timeout(30)


def script_text(tok: Tokenizer, n: int) -> str:
    ids = tok.encode(SCRIPT, add_special_tokens=False).ids
    return str(tok.decode((ids * 2)[:n]))


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra and models.data[0].model_extra["max_model_len"] == 256


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL_NAME)
    assert model == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such/model")
    body = e.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"


def test_completion(client: openai.OpenAI, hf_tokenizer: Tokenizer) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=10)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0
    choice = r.choices[0]
    assert choice.text == script_text(hf_tokenizer, 10)
    assert choice.finish_reason == "length"
    prompt_len = len(hf_tokenizer.encode("Hello").ids)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, 10)
    assert r.usage.total_tokens == prompt_len + 10


def test_default_max_tokens_is_16_for_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt=list(range(10, 20)))
    assert r.usage is not None and r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


def test_default_max_tokens_is_the_rest_of_the_context_for_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}]
    )
    assert r.usage is not None and r.usage.total_tokens == 256
    assert r.choices[0].finish_reason == "length"


def test_prompt_forms(client: openai.OpenAI, hf_tokenizer: Tokenizer) -> None:
    ids = hf_tokenizer.encode("Hello").ids
    for prompt in (["Hello", "world"], [ids, ids]):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3)
        assert [c.index for c in r.choices] == [0, 1]
        assert all(c.text == script_text(hf_tokenizer, 3) for c in r.choices)
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3)
    assert len(r.choices) == 1


def test_echo_with_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=4, echo=True, logprobs=2
    )
    c = r.choices[0]
    assert c.text.startswith("Hello world")
    assert c.logprobs is not None and c.logprobs.token_logprobs is not None
    assert c.logprobs.tokens is not None and c.logprobs.top_logprobs is not None
    prompt_len = r.usage.prompt_tokens if r.usage else 0
    assert len(c.logprobs.tokens) == prompt_len + 4
    assert c.logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert c.logprobs.token_logprobs[-1] == pytest.approx(-0.25)
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs[1:] if t is not None)
    assert c.logprobs.text_offset is not None and c.logprobs.text_offset[0] == 0


def test_chat(client: openai.OpenAI, hf_tokenizer: Tokenizer) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=6,
        logprobs=True,
        top_logprobs=3,
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == script_text(hf_tokenizer, 6)
    assert c.logprobs is not None and c.logprobs.content is not None
    assert len(c.logprobs.content) == 6 and len(c.logprobs.content[0].top_logprobs) == 3
    rendered = (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(hf_tokenizer.encode(rendered, add_special_tokens=False).ids)


def test_streaming_completion_with_usage(client: openai.OpenAI, hf_tokenizer: Tokenizer) -> None:
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == script_text(hf_tokenizer, 30)
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_n2(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    roles = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1}
    assert texts[0] and texts[1] and texts[0] != texts[1]  # seeds 3 and 4
    assert usage is not None and usage.completion_tokens == 16


def test_sse_framing(gateway: GatewayServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    assert all(b.startswith("data: {") for b in blocks[:-2])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_finished_request_sends_the_engine_no_abort(
    client: openai.OpenAI, engine: FakeEngine, stream: bool, route: str
) -> None:
    # Each request used to be aborted once it had finished (the sequence stops reading after
    # its last output, and closing the engine stream then sent an abort): a second message to
    # the engine per request, queued with the adds.
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 3, "stream": stream}
    if route == "chat":
        made = client.chat.completions.create(
            messages=[{"role": "user", "content": "Hello"}], **kwargs
        )
    else:
        made = client.completions.create(prompt="Hello", **kwargs)
    chunks = list(made) if stream else [made]  # type: ignore[call-overload]
    assert chunks[-1].choices[0].finish_reason == "length"
    request_id = f"{chunks[0].id}-0"
    wait_for(lambda: engine.num_in_flight == 0, 5, "the request to end")
    time.sleep(0.1)  # an abort, had one been sent, would have reached the engine by now
    assert request_id in engine.added and request_id not in engine.abort_requests


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens(client: openai.OpenAI, engine: FakeEngine, stream: bool) -> None:
    before = len(engine.aborted)
    kwargs = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 100, "stop": ["quick"]}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        text = "".join(c.choices[0].text for c in chunks)
        assert all("qu" not in c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        stop_reason = (chunks[-1].choices[0].model_extra or {}).get("stop_reason")
    else:
        r = client.completions.create(**kwargs)  # type: ignore[call-overload]
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        stop_reason = (r.choices[0].model_extra or {}).get("stop_reason")
    assert (text, finish, stop_reason) == ("Hello world! The ", "stop", "quick")
    wait_for(lambda: len(engine.aborted) > before, 5, "the engine to see the abort")
    assert engine.num_in_flight == 0


def test_stop_token_ids(client: openai.OpenAI, hf_tokenizer: Tokenizer) -> None:
    bang = hf_tokenizer.token_to_id("!")
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=50, extra_body={"stop_token_ids": [bang]}
    )
    c = r.choices[0]
    # The stop token's text is dropped (vLLM), unless include_stop_str_in_output.
    assert (c.text, c.finish_reason) == ("Hello world", "stop")
    assert (c.model_extra or {})["stop_reason"] == bang
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=50,
        extra_body={"stop_token_ids": [bang], "include_stop_str_in_output": True},
    )
    assert r.choices[0].text == "Hello world!"


def test_cached_tokens(client: openai.OpenAI, engine: FakeEngine) -> None:
    """usage.prompt_tokens_details: null unless --enable-prompt-tokens-details, and then only
    when the prefix cache served some of the prompt (vLLM's rule)."""
    prompt = "The engine batches requests and the gateway streams text back."
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens_details is None  # the flag is off
    g = GatewayServer(engine.address, enable_prompt_tokens_details=True).start()
    try:
        g.wait_healthy()
        detailed = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=10)
        fresh = "A prompt this engine has not seen before, so nothing of it is cached."
        r = detailed.completions.create(model=MODEL_NAME, prompt=fresh, max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens_details is None  # none cached
        r = detailed.completions.create(model=MODEL_NAME, prompt=fresh, max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert (r.usage.prompt_tokens_details.cached_tokens or 0) > 0
        messages: Any = [{"role": "user", "content": fresh}]
        for _ in range(2):  # the second one finds the first one's prompt cached
            chat = detailed.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=2
            )
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    finally:
        g.stop()


def test_tokenize_and_detokenize(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    url = gateway.url
    r = httpx.post(
        f"{url}/tokenize",
        json={"model": MODEL_NAME, "prompt": "Hello world", "return_token_strs": True},
    )
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == hf_tokenizer.encode("Hello world").ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"][0] == "<|bos|>"
    r = httpx.post(f"{url}/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"][1:]})
    assert r.json() == {"prompt": "Hello world"}
    r = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.json()["tokens"][0] == 0  # the template writes <|bos|>


def test_metrics_version_openapi_live(gateway: GatewayServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
    text = httpx.get(f"{gateway.url}/metrics").text
    for name in (  # every metric, one by one: tests/frontend/test_metrics_scrape.py
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-fake"}' in text
    assert httpx.get(f"{gateway.url}/version").json()["version"]
    assert httpx.get(f"{gateway.url}/live").status_code == 200
    paths = httpx.get(f"{gateway.url}/openapi.json").json()["paths"]
    assert {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    } <= set(paths)


def test_one_sequence_streams_without_a_merge(
    client: openai.OpenAI, hf_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n=1 relays its sequence directly (no merge task and queue per token); n=2 merges."""
    from frontend_svc.generation import run as generation

    merged: list[int] = []
    original = generation.merge

    def spy(streams):  # type: ignore[no-untyped-def]
        merged.append(len(streams))
        return original(streams)

    monkeypatch.setattr(generation, "merge", spy)
    stream = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == script_text(hf_tokenizer, 12)
    assert merged == []
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=5, n=2, stream=True
    )
    assert {c.choices[0].index for c in stream if c.choices} == {0, 1}
    assert merged == [2]
