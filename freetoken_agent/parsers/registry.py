"""Which tool-call format a model writes, and the parser for each format."""

from __future__ import annotations

from freetoken_agent.parsers.hermes import HermesParser
from freetoken_agent.parsers.mistral import MistralParser
from freetoken_agent.parsers.qwen3_coder import Qwen3CoderParser
from freetoken_agent.parsers.tool_parser import ToolCallParser

TOOL_FORMATS = ("hermes", "qwen3_coder", "mistral")

# By architecture, for when no chat template is at hand. The template is the better witness:
# Qwen3-Coder checkpoints are `qwen3_moe` yet write the XML form.
_BY_MODEL_TYPE = {
    "qwen2_moe": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_next": "hermes",
    # Qwen3.5 (and 3.6) templates render tool calls in the Qwen3-Coder XML form
    # (`<tool_call>\n<function=...>`), not as Hermes JSON.
    "qwen3_5_moe": "qwen3_coder",
    "mixtral": "mistral",
    # OLMoE's instruct template has no tool syntax of its own. Tools then have to be described
    # in the prompt, and Hermes is the format small open models follow best from instructions
    # (and the one the Qwen family, our main target, shares); parsing it costs nothing when
    # the model never writes `<tool_call>`.
    "olmoe": "hermes",
}


def tool_format_for(model_type: str, chat_template: str | None = None) -> str | None:
    """The tool-call format of a model: from its chat template when given, else its type.

    The template is read for the syntax it renders assistant tool calls with. A template
    without any falls back to the model type; an unknown type has no format (None).
    """
    if chat_template:
        if "<function=" in chat_template:  # checked first: this template also has <tool_call>
            return "qwen3_coder"
        if "<tool_call>" in chat_template:
            return "hermes"
        if "[TOOL_CALLS]" in chat_template:
            return "mistral"
    return _BY_MODEL_TYPE.get(model_type)


def make_tool_parser(tool_format: str, tools: list[dict] | None = None) -> ToolCallParser:
    """A fresh parser for one output in `tool_format` (one of TOOL_FORMATS)."""
    if tool_format == "hermes":
        return HermesParser()
    if tool_format == "qwen3_coder":
        return Qwen3CoderParser(tools)
    if tool_format == "mistral":
        return MistralParser()
    raise ValueError(f"unknown tool format {tool_format!r}; expected one of {TOOL_FORMATS}")
