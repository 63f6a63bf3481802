"""The body of POST /v1/chat/completions/batch (vLLM's): chat's fields, with ``messages`` a list
of conversations. ``parse.parse_chat_batch`` makes one chat request of each."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

from frontend_svc.protocol.base import problem
from frontend_svc.protocol.fields import FAIL_FAST, FALSE, Bool, InRange, Int, Says
from frontend_svc.protocol.messages import Messages
from frontend_svc.protocol.models import MAX_CHOICES, ChatFields

_BATCH = "/v1/chat/completions/batch"


def _not_streamed(v: bool) -> bool:
    if v:
        raise problem(f"must be false: {_BATCH} does not stream")
    return v


def _no_beam_search(v: bool) -> bool:
    if v:
        raise problem(f"must be false: {_BATCH} does not run beam search")
    return v


class ChatBatchBody(ChatFields):
    """POST /v1/chat/completions/batch (vLLM's): chat's body with ``messages`` a list of
    conversations, each answered as its own request (one choice each). vLLM's limits hold:
    no streaming, tools, beam search or ``n`` other than 1; nor ``prompt_logprobs`` (the
    response has one top-level place for one prompt's)."""

    messages: Annotated[list[Messages], Field(min_length=1, max_length=MAX_CHOICES), FAIL_FAST] = (
        Field(description=f"The conversations (at most {MAX_CHOICES}), each a list of messages.")
    )
    stream: Annotated[Bool, AfterValidator(_not_streamed), WithJsonSchema(FALSE)] = False
    n: Annotated[
        Int, InRange(1, 1), Says(f"must be 1: {_BATCH} answers each conversation once")
    ] = 1
    tools: Annotated[None, Says(f"is not supported: {_BATCH} takes no tools")] = None
    tool_choice: (
        Annotated[Literal["none"], Says(f"must be 'none': {_BATCH} takes no tools")] | None
    ) = None
    prompt_logprobs: Annotated[None, Says(f"is not supported by {_BATCH}")] = None
    use_beam_search: SkipJsonSchema[Annotated[Bool, AfterValidator(_no_beam_search)]] = False
