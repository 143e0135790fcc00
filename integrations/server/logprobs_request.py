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

from collections.abc import Mapping
from typing import Any

from freetoken_agent.engine.sampling_params import MAX_LOGPROBS
from freetoken_agent.integrations.server.errors import BadParam


def _count(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise BadParam(f"{key} must be an integer in [0, {MAX_LOGPROBS}], got {value!r:.40}", key)
    return value


def chat_body_logprobs(body: Mapping[str, Any]) -> int | None:
    """SamplingParams.logprobs for a chat body: None (not asked), else top_logprobs or 0."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise BadParam(f"logprobs must be true or false, got {asked!r:.40}", "logprobs")
    top = _count(body, "top_logprobs")
    if top and not asked:
        raise BadParam(
            f"top_logprobs={top} needs logprobs: true (it asks for the alternatives of each "
            "token's log-probability)",
            "top_logprobs",
        )
    return (top or 0) if asked else None


def text_body_logprobs(body: Mapping[str, Any]) -> int | None:
    """SamplingParams.logprobs for a text-completions body (None: not asked)."""
    count = _count(body, "logprobs")
    if count is not None and body.get("echo") not in (None, False):
        raise BadParam(
            "echo with logprobs (the prompt's log-probabilities) is not supported by this "
            "server; drop echo to get the completion's",
            "echo",
        )
    return count
