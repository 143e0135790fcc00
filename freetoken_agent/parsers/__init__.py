"""Streaming parsers for model output: reasoning, content and tool calls.

    parser = OutputParser(tool_format_for(model_type, chat_template), starts_in_reasoning, tools)
    for chunk in decoded_chunks:
        for event in parser.feed(chunk): ...
    for event in parser.finish(): ...

Any chunking of the same text gives the same events once neighbouring text deltas are merged
(`coalesce`). One file per format: hermes.py, qwen3_coder.py, mistral.py.
"""

from freetoken_agent.parsers.events import (
    ContentDelta,
    Event,
    ParseWarning,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
    new_call_id,
)
from freetoken_agent.parsers.for_engine import engine_tool_format, parser_factory_for
from freetoken_agent.parsers.hermes import HermesParser
from freetoken_agent.parsers.mistral import MistralParser
from freetoken_agent.parsers.output_parser import OutputParser
from freetoken_agent.parsers.qwen3_coder import Qwen3CoderParser
from freetoken_agent.parsers.reasoning import (
    ReasoningSplitter,
    opens_think_block,
    prompt_opens_reasoning,
)
from freetoken_agent.parsers.registry import TOOL_FORMATS, make_tool_parser, tool_format_for
from freetoken_agent.parsers.schema import convert_value, parameter_schemas
from freetoken_agent.parsers.tool_parser import ToolCallParser

__all__ = [
    "engine_tool_format",
    "parser_factory_for",
    "TOOL_FORMATS",
    "ContentDelta",
    "Event",
    "HermesParser",
    "MistralParser",
    "OutputParser",
    "ParseWarning",
    "Qwen3CoderParser",
    "ReasoningDelta",
    "ReasoningSplitter",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallParser",
    "ToolCallStart",
    "coalesce",
    "convert_value",
    "make_tool_parser",
    "new_call_id",
    "parameter_schemas",
    "opens_think_block",
    "prompt_opens_reasoning",
    "tool_format_for",
]
