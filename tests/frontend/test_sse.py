"""SSE events are one line each for every client's line splitter, whatever text a model makes."""

from __future__ import annotations

import json

import httpx

from frontend_svc.routes.sse import sse_event

# Line ends for str.splitlines (and so httpx's iter_lines) that JSON leaves unescaped, plus the
# ones JSON escapes anyway.
AWKWARD = "a\x85b\u2028c\u2029d\x1ce\x1df\x1eg\nh\ri\x0bj\x0ck é ☕"


def test_an_event_is_one_line_for_str_splitlines() -> None:
    event = sse_event({"text": AWKWARD}).decode()
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: ")) == {"text": AWKWARD}
    assert event.endswith("\n\n")


def test_an_event_is_one_line_for_httpx_iter_lines() -> None:
    events = sse_event({"text": AWKWARD}) + sse_event({"text": "next"})
    response = httpx.Response(200, content=events)
    data = [line for line in response.iter_lines() if line]
    assert [json.loads(d.removeprefix("data: "))["text"] for d in data] == [AWKWARD, "next"]
