"""FreeToken: an edge-native MoE serving runtime, driven by agents.

Public surface (DESIGN section 9): the Engine, and the agent layer's Session with its structured
history (messages), rendering (ChatFormat: token ids + anchors), tool hooks and the events a
turn yields (ReasoningDelta, ContentDelta, ToolCallStart / ArgsDelta / End, ParseWarning).
`ChatFreeToken` (the LangChain chat model) is exported lazily: importing this package never
imports langchain, which the GPU image does not carry; it is left out of `__all__` so a star
import does not either.
"""

from freetoken_agent.chat_format import Anchor, ChatFormat, Prompt
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.outputs import (
    ContextLengthError,
    EngineClosedError,
    GenerationOutput,
    InvalidRequestError,
    TokenEvent,
)
from freetoken_agent.engine.sampling_params import SamplingParams, SamplingParamsError
from freetoken_agent.hooks import ToolHooks, ToolRun
from freetoken_agent.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    messages_from_openai,
    to_openai_messages,
)
from freetoken_agent.parsers.events import (
    ContentDelta,
    ParseWarning,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken_agent.session import HistoryDiff, Session, TextDelta, Usage

__all__ = [
    "Anchor",
    "AssistantMessage",
    "ChatFormat",
    "ContentDelta",
    "ContextLengthError",
    "Engine",
    "EngineClosedError",
    "GenerationOutput",
    "HistoryDiff",
    "InvalidRequestError",
    "Message",
    "ParseWarning",
    "Prompt",
    "ReasoningDelta",
    "SamplingParams",
    "SamplingParamsError",
    "Session",
    "SystemMessage",
    "TextDelta",
    "TokenEvent",
    "ToolCall",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolHooks",
    "ToolResult",
    "ToolRun",
    "Usage",
    "UserMessage",
    "messages_from_openai",
    "to_openai_messages",
]

_LAZY = {"ChatFreeToken": "freetoken_agent.integrations.langchain"}


def __getattr__(name: str):
    """`from freetoken_agent import ChatFreeToken` imports langchain only then (PEP 562)."""
    if name in _LAZY:
        import importlib

        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:  # the integrations extra is not installed
            raise ModuleNotFoundError(
                f"{name} needs the integrations' packages ({e.name} is missing): "
                'pip install -e ".[integrations]"',
                name=e.name,
            ) from e
        return getattr(module, name)
    raise AttributeError(f"module 'freetoken_agent' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
