"""What every tool-call parser shares: the result types, and a streaming base class.

A parser turns model text into OpenAI tool calls. Streaming, it is fed each new piece of text and
answers what to send now: content, and tool-call deltas (first ``{index, id, type, function:
{name}}``, then ``{index, function: {arguments}}`` pieces whose concatenation is the call's
arguments JSON). Text that could still turn into tool-call markup is held back until it is
decided, like a partial stop string.

A *unit* is the stretch of text a format treats as one attempt at tool calls (a ``<tool_call>``
block, one Llama JSON object, a pythonic list). While no call of a unit has been sent, its text is
kept; if the unit turns out malformed, that text becomes content, as vLLM falls back to content.
``extract`` (non-streaming) runs the same stream with ``strict=True``: calls are held until their
unit is complete, so a malformed unit is always content. Streaming gives the same result for every
split of the text, and the same as ``extract`` unless a unit fails after one of its calls was sent
(a stream cannot take a call back; the rest of the unit then arrives as content).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from frontend_svc.tool_parsers.json_scan import CallObjectScanner, JsonSyntaxError


def make_tool_call_id() -> str:
    """A tool call id as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# Models whose calls vLLM names "functions.NAME:INDEX" (the format their chat template reads
# back): config.json's model_type, as vLLM's get_tool_call_id_type decides.
KIMI_K2_MODEL_TYPES = ("kimi_k2", "kimi_k25")


@dataclass(frozen=True)
class CallIds:
    """How one request's tool calls are named: random ``chatcmpl-tool-...`` ids, or for Kimi-K2
    ``functions.NAME:INDEX`` where INDEX counts on from the calls already in the conversation
    (vLLM's ``make_tool_call_id`` with ``get_history_tool_calls_cnt``)."""

    kimi_k2: bool = False
    first_index: int = 0  # tool calls the conversation's assistant messages already made

    @classmethod
    def of(cls, model_type: str, messages: Iterable[dict[str, Any]]) -> CallIds:
        if model_type not in KIMI_K2_MODEL_TYPES:
            return RANDOM_IDS
        made = sum(
            len(m.get("tool_calls") or ()) for m in messages if m.get("role") == "assistant"
        )
        return cls(True, made)

    def __call__(self, name: str, index: int) -> str:
        """The id of the output's ``index``-th call, to ``name``."""
        if self.kimi_k2:
            return f"functions.{name}:{self.first_index + index}"
        return make_tool_call_id()


RANDOM_IDS = CallIds()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # None when there is no text besides the calls
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call ``index``: its header (id and name) and/or an arguments piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, str] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass(frozen=True)
class StreamDelta:
    """What to send for one fed piece of text."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


def collect_tool_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """Reassemble calls from their streamed deltas, in index order."""
    headers: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None and d.name is not None:
            headers[d.index] = (d.id, d.name)
        if d.arguments is not None:
            arguments.setdefault(d.index, []).append(d.arguments)
    return [
        ToolCall(call_id, name, "".join(arguments.get(i, ())))
        for i, (call_id, name) in sorted(headers.items())
    ]


def _coalesce(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Merge consecutive deltas of the same call (header + argument pieces) into one."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is None or last.index != d.index or d.id is not None:
            out.append(d)
            continue
        if d.arguments is not None:
            out[-1] = ToolCallDelta(
                last.index, last.id, last.name, (last.arguments or "") + d.arguments
            )
    return tuple(out)


class ToolCallStream(ABC):
    """Per-sequence streaming state. Feed every text delta; pass ``final=True`` with the last.
    ``call_ids`` names the calls (set by ``ToolParser.open``)."""

    call_ids: CallIds = RANDOM_IDS

    def __init__(self, *, strict: bool = False) -> None:
        self._strict = strict
        self._content_out: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._finished = False
        self._next_index = 0
        self._call_announced = False  # the current call's header is out (or deferred)
        # The open unit: its text while it may still become content, and (strict) its held calls.
        self._raw: list[str] | None = None
        self._deferred: list[ToolCallDelta] | None = None
        self._unit_first_index = 0

    @property
    def num_calls(self) -> int:
        """Calls sent so far (for ``finish_reason: "tool_calls"``)."""
        return self._next_index

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        if self._finished:
            raise RuntimeError("this tool-call stream already got its final text")
        self._finished = final
        self._consume(delta, final)
        out = StreamDelta("".join(self._content_out), _coalesce(self._deltas))
        self._content_out.clear()
        self._deltas.clear()
        return out

    @abstractmethod
    def _consume(self, text: str, final: bool) -> None:
        """Process ``text``; with ``final`` decide everything still held."""

    # Helpers for subclasses.

    def _emit_content(self, text: str) -> None:
        if text:
            self._content_out.append(text)

    def _open_unit(self, raw: str = "") -> None:
        self._raw = [raw] if raw else []
        self._deferred = [] if self._strict else None
        self._unit_first_index = self._next_index

    def _keep_raw(self, text: str) -> None:
        if self._raw is not None and text:
            self._raw.append(text)

    def _announce(self, name: str) -> None:
        self._call_announced = True
        self._send(ToolCallDelta(self._next_index, self.call_ids(name, self._next_index), name))
        self._next_index += 1
        if not self._strict:
            self._raw = None  # the unit can no longer turn into content

    def _emit_arguments(self, piece: str) -> None:
        if piece:
            self._send(ToolCallDelta(self._next_index - 1, arguments=piece))

    def _send(self, delta: ToolCallDelta) -> None:
        (self._deltas if self._deferred is None else self._deferred).append(delta)

    def _close_unit(self) -> None:
        if self._deferred is not None:
            self._deltas.extend(self._deferred)
        self._raw = self._deferred = None

    def _fail_unit(self) -> bool:
        """The open unit is malformed. If none of its calls went out, its text becomes content
        and True is returned; otherwise the caller sends what follows as content."""
        raw, self._raw = self._raw, None
        self._deferred = None
        if raw is None:
            return False
        self._next_index = self._unit_first_index
        self._emit_content("".join(raw))
        return True

    def _feed_call_object(self, obj: CallObjectScanner, text: str, pos: int) -> tuple[int, bool]:
        """Feed a call object; send its header once the name and the start of the arguments are
        known, then its argument text as it comes. Returns (position, failed); on failure the
        position is where the text stopped being a valid call object."""
        failed = False
        try:
            end = obj.feed(text, pos)
        except JsonSyntaxError as e:
            end, failed = e.pos, True
        self._keep_raw(text[pos:end])
        if not self._call_announced and obj.name is not None and (obj.args_started or obj.done):
            self._announce(obj.name)
        if self._call_announced:
            self._emit_arguments(obj.take_arguments())
        if failed or obj.done:
            self._call_announced = False
        return end, failed


class ToolParser(ABC):
    """A tool-call format. Stateless: ``stream()`` makes the per-sequence state."""

    name: ClassVar[str]
    # The format's marker strings. Tokenizers may hold them as special tokens (Qwen's
    # <tool_call>, Llama's <|python_tag|>), which skip_special_tokens would drop before the
    # parser sees them; the gateway keeps those tokens' text while this parser reads the output.
    markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def stream(self, *, strict: bool = False) -> ToolCallStream: ...

    def open(self, ids: CallIds = RANDOM_IDS, *, strict: bool = False) -> ToolCallStream:
        """``stream()`` naming its calls with ``ids``."""
        stream = self.stream(strict=strict)
        stream.call_ids = ids
        return stream

    def extract(self, text: str, ids: CallIds = RANDOM_IDS) -> ExtractedToolCalls:
        """Content and calls of a complete output; malformed markup stays content."""
        out = self.open(ids, strict=True).feed(text, final=True)
        return ExtractedToolCalls(out.content or None, collect_tool_calls(out.tool_calls))


def marker_prefix_len(text: str, start: int, marker: str) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``marker``."""
    for i in range(max(start, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return len(text) - i
    return 0
