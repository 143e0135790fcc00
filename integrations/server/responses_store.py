"""The responses a Responses API client may read back (GET /v1/responses/{id}), list the input of
(GET .../input_items), delete, or continue with `previous_response_id`: kept in memory for the
server's life, the most recent MAX_KEPT, and fewer when their own parts pass MAX_KEPT_BYTES (a
client that sends its whole history each turn, as the OpenAI Agents SDK does by default, keeps
a copy of it with every response; the newest response is always kept). A request with
`store: false` (Codex sends it) is not kept. Each kept response holds:
- `response`: the response object as it ended;
- `input`: this request's own input items (those after the previous response's), each with an
  id as OpenAI lists them (responses_listing.listed_items);
- `conversation`: the whole conversation as input items (the previous ones', this input, then
  the output), which a request naming it as previous_response_id continues."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_KEPT = 512  # responses; an agent loop continues from its last one
MAX_KEPT_BYTES = 64 * 2**20  # their own parts, as JSON text (several times that as objects)


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input: list[dict[str, Any]]
    conversation: list[Any]

    @property
    def size(self) -> int:
        """Its own parts' size as JSON text: this request's input and the response (the
        conversation's earlier items are a previous response's, held there too)."""
        return len(json.dumps([self.input, self.response], ensure_ascii=False, default=str))


class ResponseStore:
    def __init__(self, max_kept: int = MAX_KEPT, max_bytes: int = MAX_KEPT_BYTES) -> None:
        self.max_kept = max_kept
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()  # (it, size)
        self._bytes = 0
        # The routes keep and delete on the event loop; a request's parsing reads a previous
        # response on heavy_work's pool.
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        key = stored.response["id"]
        size = stored.size  # outside the lock: JSON of the whole response
        with self._lock:
            self._drop(key)
            self._kept[key] = (stored, size)
            self._bytes += size
            while len(self._kept) > 1 and (
                len(self._kept) > self.max_kept or self._bytes > self.max_bytes
            ):
                _, (_, dropped) = self._kept.popitem(last=False)
                self._bytes -= dropped

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            kept = self._kept.get(response_id)
        return None if kept is None else kept[0]

    def conversation(self, response_id: str) -> list[Any] | None:
        """The conversation of `response_id` as input items (a copy), None when not kept."""
        stored = self.get(response_id)
        return None if stored is None else list(stored.conversation)

    def delete(self, response_id: str) -> bool:
        """Whether `response_id` was kept (it is not any more)."""
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._bytes -= kept[1]
        return kept is not None

    def __len__(self) -> int:
        return len(self._kept)
