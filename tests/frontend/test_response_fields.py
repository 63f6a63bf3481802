"""vLLM's response extras at the gateway (against the scripted engine): prompt_logprobs,
return_token_ids, return_tokens_as_token_ids (field and server flag), continuous usage stats and
--enable-force-include-usage, and chat's continue_final_message, echo and free message roles,
in whole responses and in streams (raw SSE chunks, as a client parses them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(30)
PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": "Hi"}]


def post(gateway: GatewayServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=10)


def completion(gateway: GatewayServer, **body: Any) -> dict[str, Any]:
    r = post(gateway, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def chat(gateway: GatewayServer, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": MESSAGES, **body}
    r = post(gateway, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream(gateway: GatewayServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data chunks of a streamed response, [DONE] left out."""
    chunks = []
    body = {"model": MODEL_NAME, **body, "stream": True}
    with httpx.stream("POST", f"{gateway.url}{path}", json=body, timeout=10) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[len("data: ") :]))
    return chunks


def assert_400(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    return str(r.json()["error"]["message"])


def ids(tok: Tokenizer, text: str, special: bool = True) -> list[int]:
    return list(tok.encode(text, add_special_tokens=special).ids)


def check_prompt_logprobs(
    got: list[dict[str, Any] | None], prompt: list[int], num_top: int, tok: Tokenizer
) -> None:
    """The scripted engine gives each prompt token logprob -1 at rank 1, the alternative of rank
    r > 1 being token + r - 1 with logprob -1 - r."""
    assert len(got) == len(prompt) and got[0] is None
    for token, position in zip(prompt[1:], got[1:], strict=True):
        assert position is not None
        want_ids = [token] + [token + i for i in range(1, num_top)]
        assert list(position) == [str(t) for t in want_ids]
        for rank, t in enumerate(want_ids, start=1):
            assert position[str(t)] == {
                "logprob": -1.0 if rank == 1 else -1.0 - rank,
                "rank": rank,
                "decoded_token": tok.decode([t], skip_special_tokens=False),
            }


# -- prompt_logprobs ----------------------------------------------------------------------------


def test_completions_prompt_logprobs(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    prompt = ids(hf_tokenizer, PROMPT)
    r = completion(gateway, max_tokens=3, prompt_logprobs=2)
    check_prompt_logprobs(r["choices"][0]["prompt_logprobs"], prompt, 2, hf_tokenizer)
    assert r["usage"]["prompt_tokens"] == len(prompt)
    # 0: the prompt token alone; not asked for: no field.
    r = completion(gateway, max_tokens=3, prompt_logprobs=0)
    check_prompt_logprobs(r["choices"][0]["prompt_logprobs"], prompt, 0, hf_tokenizer)
    # Not asked for: null, as vLLM sends it (the openai client reads the attribute).
    assert completion(gateway, max_tokens=3)["choices"][0]["prompt_logprobs"] is None
    # echo with logprobs scores the prompt: shown too, with as many alternatives (vLLM).
    r = completion(gateway, max_tokens=2, echo=True, logprobs=1)
    check_prompt_logprobs(r["choices"][0]["prompt_logprobs"], prompt, 1, hf_tokenizer)
    # Several prompts and n: each choice its own prompt's.
    other = "The quick brown fox"
    r = completion(gateway, prompt=[PROMPT, other], n=2, max_tokens=2, prompt_logprobs=1)
    for choice in r["choices"]:
        text = PROMPT if choice["index"] < 2 else other
        check_prompt_logprobs(choice["prompt_logprobs"], ids(hf_tokenizer, text), 1, hf_tokenizer)


def test_chat_prompt_logprobs(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    r = chat(gateway, max_tokens=3, prompt_logprobs=1, return_token_ids=True)
    prompt = r["prompt_token_ids"]
    assert len(prompt) == r["usage"]["prompt_tokens"]
    check_prompt_logprobs(r["prompt_logprobs"], prompt, 1, hf_tokenizer)
    assert chat(gateway, max_tokens=2)["prompt_logprobs"] is None  # vLLM: the key, null


def test_streams_carry_prompt_logprobs_in_the_first_chunk(
    gateway: GatewayServer, hf_tokenizer: Tokenizer
) -> None:
    prompt = ids(hf_tokenizer, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 2}
    chunks = stream(gateway, "/v1/completions", body)
    carrying = [c for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert carrying == chunks[:1]
    check_prompt_logprobs(carrying[0]["choices"][0]["prompt_logprobs"], prompt, 2, hf_tokenizer)

    body = {"messages": MESSAGES, "max_tokens": 4, "prompt_logprobs": 1, "n": 2}
    chunks = stream(gateway, "/v1/chat/completions", body)
    carrying = [c for c in chunks if "prompt_logprobs" in c]
    # Each choice's first (role) chunk carries them, as vLLM's prompt_token_ids.
    assert sorted(c["choices"][0]["index"] for c in carrying) == [0, 1]
    assert all(c["choices"][0]["delta"].get("role") == "assistant" for c in carrying)
    n = chat(gateway, max_tokens=1)["usage"]["prompt_tokens"]
    assert len(carrying[0]["prompt_logprobs"]) == n


# -- return_token_ids ---------------------------------------------------------------------------


def test_completions_return_token_ids(
    gateway: GatewayServer, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    prompt = ids(hf_tokenizer, PROMPT)
    r = completion(gateway, max_tokens=5, return_token_ids=True)
    c = r["choices"][0]
    assert c["prompt_token_ids"] == prompt
    assert len(c["token_ids"]) == r["usage"]["completion_tokens"] == 5
    assert hf_tokenizer.decode(c["token_ids"]) == c["text"]
    assert list(engine.add_messages[f"{r['id']}-0"].prompt_token_ids) == prompt
    plain = completion(gateway, max_tokens=2)["choices"][0]  # vLLM: the keys, null
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    # echo with token ids: the prompt is in prompt_token_ids, not decoded into the text (vLLM).
    r = completion(gateway, max_tokens=3, echo=True, return_token_ids=True)
    c = r["choices"][0]
    assert c["text"] == hf_tokenizer.decode(c["token_ids"]) and c["prompt_token_ids"] == prompt

    chunks = stream(
        gateway, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True}
    )
    choices = [ch["choices"][0] for ch in chunks]
    assert choices[0]["prompt_token_ids"] == prompt
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    streamed = [t for c in choices for t in c["token_ids"]]
    assert len(streamed) == 6
    assert hf_tokenizer.decode(streamed) == "".join(c["text"] for c in choices)


def test_chat_return_token_ids(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    r = chat(gateway, max_tokens=5, return_token_ids=True)
    c = r["choices"][0]
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    rendered = hf_tokenizer.decode(r["prompt_token_ids"], skip_special_tokens=False)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert len(c["token_ids"]) == r["usage"]["completion_tokens"] == 5
    assert hf_tokenizer.decode(c["token_ids"]) == c["message"]["content"]
    plain = chat(gateway, max_tokens=2)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None

    body = {"messages": MESSAGES, "max_tokens": 6, "return_token_ids": True}
    chunks = stream(gateway, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])
    streamed = [t for ch in chunks[1:] for t in ch["choices"][0]["token_ids"]]
    assert len(streamed) == 6
    content = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert hf_tokenizer.decode(streamed) == content


# -- return_tokens_as_token_ids -----------------------------------------------------------------


def test_tokens_as_token_ids(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    r = completion(
        gateway,
        max_tokens=4,
        logprobs=2,
        echo=True,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
    )
    c = r["choices"][0]
    every = c["prompt_token_ids"] + c["token_ids"]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in every]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"][1:] for k in top)
    r = chat(
        gateway,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
    )
    content = r["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in r["choices"][0]["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    # Without the field: the tokens' text.
    r = completion(gateway, max_tokens=2, logprobs=0, return_token_ids=True)
    lp = r["choices"][0]["logprobs"]["tokens"]
    assert lp == [hf_tokenizer.decode([t]) for t in r["choices"][0]["token_ids"]]


# -- usage in streams ---------------------------------------------------------------------------


def usage_of(chunks: list[dict[str, Any]]) -> list[Any]:
    return [ch.get("usage", "absent") for ch in chunks]


def test_continuous_usage_stats(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    n = len(ids(hf_tokenizer, PROMPT))
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": PROMPT, "max_tokens": 4, "stream_options": options, "n": 2}
    chunks = stream(gateway, "/v1/completions", body)
    *running, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    for index in (0, 1):  # each choice counts its own output so far (vLLM)
        mine = [ch["usage"] for ch in running if ch["choices"][0]["index"] == index]
        assert [u["completion_tokens"] for u in mine] == [1, 2, 3, 4]
        assert all(
            u["prompt_tokens"] == n and u["total_tokens"] == n + u["completion_tokens"]
            for u in mine
        )

    body = {"messages": MESSAGES, "max_tokens": 3, "stream_options": options}
    *running, final = stream(gateway, "/v1/chat/completions", body)
    assert [u["completion_tokens"] for u in usage_of(running)] == [0, 1, 2, 3]
    assert final["usage"]["completion_tokens"] == 3
    # Without include_usage, continuous_usage_stats alone adds nothing (vLLM).
    body["stream_options"] = {"continuous_usage_stats": True}
    chunks = stream(gateway, "/v1/chat/completions", body)
    assert set(map(str, usage_of(chunks))) == {"absent"}
    bad = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "stream": True,
        "stream_options": {"continuous_usage_stats": "yes please"},
    }
    assert_400(post(gateway, "/v1/completions", bad), "stream_options")


@pytest.fixture(scope="module")
def flagged(engine: FakeEngine) -> Iterator[GatewayServer]:
    g = GatewayServer(
        engine.address, enable_force_include_usage=True, return_tokens_as_token_ids=True
    ).start()
    g.wait_healthy()
    yield g
    g.stop()


def test_server_flags(flagged: GatewayServer) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
    ):
        *chunks, final = stream(flagged, path, body)
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
        assert all(ch["usage"] is None for ch in chunks)
    r = completion(flagged, max_tokens=2, logprobs=0, return_token_ids=True)
    c = r["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    r = completion(
        flagged, max_tokens=2, logprobs=0, return_token_ids=True, return_tokens_as_token_ids=False
    )
    assert not r["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


# -- chat: continue_final_message, echo, roles --------------------------------------------------

PARTIAL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]


def test_continue_final_message(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    body = {"messages": PARTIAL, "add_generation_prompt": False, "continue_final_message": True}
    r = post(gateway, "/tokenize", body)
    assert r.status_code == 200, r.text
    text = hf_tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    r = chat(gateway, **body, max_tokens=2, return_token_ids=True)
    assert r["prompt_token_ids"] == post(gateway, "/tokenize", body).json()["tokens"]
    assert r["choices"][0]["message"]["role"] == "assistant"
    # Both: a 400 (vLLM), in chat and /tokenize, also with the default add_generation_prompt.
    for path, extra in (("/v1/chat/completions", {"model": MODEL_NAME}), ("/tokenize", {})):
        for both in (
            {"continue_final_message": True},
            {"continue_final_message": True, "add_generation_prompt": True},
        ):
            message = assert_400(
                post(gateway, path, {**extra, "messages": PARTIAL, **both}),
                "continue_final_message",
            )
            assert "add_generation_prompt" in message


def test_chat_echo(gateway: GatewayServer) -> None:
    body = {"messages": PARTIAL, "add_generation_prompt": False, "continue_final_message": True}
    r = chat(gateway, **body, max_tokens=3, echo=True)
    plain = chat(gateway, **body, max_tokens=3)
    assert (
        r["choices"][0]["message"]["content"]
        == "The answer is" + plain["choices"][0]["message"]["content"]
    )
    # The same counts (the cached-token figure depends on which of the two came first)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [r["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    chunks = stream(gateway, "/v1/chat/completions", {**body, "max_tokens": 3, "echo": True})
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "The answer is"}
    content = "".join(d.get("content", "") for d in deltas)
    assert content == r["choices"][0]["message"]["content"]
    # The last message is the user's and the reply the assistant's: nothing echoed.
    r = chat(gateway, max_tokens=3, echo=True)
    assert (
        r["choices"][0]["message"]["content"]
        == chat(gateway, max_tokens=3)["choices"][0]["message"]["content"]
    )


def test_any_role_reaches_the_template(gateway: GatewayServer, hf_tokenizer: Tokenizer) -> None:
    messages = [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Hi"}]
    r = post(gateway, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    text = hf_tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
    assert "<|im_start|>narrator\nOnce<|im_end|>" in text
    r = chat(gateway, messages=messages, max_tokens=2)
    assert r["choices"][0]["message"]["role"] == "assistant"
    # Without a generation prompt the reply takes the last message's role (vLLM).
    r = chat(gateway, messages=messages, max_tokens=2, add_generation_prompt=False)
    assert r["choices"][0]["message"]["role"] == "user"
    for role in ("", 5, None, ["user"]):
        body = {"model": MODEL_NAME, "messages": [{"role": role, "content": "Hi"}]}
        assert "role" in assert_400(post(gateway, "/v1/chat/completions", body), "messages")
