"""The responses a Responses API client may continue with `previous_response_id`: each stored
response's whole conversation as input items (its input, the previous ones' included, then its
output items), kept in memory for the server's life, the most recent MAX_KEPT. A request with
`store: false` (Codex sends it) is not kept."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_KEPT = 512  # responses; an agent loop continues from its last one


class ResponseStore:
    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, items: list[dict[str, Any]]) -> None:
        self._items[response_id] = items
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_kept:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation of `response_id` as input items (a copy), None when not kept."""
        items = self._items.get(response_id)
        return None if items is None else list(items)
