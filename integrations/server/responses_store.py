"""The responses a Responses API client may read back (GET /v1/responses/{id}), list the input of
(GET .../input_items), delete, or continue with `previous_response_id`: kept in memory for the
server's life, the most recent MAX_KEPT. A request with `store: false` (Codex sends it) is not
kept. Each kept response holds:
- `response`: the response object as it ended;
- `input`: this request's own input items (those after the previous response's), each with an
  id as OpenAI lists them (responses_listing.listed_items);
- `conversation`: the whole conversation as input items (the previous ones', this input, then
  the output), which a request naming it as previous_response_id continues."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_KEPT = 512  # responses; an agent loop continues from its last one


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input: list[dict[str, Any]]
    conversation: list[Any]


class ResponseStore:
    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        key = stored.response["id"]
        self._kept[key] = stored
        self._kept.move_to_end(key)
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._kept.get(response_id)

    def conversation(self, response_id: str) -> list[Any] | None:
        """The conversation of `response_id` as input items (a copy), None when not kept."""
        stored = self._kept.get(response_id)
        return None if stored is None else list(stored.conversation)

    def delete(self, response_id: str) -> bool:
        """Whether `response_id` was kept (it is not any more)."""
        return self._kept.pop(response_id, None) is not None
