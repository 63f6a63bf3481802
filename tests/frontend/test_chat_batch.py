"""POST /v1/chat/completions/batch (vLLM's) through the real gateway and the scripted engine:
one choice per conversation with ``index`` = its number, each conversation its own engine
request with its own prompt and the body's sampling, the usage summed; vLLM's limits (no
streaming, tools, beam search, n) as 400s naming the field; one failing conversation fails the
request and aborts the others; the ``openai`` SDK's ``ChatCompletion`` parses the answer."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer

from frontend_svc.routes.chat_batch import summed_usage
from tests.frontend.fake_engine import MODEL_NAME, FakeEngine
from tests.frontend.harness import GatewayServer, wait_for

pytestmark = pytest.mark.timeout(60)
PATH = "/v1/chat/completions/batch"
ALPHA: Any = [{"role": "user", "content": "alpha"}]
BETA: Any = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "beta beta beta"},
]


def post(gateway: GatewayServer, **body: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [ALPHA, BETA], "max_tokens": 3, **body}
    return httpx.post(f"{gateway.url}{PATH}", json=body, timeout=10)


def refusal(r: httpx.Response, param: str, status: int = 400) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and "Traceback" not in error["message"], error
    return str(error["message"])


def prompts(engine: FakeEngine, hf_tokenizer: Tokenizer, batch_id: str) -> list[str]:
    """The prompt each conversation's engine request got, in conversation order."""
    ids = sorted(k for k in engine.add_messages if k.startswith(f"{batch_id}_"))
    assert ids == [f"{batch_id}_{i}-0" for i in range(len(ids))]
    return [
        hf_tokenizer.decode(
            list(engine.add_messages[i].prompt_token_ids), skip_special_tokens=False
        )
        for i in ids
    ]


def test_one_choice_per_conversation_indexed_by_its_number(
    gateway: GatewayServer, engine: FakeEngine, hf_tokenizer: Tokenizer
) -> None:
    r = post(gateway)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL_NAME
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, conversation in zip(body["choices"], (ALPHA, BETA), strict=True):
        alone = {"model": MODEL_NAME, "messages": conversation, "max_tokens": 3}
        chat = httpx.post(f"{gateway.url}/v1/chat/completions", json=alone, timeout=10).json()
        # what chat answers to the conversation alone, but for the index
        assert choice == chat["choices"][0] | {"index": choice["index"]}
        assert choice["message"]["content"] and choice["finish_reason"] == "length"
    assert body["prompt_logprobs"] is None and body["prompt_token_ids"] is None
    sent = prompts(engine, hf_tokenizer, body["id"])
    assert "alpha" in sent[0] and "beta" not in sent[0]
    assert "Be brief." in sent[1] and "beta beta beta" in sent[1]
    lengths = [len(engine.add_messages[f"{body['id']}_{i}-0"].prompt_token_ids) for i in (0, 1)]
    assert lengths[0] < lengths[1]
    assert body["usage"] == {
        "prompt_tokens": sum(lengths),
        "completion_tokens": 6,
        "total_tokens": sum(lengths) + 6,
        "prompt_tokens_details": None,
    }


def test_the_openai_sdk_reads_the_answer(client: openai.OpenAI) -> None:
    body = {"model": MODEL_NAME, "messages": [ALPHA, BETA, ALPHA], "max_tokens": 2}
    completion = client.post("/chat/completions/batch", body=body, cast_to=ChatCompletion)
    assert isinstance(completion, ChatCompletion)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({c.message.content for c in completion.choices}) == 1  # the script, each time
    assert completion.usage is not None and completion.usage.completion_tokens == 6


def test_the_body_fields_apply_to_every_conversation(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    r = post(
        gateway,
        max_tokens=2,
        seed=7,
        stop=["never"],
        logprobs="true",  # vLLM's reading of booleans holds here too
        top_logprobs=1,
        return_token_ids=True,
        response_format={"type": "json_object"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    for i, choice in enumerate(body["choices"]):
        sent = engine.add_messages[f"{body['id']}_{i}-0"].sampling_params
        assert (sent.max_tokens, sent.seed, sent.logprobs) == (2, 7, 1)
        assert sent.structured_output.json_object
        assert len(choice["token_ids"]) == 2
        assert len(choice["logprobs"]["content"]) == 2
    assert body["prompt_token_ids"] is None  # one top-level place, several prompts: null


def test_echo_continues_each_conversation(gateway: GatewayServer) -> None:
    """With echo, each reply starts with its own conversation's last message (continued:
    the reply's role is that message's, as chat has it)."""
    prefill: Any = [*ALPHA, {"role": "assistant", "content": "PREFIX "}]
    r = post(
        gateway,
        messages=[ALPHA, prefill],
        echo=True,
        add_generation_prompt=False,
        continue_final_message=True,
        max_tokens=1,
    )
    assert r.status_code == 200, r.text
    contents = [c["message"]["content"] for c in r.json()["choices"]]
    assert contents[0].startswith("alpha") and contents[1].startswith("PREFIX ")
    assert contents[0].removeprefix("alpha") == contents[1].removeprefix("PREFIX ") != ""


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"stream": True}, "stream", "'stream' must be false: /v1/chat/completions/batch does"),
        ({"stream": "yes"}, "stream", "must be false"),
        ({"n": 2}, "n", "'n' must be 1"),
        ({"use_beam_search": True}, "use_beam_search", "does not run beam search"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "takes no tools"),
        ({"tool_choice": "auto"}, "tool_choice", "must be 'none'"),
        ({"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
        ({"messages": []}, "messages", "'messages' must not be empty"),
        ({"messages": ALPHA}, "messages", "'messages[0]' must be a list"),
        ({"messages": [ALPHA, []]}, "messages", "'messages[1]' must not be empty"),
        ({"messages": [ALPHA, [{"role": ""}]]}, "messages", "'messages[1][0].role'"),
        ({"messages": [ALPHA] * 1025}, "messages", "at most 1024"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
    ],
)
def test_what_the_batch_does_not_take_is_a_400_naming_it(
    gateway: GatewayServer, engine: FakeEngine, fields: dict[str, Any], param: str, says: str
) -> None:
    before = len(engine.added)
    assert says in refusal(post(gateway, **fields), param)
    assert len(engine.added) == before  # nothing reached the engine


def test_a_conversation_that_does_not_fit_fails_the_request_before_any_runs(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    """The whole request fails, as vLLM's does; the error names the conversation."""
    before = len(engine.added)
    long: Any = [{"role": "user", "content": "word " * 300}]  # over the 256-token context
    r = post(gateway, messages=[ALPHA, long, ALPHA])
    message = refusal(r, "messages")
    assert message.startswith("Conversation 1 ('messages[1]'): ")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert len(engine.added) == before


def test_an_engine_error_in_one_conversation_aborts_the_others(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    """The engine refuses the third conversation (queue full): the answer is that error, and
    the two it admitted are aborted, not left running."""
    engine.max_requests = 2
    try:
        r = post(gateway, messages=[ALPHA, ALPHA, ALPHA], max_tokens=100)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        wait_for(lambda: not engine.requests, 5, "the admitted conversations aborted")
        assert len([rid for rid in engine.aborted if "_" in rid]) == 2
    finally:
        engine.max_requests = 64


def test_a_client_that_leaves_aborts_every_conversation(
    gateway: GatewayServer, engine: FakeEngine
) -> None:
    aborted = len(engine.aborted)
    body = {"model": MODEL_NAME, "messages": [ALPHA, BETA], "max_tokens": 200}
    left = threading.Event()

    def leave() -> None:  # gives up long before the 200 tokens (~1 s) are written
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.url}{PATH}", json=body, timeout=httpx.Timeout(10, read=0.3))
        left.set()

    t = threading.Thread(target=leave)
    t.start()
    wait_for(lambda: len(engine.requests) == 2, 5, "both conversations running")
    t.join(10)
    assert left.is_set()
    wait_for(lambda: not engine.requests, 5, "the conversations aborted")
    assert len(engine.aborted) == aborted + 2


def test_usage_sums_every_count_and_detail() -> None:
    usages: list[dict[str, Any]] = [
        {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11},
    ]
    usages[0]["prompt_tokens_details"] = {"cached_tokens": 4}
    usages[1]["prompt_tokens_details"] = None
    assert summed_usage(usages) == {
        "prompt_tokens": 13,
        "completion_tokens": 5,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    for u, n in zip(usages, (3, 0), strict=True):
        u["completion_tokens_details"] = {"reasoning_tokens": n}
    assert summed_usage(usages)["completion_tokens_details"] == {"reasoning_tokens": 3}
    for u in usages:
        u["prompt_tokens_details"] = None
    assert summed_usage(usages)["prompt_tokens_details"] is None
    plain = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    assert summed_usage([plain, plain]) == {
        **plain,
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
    }  # no details: none added


def test_the_route_is_in_the_openapi_document(gateway: GatewayServer) -> None:
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()
    op = doc["paths"][PATH]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    messages = schema["properties"]["messages"]
    assert messages["type"] == "array" and messages["maxItems"] == 1024
    assert messages["items"]["type"] == "array"  # a conversation: a list of messages
    assert "stream" in schema["properties"] and "use_beam_search" not in schema["properties"]
