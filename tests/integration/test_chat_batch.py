"""POST /v1/chat/completions/batch against the real gateway and engine: each conversation's
choice is what /v1/chat/completions answers to it alone (greedy), indexed by its number, with
the usage summed; the ``openai`` client parses the answer as a ChatCompletion."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.integration.harness import MODEL

pytestmark = pytest.mark.timeout(60)
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 6}
CONVERSATIONS: Any = [
    [{"role": "user", "content": "Reply with exactly the word: alpha"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reply with exactly the word: beta"},
    ],
]


def test_each_choice_is_its_conversation_alone(client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": CONVERSATIONS, **GREEDY}
    batch = client.post("/chat/completions/batch", body=body, cast_to=ChatCompletion)
    assert batch.object == "chat.completion" and [c.index for c in batch.choices] == [0, 1]
    prompt_tokens = completion_tokens = 0
    for choice, messages in zip(batch.choices, CONVERSATIONS, strict=True):
        alone = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0.0,
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == "length"
        assert alone.usage is not None
        prompt_tokens += alone.usage.prompt_tokens
        completion_tokens += alone.usage.completion_tokens
    assert batch.usage is not None
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (prompt_tokens, 12)
    assert completion_tokens == 12


def test_streaming_is_refused(client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": CONVERSATIONS, "stream": True}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions/batch", body=body, cast_to=ChatCompletion)
    assert e.value.body["param"] == "stream"  # type: ignore[index]
    assert "does not stream" in e.value.message
