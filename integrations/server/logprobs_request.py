"""The log-probability fields of a request body, checked into `SamplingParams.logprobs` and
`SamplingParams.prompt_logprobs`.

Chat completions: `logprobs` (true/false) and `top_logprobs` (0..20, the alternatives per
token; it needs `logprobs: true` when it asks for any, as OpenAI says; 0 or null alone ask for
nothing and pass, as they did before logprobs were served). Text completions (the legacy
form): `logprobs` is the count itself, 0..20 (OpenAI allows 5, vLLM 20: the engine's limit).

The prompt's log-probabilities (engine/prompt_logprobs.py): vLLM's `prompt_logprobs` (0..20,
both endpoints; the response's `prompt_logprobs`), and the legacy completions' `echo` with
`logprobs`, whose logprobs then start with the prompt's tokens (echo.py). As in vLLM, a stream
cannot carry vLLM's field (its chunks have no place for it): `prompt_logprobs` above 0 with
`stream` is refused, 0 is accepted and asks for nothing (vLLM computes it and sends nothing).
A request that asks for them reuses no cached prefix of its prompt (the engine's rule), so
they cost a whole prefill: they are computed only when some field asks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from freetoken_agent.engine.sampling_params import SamplingParamsError
from freetoken_agent.integrations.openai_logprobs import chat_logprobs_setting, logprob_count
from freetoken_agent.integrations.server.errors import BadParam


def _checked(read: Callable[..., int | None], *args: Any) -> int | None:
    """`read(*args)`, its refusal a BadParam naming the field (openai_logprobs.py checks)."""
    try:
        return read(*args)
    except SamplingParamsError as e:
        raise BadParam(str(e), e.fields[0]) from None


def chat_body_logprobs(body: Mapping[str, Any]) -> int | None:
    """SamplingParams.logprobs for a chat body: None (not asked), else top_logprobs or 0."""
    return _checked(chat_logprobs_setting, body.get("logprobs"), body.get("top_logprobs"))


def text_body_logprobs(body: Mapping[str, Any]) -> int | None:
    """SamplingParams.logprobs for a text-completions body (None: not asked)."""
    return _checked(logprob_count, body.get("logprobs"), "logprobs")


def body_prompt_logprobs(body: Mapping[str, Any], stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` of a body (either endpoint): None when not asked, or asked by
    a stream with 0 (see the module docstring)."""
    count = _checked(logprob_count, body.get("prompt_logprobs"), "prompt_logprobs")
    if count and stream:
        raise BadParam(
            f"prompt_logprobs={count} is not available with stream: true (as in vLLM): send "
            "the request without stream to get them",
            "prompt_logprobs",
        )
    return None if stream else count


def text_prompt_logprobs(
    asked: int | None, logprobs: int | None, echo: bool, prompt_only: bool
) -> int | None:
    """SamplingParams.prompt_logprobs of a text completion: vLLM's field as `asked`; with
    `echo`, at least its `logprobs` (the prompt's entries go first in the choice's logprobs),
    and 0 when it asks for no token (`prompt_only`: an echo of max_tokens 0 is the engine's
    prompt-only request, which takes them)."""
    wanted = [asked]
    if echo:
        wanted += [logprobs, 0 if prompt_only else None]
    counts = [k for k in wanted if k is not None]
    return max(counts) if counts else None
