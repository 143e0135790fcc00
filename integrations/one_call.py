"""FirstCallOnly: `parallel_tool_calls: false`, OpenAI's promise of at most one tool call.

A chat template has no switch for "one call", so the model may well write two; the promise is
kept on its output instead. The parser's events pass until the first ToolCallEnd (the first
call that is complete and well formed) and at that event `stop` ends the engine request, so
the model does not go on writing a second call nobody will see. Whatever comes after it is
dropped: the rest of that parser chunk, the tokens the engine produced before the abort
landed, the parser's `finish`. A call the parser voids (ParseWarning) never had a ToolCallEnd,
so it does not count: the model may still write a good one after it.

The turn then ends as one that made its call: the abort it caused (or a max_tokens end that
came first) is reported as "stop", which both callers turn into OpenAI's "tool_calls"; an
engine error stays an error. The Usage still counts every token the engine generated.

One mechanism for both ways in: the server's turns (turn_run.py, `stop` cancels the Turn) and
ChatFreeToken (langchain.py, `stop` cancels the call's engine request). Both run the same
Session events through it, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from freetoken_agent.parsers import ToolCallEnd
from freetoken_agent.session import Usage


class FirstCallOnly:
    def __init__(self, stop: Callable[[], None]) -> None:
        self._stop = stop  # aborts the engine request; must not block (called mid-stream)
        self.stopped = False

    def __call__(self, event: Any) -> Any | None:
        """The event to pass on, or None to drop it."""
        if isinstance(event, Usage):
            if self.stopped and event.finish_reason != "error":
                return dataclasses.replace(event, finish_reason="stop")
            return event
        if self.stopped:
            return None
        if isinstance(event, ToolCallEnd):
            self.stopped = True
            self._stop()
        return event
