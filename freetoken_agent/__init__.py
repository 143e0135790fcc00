"""FreeToken: an edge-native MoE serving runtime, driven by agents.

Public surface (DESIGN section 9). The agent layer (Session, ChatFreeToken) arrives with the
agent issue; the engine is usable now.
"""

from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.outputs import (
    ContextLengthError,
    GenerationOutput,
    InvalidRequestError,
    TokenEvent,
)
from freetoken_agent.engine.sampling_params import SamplingParams

__all__ = [
    "ContextLengthError",
    "Engine",
    "GenerationOutput",
    "InvalidRequestError",
    "SamplingParams",
    "TokenEvent",
]
