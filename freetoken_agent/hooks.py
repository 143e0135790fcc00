"""Session-aware tool hooks: code that runs around every tool call an agent makes.

    before_tool(call, session) -> ToolCall | None      edit the arguments, or veto (None)
    after_tool(call, result, session) -> ToolResult    edit or truncate what the model will see

Hooks run in registration order, each seeing the previous one's output. `run_tool` applies them
around a tool function and returns a `ToolRun` recording what happened; `Session.run_tool` keeps
those records, so after a hook edits a result the session can name the anchor the edit touches
(`Session.anchor_for(call.id)`: the tool_output anchor of the message that carries the result).

The history keeps the call the model made: a before-hook's edit changes what runs, not the
assistant turn, whose tokens therefore stay reusable.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from freetoken_agent.messages import ToolCall, ToolResult

if TYPE_CHECKING:
    from freetoken_agent.session import Session

BeforeTool = Callable[[ToolCall, "Session"], "ToolCall | None"]
AfterTool = Callable[[ToolCall, ToolResult, "Session"], ToolResult]
ToolFunction = Callable[..., Any]  # called with the call's arguments as keywords


@dataclass(slots=True)
class ToolHooks:
    """The hooks of one Session. Append to `before` / `after` to register."""

    before: list[BeforeTool] = field(default_factory=list)
    after: list[AfterTool] = field(default_factory=list)


@dataclass(slots=True)
class ToolRun:
    """One call through the hooks. Owned by the Session (`session.tool_runs[call.id]`, the last
    RECORDS_KEPT calls)."""

    requested: ToolCall  # as the model made it
    executed: ToolCall | None  # as the tool received it; None when a hook vetoed it
    raw_result: ToolResult | None  # what the tool returned (None when vetoed)
    result: ToolResult  # what goes back into the history

    @property
    def vetoed(self) -> bool:
        return self.executed is None

    @property
    def arguments_edited(self) -> bool:
        return self.executed is not None and self.executed.arguments != self.requested.arguments

    @property
    def result_edited(self) -> bool:
        return self.raw_result is not None and self.raw_result != self.result


def apply_before(hooks: ToolHooks, call: ToolCall, session: Session) -> ToolCall | None:
    for hook in hooks.before:
        out = hook(call, session)
        if out is None:
            return None
        if not isinstance(out, ToolCall) or out.id != call.id:
            raise TypeError(
                f"before_tool hook {_name(hook)} must return a ToolCall with id {call.id!r} "
                f"(or None to veto), got {out!r:.120}"
            )
        out.check(f"tool call edited by {_name(hook)}")
        call = out
    return call


def apply_after(
    hooks: ToolHooks, call: ToolCall, result: ToolResult, session: Session
) -> ToolResult:
    for hook in hooks.after:
        out = hook(call, result, session)
        if not isinstance(out, ToolResult) or out.tool_call_id != call.id:
            raise TypeError(
                f"after_tool hook {_name(hook)} must return a ToolResult for call {call.id!r}, "
                f"got {out!r:.120}"
            )
        out.check(f"tool result edited by {_name(hook)}")
        result = out
    return result


def as_result(call: ToolCall, value: Any) -> ToolResult:
    """A tool function's return value as a ToolResult: strings and content-part lists as they
    are, anything else as JSON (str() when JSON cannot hold it)."""
    if isinstance(value, ToolResult):
        if value.tool_call_id != call.id:
            raise TypeError(f"tool {call.name} returned a ToolResult for another call")
        return value
    if not isinstance(value, str) and not _content_parts(value):
        try:
            value = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            value = str(value)
    return ToolResult(call.id, value, name=call.name)


def _content_parts(value: Any) -> bool:
    # Only a list of parts is content: a plain list ([2, 3, 5], ["a", "b"]) is data, whose JSON
    # the model reads (it was passed on as content and refused as malformed parts). An empty
    # list is data too: "[]" tells the model more than an empty result.
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, Mapping) and isinstance(p.get("type"), str) for p in value)
    )


def _failed(call: ToolCall, error: Exception) -> ToolResult:
    # A failing tool is news for the model, not a crash of the agent loop.
    return ToolResult(call.id, f"{type(error).__name__}: {error}", is_error=True, name=call.name)


def _vetoed(call: ToolCall) -> ToolResult:
    text = f"The call to {call.name} was blocked by a before_tool hook and did not run."
    return ToolResult(call.id, text, is_error=True, name=call.name)


def run_tool(call: ToolCall, fn: ToolFunction, hooks: ToolHooks, session: Session) -> ToolRun:
    """Before-hooks, `fn(**arguments)`, after-hooks. Exceptions from `fn` become error results;
    exceptions from hooks propagate (a broken hook is a bug of the agent, not of the tool)."""
    executed = apply_before(hooks, call, session)
    if executed is None:
        return ToolRun(call, None, None, _vetoed(call))
    try:
        raw = as_result(executed, fn(**executed.arguments))
    except Exception as e:  # noqa: BLE001 - any tool failure is reported to the model
        raw = _failed(executed, e)
    return ToolRun(call, executed, raw, apply_after(hooks, executed, raw, session))


async def arun_tool(
    call: ToolCall, fn: Callable[..., Awaitable[Any] | Any], hooks: ToolHooks, session: Session
) -> ToolRun:
    """`run_tool` for async tool functions (MCP clients); sync hooks as above."""
    executed = apply_before(hooks, call, session)
    if executed is None:
        return ToolRun(call, None, None, _vetoed(call))
    try:
        value = fn(**executed.arguments)
        if inspect.isawaitable(value):
            value = await value
        raw = as_result(executed, value)
    except Exception as e:  # noqa: BLE001 - any tool failure is reported to the model
        raw = _failed(executed, e)
    return ToolRun(call, executed, raw, apply_after(hooks, executed, raw, session))


def _name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)
