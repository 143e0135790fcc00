"""Tool-call ids as a chat template takes them back.

Mistral's templates raise unless the id of every call an assistant made, and of every tool
result, is 9 characters long ("Tool call IDs should be alphanumeric strings with length 9!").
Ids from other clients or models (OpenAI's `call_` + 24 characters, Anthropic's `toolu_...`) are
longer. For a template that writes Mistral's calls, each id that is not 9 letters and digits is
replaced, in the calls and in the results that answer them alike, by 9 letters and digits
derived from it: the same id always gives the same replacement, so a call and its result stay
paired, and a Session's cached renders of the history stay valid. vLLM keeps an id's last 9
characters instead, which pairs two calls of one turn whose ids end alike, and leaves `_` or
`-` in them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from freetoken_agent.parsers.events import ID_ALPHABET, MISTRAL_ID_LENGTH
from freetoken_agent.parsers.registry import tool_format_for

_MISTRAL_ID = re.compile(f"[A-Za-z0-9]{{{MISTRAL_ID_LENGTH}}}")


def wants_mistral_ids(template_source: str) -> bool:
    """Whether a template writes Mistral's tool calls (`[TOOL_CALLS]`), whose ids it checks."""
    return tool_format_for("", template_source) == "mistral"


def mistral_id(call_id: str) -> str:
    """`call_id` if it is already 9 letters and digits, else 9 derived from its digest."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = []
    for _ in range(MISTRAL_ID_LENGTH):
        n, r = divmod(n, len(ID_ALPHABET))
        digits.append(ID_ALPHABET[r])
    return "".join(digits)


def with_mistral_ids(dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template messages (messages.to_template_messages) with every call id and result id
    made Mistral's (`mistral_id`); messages without ids are the same objects."""
    out = []
    for d in dicts:
        if d.get("tool_calls"):
            calls = [{**c, "id": mistral_id(c["id"])} if isinstance(c.get("id"), str) else c
                     for c in d["tool_calls"]]  # fmt: skip
            d = {**d, "tool_calls": calls}
        elif isinstance(d.get("tool_call_id"), str):
            d = {**d, "tool_call_id": mistral_id(d["tool_call_id"])}
        out.append(d)
    return out
