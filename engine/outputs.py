"""What the engine hands back: per-token events while streaming, a GenerationOutput at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses before running it; the message names the problem."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the model's context (or the KV pool)."""


class SchemaError(InvalidRequestError):
    """The request's json_schema cannot be compiled into a grammar (engine/constrained.py):
    a type of its own, so a front-end can name the field the schema came from."""


class LogitBiasError(InvalidRequestError):
    """A logit_bias token id outside the model's vocabulary, which only the engine knows:
    `param` names the field for a front-end (the server's 400)."""

    param = "logit_bias"


class EngineClosedError(RuntimeError):
    """A call to an engine after `Engine.close()` gave its memory back."""


@dataclass(slots=True)
class TokenEvent:
    """One sampled token of one request, with the text it completes (possibly "", when the token
    ends inside a multi-byte character or could still be the start of a stop string)."""

    request_id: str
    token_id: int | None  # None for a final event that carries no token (abort, error)
    text: str
    index: int  # position of the token in the output
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: dict = field(default_factory=dict)  # prompt/completion/reused/prefilled tokens, times
    error: str | None = None
