"""The pre-encoded SSE event of a plain stream's middle chunks is byte for byte the event
``chunks`` + ``sse_event`` give, for completions and chat, and leaves every other chunk to them."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from frontend_svc.protocol.parse import parse_chat, parse_completion
from frontend_svc.routes import chat, completions
from frontend_svc.routes.sse import TextEvents, sse_event
from frontend_svc.text.output_processor import SequenceDelta
from frontend_svc.text.tokenizer import Tokenizer
from protos.types import TokenizerFiles

TEXTS = ["a", " world", '"quoted"', "back\\slash", "tab\there", "new\nline", "\u2028", "\x85x",
         "naïve café", "日本語", "🙂", "\x00\x1f", "</script>", "{}[],:"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_files(
        TokenizerFiles({p.name: p.read_bytes() for p in tokenizer_dir.iterdir()})
    )


def _deltas(n: int, seed: int) -> list[SequenceDelta]:
    """n choices, interleaved: a first delta each, middles (some empty), a final each."""
    rng = random.Random(seed)
    out: list[SequenceDelta] = []
    for step in range(12):
        for index in range(n):
            last = step == 11
            text = rng.choice(TEXTS) if rng.random() > 0.1 else ""
            out.append(
                SequenceDelta(
                    index, 0, text, (7,), (), (), "length" if last else None, None, 3, 1, step == 0
                )  # fmt: skip
            )
    return out


def _stream(to_chunks: Callable[[SequenceDelta], list[dict[str, Any]]],
            text_event: Callable[[SequenceDelta], bytes | None] | None,
            deltas: list[SequenceDelta]) -> tuple[list[bytes], int]:  # fmt: skip
    events, fast = [], 0
    for d in deltas:
        event = text_event(d) if text_event is not None else None
        if event is not None:
            events.append(event)
            fast += 1
        else:
            events += [sse_event(c) for c in to_chunks(d)]
    return events, fast


CASES: list[tuple[str, dict[str, Any]]] = [
    *(
        ("completion", options)
        for options in (
            {},
            {"n": 2},
            {"echo": True},
            {"stream_options": {"include_usage": True}},
            {"logprobs": 2},
            {"return_token_ids": True},
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    ),
    *(
        ("chat", options)
        for options in (
            {},
            {"n": 2},
            {"stream_options": {"include_usage": True}},
            {"logprobs": True, "top_logprobs": 1},
            {"return_token_ids": True},
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    ),
]


def _context(kind: str, options: dict[str, Any], tokenizer: Tokenizer) -> Any:
    """A fresh per-call context of the route, for these request options."""
    if kind == "completion":
        body = {"model": "m", "prompt": "Hello", "max_tokens": 12, "stream": True, **options}
        req = parse_completion(body, 20)
        return completions._Context(req, tokenizer, [[0, 5, 6]], ["Hello"], "cmpl-x1", "m")
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": "m", "messages": messages, "max_tokens": 12, "stream": True, **options}
    return chat.ChatReply(parse_chat(body, 20), tokenizer, "chatcmpl-x1", "m", None, [0, 5, 6])


@pytest.mark.parametrize(("kind", "options"), CASES, ids=str)
def test_text_events_equal_the_chunks(tokenizer: Tokenizer, kind: str, options: dict) -> None:
    deltas = _deltas(options.get("n", 1), seed=len(str(options)))
    slow, _ = _stream(_context(kind, options, tokenizer).chunks, None, deltas)
    ctx = _context(kind, options, tokenizer)
    quick, fast = _stream(ctx.chunks, ctx.text_event, deltas)
    assert quick == slow
    per_token = {"logprobs", "return_token_ids"} & set(options) or "continuous" in str(options)
    assert (fast > 0) == (not per_token)  # used for plain streams only, and there for the middles


def test_a_template_without_the_text_marker_is_refused() -> None:
    with pytest.raises(ValueError):
        TextEvents({"choices": [{"text": "no marker"}]})
