"""What every reasoning parser shares: the streaming split of text into reasoning and content, and
how one request uses a parser (whether its output begins in reasoning, its reasoning tokens).

A reasoning model writes its thinking between a start and an end tag (``<think>``…``</think>``)
and then its answer. The chat template often writes the start tag into the prompt, so the output
may begin inside the reasoning without it. The split, for one choice's output::

    "\\n<think>I greet back.</think>Hello!"
     ^^^^^^^^^                            dropped (only when the output opens with it)
              ^^^^^^^^^^^^^               reasoning
                           ^^^^^^^^       dropped
                                   ^^^^^^ content

The first end tag ends the reasoning; everything after it is content, verbatim (a later tag too).
An output with no end tag is all reasoning (cut off while thinking, or the model never ended).

Streaming, a :class:`ReasoningStream` is fed each text delta and holds back only what could still
be the start of a tag, so every split of a text gives the same reasoning and content as the whole.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from frontend_svc.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ReasoningDelta:
    """What to send for one fed piece of text."""

    reasoning: str = ""
    content: str = ""


class _Phase(enum.Enum):
    OPENING = enum.auto()  # reasoning, but an opening start tag may still come
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ReasoningStream:
    """One choice's split, fed text delta by delta (the last one with ``final=True``)."""

    def __init__(self, start_tag: str, end_tag: str, in_reasoning: bool) -> None:
        """``in_reasoning``: the output begins in reasoning; otherwise all of it is content."""
        self._start, self._end = start_tag, end_tag
        self._phase = _Phase.OPENING if in_reasoning else _Phase.CONTENT
        self._held = ""  # text fed but not yet sent: it may be the start of a tag
        self._finished = False

    @property
    def reasoning_ended(self) -> bool:
        """Whether the content has begun (the end tag was seen, or there is no reasoning)."""
        return self._phase is _Phase.CONTENT

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("this reasoning stream already got its final text")
        self._finished = final
        text, self._held = self._held + text, ""
        if self._phase is _Phase.CONTENT:
            return ReasoningDelta(content=text)
        if self._phase is _Phase.OPENING:
            opened = text.lstrip()
            if opened.startswith(self._start):
                text = opened[len(self._start) :]
            elif self._start.startswith(opened) and not final:
                self._held = text  # only whitespace, or a start tag's beginning, so far
                return ReasoningDelta()
            self._phase = _Phase.REASONING
        at = text.find(self._end)
        if at >= 0:
            self._phase = _Phase.CONTENT
            return ReasoningDelta(text[:at], text[at + len(self._end) :])
        keep = 0 if final else _tag_prefix_len(text, self._end)
        self._held = text[len(text) - keep :]
        return ReasoningDelta(reasoning=text[: len(text) - keep])


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for i in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[i:]):
            return len(text) - i
    return 0


class ReasoningParser:
    """A reasoning format: its tags, and when a request's output begins in reasoning. Stateless;
    :meth:`for_request` makes what one request uses."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    @property
    def markers(self) -> tuple[str, ...]:
        """The tags, kept in the text even where the tokenizer holds them as special tokens."""
        return (self.start_tag, self.end_tag)

    def thinking_enabled(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the request's ``chat_template_kwargs`` leave thinking on (by default: yes,
        whatever they say)."""
        return True

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Reasoning and content of a whole output that begins in reasoning; each None when
        empty (vLLM's ``extract_reasoning``)."""
        out = ReasoningStream(self.start_tag, self.end_tag, True).feed(text, final=True)
        return out.reasoning or None, out.content or None

    def for_request(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        template_kwargs: Mapping[str, Any],
    ) -> RequestReasoning:
        """How this request's output is split. It begins in reasoning unless the template
        kwargs turn thinking off or the prompt already ended the reasoning
        (:func:`prompt_ends_reasoning`). A structured-output constraint then applies after the
        reasoning (``RequestReasoning.end_ids`` go to the engine with it), as vLLM's does."""
        start_ids = tuple(tokenizer.encode(self.start_tag, add_special_tokens=False))
        end_ids = tuple(tokenizer.encode(self.end_tag, add_special_tokens=False))
        active = (
            self.thinking_enabled(template_kwargs)
            and not prompt_ends_reasoning(
                prompt_ids, start_ids, end_ids, tokenizer.special_token_ids
            )
        )
        return RequestReasoning(self, active, start_ids, end_ids)


@dataclass(frozen=True)
class RequestReasoning:
    """A parser as one request uses it. ``active``: its output begins in reasoning (else it is
    all content); ``start_ids`` / ``end_ids``: the tags' token ids in the model's tokenizer."""

    parser: ReasoningParser
    active: bool
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    def stream(self) -> ReasoningStream:
        """A choice's streaming split."""
        return ReasoningStream(self.parser.start_tag, self.parser.end_tag, self.active)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """Reasoning and content of a whole output. Inactive: no reasoning (None), the text as
        the content; active: each None when empty, as vLLM answers."""
        if not self.active:
            return None, text
        return self.parser.extract(text)

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        """The output tokens that are reasoning: those before the first end tag, less an
        opening start tag (vLLM's ``count_reasoning_tokens``: the tags are not reasoning).
        Exact where the tags are tokens of their own (Qwen3's and DeepSeek-R1's vocabularies);
        elsewhere the tags are found as the ids they encode to on their own."""
        if not self.active:
            return 0
        end = _find(token_ids, self.end_ids)
        end = len(token_ids) if end < 0 else end
        opening = len(self.start_ids) if _find(token_ids[:end], self.start_ids) == 0 else 0
        return end - opening


def prompt_ends_reasoning(
    prompt_ids: Sequence[int],
    start_ids: Sequence[int],
    end_ids: Sequence[int],
    turn_ids: frozenset[int],
) -> bool:
    """Whether the prompt's last turn already closed its reasoning: reading back from the end,
    an end tag comes before a start tag and before any ``turn_ids`` token (the special tokens
    that mark turns, such as ``<|im_start|>``). Qwen3's template with ``enable_thinking: false``
    ends the prompt with ``<think>\\n\\n</think>\\n\\n``; an assistant message continued after its
    reasoning (``continue_final_message``) ends after ``</think>`` too.

    vLLM (``is_reasoning_end`` on the prompt) reads back through every turn, so an earlier
    assistant turn's ``</think>`` (Qwen3 renders those of a tool-calling loop) would make a new
    turn's reasoning content; stopping at the turn's first special token keeps it reasoning.
    """
    if not end_ids:
        return False
    for i in range(len(prompt_ids), 0, -1):
        if _ends_with(prompt_ids, i, end_ids):
            return True
        if (start_ids and _ends_with(prompt_ids, i, start_ids)) or prompt_ids[i - 1] in turn_ids:
            return False
    return False


def _ends_with(ids: Sequence[int], stop: int, tag: Sequence[int]) -> bool:
    return stop >= len(tag) and all(ids[stop - len(tag) + j] == t for j, t in enumerate(tag))


def _find(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where ``tag`` first occurs in ``ids``; -1 when nowhere (or when ``tag`` is empty)."""
    if not tag:
        return -1
    if len(tag) == 1:  # a tag that is one token: nearly every reasoning model's
        try:
            return ids.index(tag[0])
        except ValueError:
            return -1
    for i in range(len(ids) - len(tag) + 1):
        if ids[i] == tag[0] and all(ids[i + j] == t for j, t in enumerate(tag)):
            return i
    return -1
