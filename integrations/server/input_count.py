"""How many input tokens a checked turn would take: its history rendered with its tools as the
turn renders it, plus what the turn appends to that prompt (a forced call's opener, or the
`<think>\\n` of a call after the reasoning: turn_run.turn_plan). Anthropic's count_tokens and
the Responses API's input_tokens answer this, so a client knows how full the context is before
it sends a turn (Claude Code's compaction, the OpenAI Agents SDK's)."""

from __future__ import annotations

from typing import Any

from freetoken_agent.integrations.server.bridge import EngineBridge, Turn
from freetoken_agent.integrations.server.chat_request import TurnRequest
from freetoken_agent.integrations.server.turn_run import turn_format, turn_plan


def turn_input_tokens(turn: TurnRequest, state: Any) -> int:
    """The count for `turn` on the server `state`; the template's refusal or a tool schema the
    turn cannot take raise InvalidRequestError (the caller names the fields its API uses).
    Rendering a long history is CPU work: call it off the event loop."""
    bridge = EngineBridge(state.service)
    chat_format = turn_format(turn, state.hub.formats, bridge)
    prompt = chat_format.render(
        turn.messages, tools=turn.tools, anchors=False, continue_final=turn.continue_final
    )
    counted = Turn(state.service)
    _, factory = turn_plan(turn, chat_format, bridge, counted)
    factory(prompt)
    return len(prompt.token_ids) + len(counted.suffix_ids)
