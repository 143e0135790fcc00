"""FreeToken: an edge-native MoE serving runtime, driven by agents.

Public surface (DESIGN section 9): the Engine, and the agent layer's Session with its structured
history (messages), rendering (ChatFormat: token ids + anchors) and tool hooks. ChatFreeToken
arrives with the integrations.
"""

from freetoken_agent.chat_format import Anchor, ChatFormat, Prompt
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.outputs import (
    ContextLengthError,
    GenerationOutput,
    InvalidRequestError,
    TokenEvent,
)
from freetoken_agent.engine.sampling_params import SamplingParams
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
from freetoken_agent.session import HistoryDiff, Session, TextDelta, Usage

__all__ = [
    "Anchor",
    "AssistantMessage",
    "ChatFormat",
    "ContextLengthError",
    "Engine",
    "GenerationOutput",
    "HistoryDiff",
    "InvalidRequestError",
    "Message",
    "Prompt",
    "SamplingParams",
    "Session",
    "SystemMessage",
    "TextDelta",
    "TokenEvent",
    "ToolCall",
    "ToolHooks",
    "ToolResult",
    "ToolRun",
    "Usage",
    "UserMessage",
    "messages_from_openai",
    "to_openai_messages",
]
