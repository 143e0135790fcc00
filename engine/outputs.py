"""What the engine hands back: per-token events while streaming, a GenerationOutput at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses before running it; the message names the problem."""


def shown_number(value: float) -> str:
    """A number for an error message: an integer too long to print whole (a JSON body may
    hold one of 4,300 digits; formatted as a float, one past 1e308 raises OverflowError) by
    its digits' count."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return f"{value}"


class InvalidSamplingParams(InvalidRequestError):
    """SamplingParams whose fields, set after it was built, no longer pass its checks: the
    SamplingParamsError's text, and `param` the first field it names."""

    def __init__(self, error: ValueError) -> None:
        super().__init__(f"sampling params: {error}")
        fields = getattr(error, "fields", ())
        self.param = fields[0] if fields else None


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the model's context (or the KV pool). `prompt_tokens` and
    `max_prompt_tokens`, where known: what a front-end quotes (Anthropic's "N tokens > M
    maximum")."""

    prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None


class SchemaError(InvalidRequestError):
    """The request's json_schema cannot be compiled into a grammar (engine/constrained.py):
    a type of its own, so a front-end can name the field the schema came from."""


class LogitBiasError(InvalidRequestError):
    """A logit_bias token id outside the model's vocabulary, which only the engine knows:
    `param` names the field for a front-end (the server's 400)."""

    param = "logit_bias"


class ThinkingBudgetError(InvalidRequestError):
    """A thinking budget asked of a model without think-block tokens: `param` names the field
    for a front-end."""

    param = "thinking_token_budget"


class EngineClosedError(RuntimeError):
    """A call to an engine after `Engine.close()` gave its memory back."""


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One token's log-probability under the model's raw distribution (log_softmax of the
    step's logits before temperature, top-k/top-p, a grammar's mask or any other processing:
    engine/token_logprobs.py): a generated token's, for a request with `SamplingParams.logprobs`
    set, or a prompt token's (at the position before it), with `prompt_logprobs` set.

    Every token the request accepted has one, text or not: one whose text is held back (a
    partial UTF-8 character, a possible stop string's start), an EOS or stop id, the tokens
    of a stop string cut from the text. So they line up with `token_ids`, not with the text."""

    token_id: int
    logprob: float
    # The `logprobs` most likely tokens as (id, logprob), most likely first (ties in any
    # order); () when logprobs is 0. The sampled token is among them only if it is that likely.
    top: tuple[tuple[int, float], ...] = ()
    # A prompt token's rank in that distribution (1: the most likely; tokens as likely count
    # ahead of it, as vLLM counts), which vLLM's prompt_logprobs report; None for a generated
    # token (the OpenAI shapes have no rank).
    rank: int | None = None


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
    # With SamplingParams.logprobs set, on every event that carries a token: its raw
    # log-probability and the top alternatives (TokenLogprob says what they are); else None.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    # On a final event whose finish_reason "stop" came from a stop string: that string.
    stop_string: str | None = None
    # With SamplingParams.prompt_logprobs set, on the request's first event (its first token's,
    # or a prompt-only request's only one): one entry per prompt token, the first None (nothing
    # precedes it); else None (engine/prompt_logprobs.py).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # On the request's final event from the engine: its prompt tokens whose KV it reused (a
    # cached prefix) and those it computed, exact whatever else ran beside it; else None.
    reused_tokens: int | None = None
    prefilled_tokens: int | None = None
    # On an event that carries a token: where its text begins in the output's text (the
    # legacy completions' text_offset). Text held back (a character split across tokens, a
    # possible stop string's start) comes out on a later event, so the characters released
    # before this one are not that place; a stop string's cut ends the text sooner.
    text_offset: int | None = None

    def token_logprob(self) -> TokenLogprob | None:
        """This event's token and log-probabilities as one record (None: none carried)."""
        if self.token_id is None or self.logprob is None:
            return None
        return TokenLogprob(self.token_id, self.logprob, self.top_logprobs or ())


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: dict = field(default_factory=dict)  # prompt/completion/reused/prefilled tokens, times
    error: str | None = None
    # One per entry of `token_ids` when SamplingParams.logprobs was set, else None.
    logprobs: list[TokenLogprob] | None = None
    # One per entry of `prompt_ids` when SamplingParams.prompt_logprobs was set (the first
    # None), else None: the first event's (TokenEvent.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None
