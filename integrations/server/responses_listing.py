"""A stored response's input items as GET /v1/responses/{id}/input_items lists them: each item
as OpenAI writes it back (a `type`, an `id`, a message's content as parts), and the page a
query asks for (OpenAI's cursor list: `limit` 1-100, default 20; `order` "desc", the newest
first, by default, or "asc"; `after` an item id: those after it in that order)."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping
from typing import Any

from freetoken_agent.integrations.server.errors import BadParam

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}  # fmt: skip


def listed_items(items: list[Any]) -> list[dict[str, Any]]:
    """`items` (a request's input, already checked) as they are listed: copies, a role's item
    typed "message" with its string content as one part (`output_text` for the assistant's,
    `input_text` for the others'), each with an id (its own when it had one)."""
    listed = []
    for item in items:
        out = copy.deepcopy(dict(item))
        kind = out.setdefault("type", "message")
        if kind == "message" and isinstance(out.get("content"), str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": out["content"]}]
        out.setdefault("id", f"{_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}")
        listed.append(out)
    return listed


def page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """The list object of `items` (in the order they were sent) that `query` asks for."""
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadParam(f"order must be 'asc' or 'desc', got {order!r:.40}", "order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise BadParam(f"after {after!r:.60} is not an item of this response", "after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadParam(f"limit must be an integer from 1 to 100, got {raw!r:.40}", "limit")
    return limit
