"""The parser factory a Session uses for an engine's model: format from the model's chat
template (or its architecture), reasoning state from each rendered prompt."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from freetoken_agent.parsers.output_parser import OutputParser
from freetoken_agent.parsers.reasoning import opens_think_block
from freetoken_agent.parsers.registry import tool_format_for


def engine_tool_format(engine: Any) -> str | None:
    """The tool-call format of `engine`'s model (an Engine, an EngineService or a view of one:
    its tokenizer and spec): from its tool-use (else default) chat template, or its type."""
    tokenizer = engine.tokenizer
    sources = getattr(tokenizer, "chat_template_sources", {}) if tokenizer else {}
    return tool_format_for(engine.spec.arch, sources.get("tool_use") or sources.get("default"))


def parser_factory_for(
    engine: Any, tools: Sequence[Mapping[str, Any]] | None = None, *, calls: bool = True
) -> Callable[[Any], OutputParser]:
    """`Session(engine, parser_factory=parser_factory_for(engine, tools))`: each turn's
    parser starts inside reasoning when the rendered prompt left `<think>` open. `calls`
    False: nothing is read as a tool call (tool_choice "none"), all non-reasoning text is
    content."""
    tool_format = engine_tool_format(engine) if calls else None
    tokenizer = getattr(engine, "tokenizer", None)
    tool_list = [dict(t) for t in tools] if tools else None

    def factory(prompt: Any) -> OutputParser:
        return OutputParser(tool_format, opens_think_block(prompt, tokenizer), tool_list)

    return factory
