"""One model turn of an MCPHost run, and the tool_choice that may force it.

`forced_schema` reads a forcing tool_choice ("required", a tool's name, or OpenAI's
`{"type": "function", "function": {...}}` with FreeToken's pinned `"arguments"`) into the JSON
schema of the calls it allows, against the tools the model will see. `stream_turn` generates a
turn from the Session in a worker thread and gathers its events into a `Turn` (mcp_turn.py):
a forced turn under that schema's grammar, without the tool-call parser, its JSON parsed when
it ends. The host (mcp_host.py) runs the loop of turns and tool calls around them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from freetoken_agent.integrations.constrained_output import closed, rooted
from freetoken_agent.integrations.mcp_engine import iterate_in_thread
from freetoken_agent.integrations.mcp_tools import Route
from freetoken_agent.integrations.mcp_turn import Turn, call_schema
from freetoken_agent.messages import Message
from freetoken_agent.session import Session, TextDelta, Usage


def forced_schema(
    choice: str | Mapping[str, Any], tools: list[dict[str, Any]], routes: Mapping[str, Route]
) -> tuple[str, dict] | None:
    """(label, JSON schema of the allowed calls) for a forcing tool_choice, else None; `tools`
    and `routes` are the host's index (mcp_tools.py), the tools the model will see. Closed as
    the server's and ChatFreeToken's forced calls are (constrained_output.closed): a nested
    object (a pydantic parameter) takes only its own keys, or a weak model adds keys until
    max_tokens voids the call."""
    pinned: Mapping[str, Any] = {}
    if isinstance(choice, Mapping):  # OpenAI's {"type": "function", "function": {...}}
        fn = choice.get("function", choice)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_choice {choice!r} names no function")
        choice, pinned = fn["name"], fn.get("arguments") or {}
    if choice in ("auto", "none"):  # "none": MCPHost reads the turn without calls
        return None
    if not tools:
        raise ValueError(f"tool_choice {choice!r} needs tools, and no server offers any")
    if choice == "required":
        defs: dict[str, Any] = {}
        schemas = [call_schema(t, {}, defs, f"tool{i}.") for i, t in enumerate(tools)]
        return "required", closed(rooted(schemas, defs))
    tool = next((t for t in tools if t["function"]["name"] == choice), None)
    if tool is None:
        raise ValueError(
            f"tool_choice {choice!r} is not a tool of the connected servers; available: "
            f"{', '.join(routes)}"
        )
    defs = {}
    return choice, closed(rooted([call_schema(tool, pinned, defs)], defs))


async def stream_turn(
    session: Session | None,
    history: list[Message],
    sampling: dict[str, Any],
    forced: tuple[str, dict[str, Any]] | None,
    turn: Turn,
    parser: Any = None,
) -> AsyncIterator[Any]:
    """Generate one turn of `session` on `history` into `turn`, yielding the parser's events
    (for a forced turn, the call's once its JSON is parsed) and last the turn's Usage.
    `forced`: `forced_schema`'s (label, schema) when this turn is forced, else None;
    `parser`: this turn's parser factory (None: the session's)."""
    assert session is not None
    options = dict(sampling)
    parser = parser or session.parser_factory
    if forced is not None:
        options["json_schema"], parser = forced[1], None
    params = session.sampling(options)
    send = lambda: session.send(history, params, parser_factory=parser)  # noqa: E731
    async with aclosing(iterate_in_thread(send)) as stream:  # closing it aborts the request
        async for event in stream:
            if isinstance(event, Usage):
                turn.usage = event
            elif isinstance(event, TextDelta):  # forced: the JSON of the call
                turn.raw.append(event.text)
            else:
                turn.take(event)
                yield event
    if forced is not None and turn.usage.finish_reason != "error":
        for event in turn.forced_call():
            yield event
    yield turn.usage
