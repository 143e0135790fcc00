"""A request's thinking switch: the one template variable the chat templates have for it
(`chat_template_kwargs.enable_thinking`, vLLM's), or OpenAI's reasoning effort read as it
(`reasoning_effort` on the chat route, `reasoning.effort` on the Responses route): "none" turns
thinking off, any other effort on (how long the model thinks is thinking_token_budget's to
cap). Both given and contradicting is refused. Other chat_template_kwargs keys are refused by
name: the template would take them, but what they change (a parser that no longer matches the
output, say) is nothing this server has checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from freetoken_agent.integrations.server.errors import BadParam

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning efforts


def thinking_of_effort(effort: Any, field: str) -> bool | None:
    """OpenAI's reasoning effort as enable_thinking: "none" off, any other effort on; None
    (absent) the template's default. `field` names it in a refusal."""
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise BadParam(f"{field} must be one of {', '.join(EFFORTS)}, got {effort!r:.40}", field)
    return effort != "none"


def enable_thinking(body: Mapping[str, Any]) -> bool | None:
    """chat_template_kwargs.enable_thinking, or what reasoning_effort says (None: the
    template's default)."""
    effort = thinking_of_effort(body.get("reasoning_effort"), "reasoning_effort")
    switch = _template_switch(body)
    if effort is not None and switch is not None and effort != switch:
        raise BadParam(
            f"reasoning_effort {body['reasoning_effort']!r} turns thinking "
            f"{'on' if effort else 'off'}, but chat_template_kwargs.enable_thinking is "
            f"{str(switch).lower()}: send one of them",
            "reasoning_effort",
        )
    return effort if switch is None else switch


def _template_switch(body: Mapping[str, Any]) -> bool | None:
    """chat_template_kwargs.enable_thinking (None: not given)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise BadParam(
            f"chat_template_kwargs must be an object, got {kwargs!r:.40}", "chat_template_kwargs"
        )
    others = sorted(str(k) for k in kwargs if k != "enable_thinking")
    if others:
        raise BadParam(
            f"chat_template_kwargs {others!r:.60} are not supported by this server; it takes "
            "only enable_thinking (true or false)",
            "chat_template_kwargs",
        )
    value = kwargs.get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise BadParam(
            f"chat_template_kwargs.enable_thinking must be true or false, got {value!r:.40}",
            "chat_template_kwargs",
        )
    return value
