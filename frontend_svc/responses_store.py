"""The gateway's memory of Responses API calls made with ``store: true``: what
``GET /v1/responses/{id}``, its ``input_items`` and ``previous_response_id`` read.

Bounded two ways, both set by flags (``--responses-store-max-entries``,
``--responses-store-max-bytes``): the oldest response goes first when either is passed. An entry
is kept as the JSON bytes it is answered with, so the byte bound is the memory it holds (within
the few hundred bytes of one Python object per entry). A response larger than the whole byte
budget is not kept at all.

In memory and per process: a gateway's restart forgets every response, and with ``--workers``
above one each worker keeps its own (a ``previous_response_id`` must reach the worker that
answered it; the store is no shared session state). Used from the event loop only: no locks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    """One stored call: its Response object, its own input items, and the items of the
    conversation it continued (``previous_response_id``'s, without their instructions), each as
    JSON."""

    response: bytes
    input_items: bytes
    context: bytes

    @classmethod
    def of(
        cls,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        context: list[dict[str, Any]],
    ) -> StoredResponse:
        return cls(orjson.dumps(response), orjson.dumps(input_items), orjson.dumps(context))

    @property
    def num_bytes(self) -> int:
        return len(self.response) + len(self.input_items) + len(self.context)

    def conversation(self) -> list[dict[str, Any]]:
        """The items a next turn continues: the context, this call's input, its output."""
        output: list[dict[str, Any]] = orjson.loads(self.response)["output"]
        return [*orjson.loads(self.context), *orjson.loads(self.input_items), *output]


class ResponseStore:
    """Stored responses by id, oldest first; at most ``max_entries`` of them and
    ``max_bytes`` of JSON (0 entries: nothing is kept)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep ``entry``, evicting the oldest until both bounds hold; False when it alone is
        past them (it is not kept)."""
        size = entry.num_bytes
        if self.max_entries < 1 or size > self.max_bytes:
            logger.warning(
                "response %s (%d bytes) is not stored: past --responses-store-max-bytes %d "
                "or --responses-store-max-entries %d",
                response_id,
                size,
                self.max_bytes,
                self.max_entries,
            )
            return False
        self.delete(response_id)
        while self._entries and (
            len(self._entries) >= self.max_entries or self._num_bytes + size > self.max_bytes
        ):
            _, oldest = self._entries.popitem(last=False)
            self._num_bytes -= oldest.num_bytes
        self._entries[response_id] = entry
        self._num_bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._num_bytes -= entry.num_bytes
        return True
