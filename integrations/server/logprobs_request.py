"""The log-probability fields of a request body, checked into `SamplingParams.logprobs`.

Chat completions: `logprobs` (true/false) and `top_logprobs` (0..20, the alternatives per
token; it needs `logprobs: true` when it asks for any, as OpenAI says; 0 or null alone ask for
nothing and pass, as they did before logprobs were served). Text completions (the legacy
form): `logprobs` is the count itself, 0..20 (OpenAI allows 5, vLLM 20: the engine's limit).
`echo` with `logprobs` would ask for the prompt's log-probabilities too; echo is not served
(text_request.py), and its refusal says that this combination is not either: the engine's
score path would compute them, but as a second prefill of the whole prompt, beside the one
generation takes, and without prefix reuse.
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
    count = _checked(logprob_count, body.get("logprobs"), "logprobs")
    if count is not None and body.get("echo") not in (None, False):
        raise BadParam(
            "echo with logprobs (the prompt's log-probabilities) is not supported by this "
            "server; drop echo to get the completion's",
            "echo",
        )
    return count
