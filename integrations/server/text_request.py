"""A legacy OpenAI text-completions body (POST /v1/completions), checked into one TextRequest.

The prompt goes to the engine as it is, with no chat template: a string (tokenized by the
model's tokenizer when the run starts: text_run.py) or a list of token ids. A list holding one
prompt (`["text"]`, `[[ids]]`) is that prompt. Several prompts in one request are refused with
a 400 naming `prompt`: serving them as several choices means several engine requests whose
streams interleave and whose failures and disconnects must end all of them, for a form that
autocomplete and scripts do not send (they send one prompt per request, as they can here).

`n` completions of the one prompt are served (choices.py), as chat's. `best_of` > 1 stays
refused: it asks the server to generate best_of and return the n with the highest
log-probability, a choice this server does not make; best_of == n would pick nothing, and `n`
says that already.

The sampling fields and their refusals are the chat route's (`sampling_from`, `check_envelope`);
on top, what only this endpoint has and this server cannot do is refused by name: `suffix`
(fill-in-the-middle), `best_of` > 1; and so are the chat-only fields of other APIs
(foreign_fields.py), since the prompt is not templated. `logprobs` (0..20, OpenAI's legacy
form) and vLLM's `prompt_logprobs` are served (logprobs_request.py).

`echo: true` puts the prompt first in the choice's text and, with `logprobs`, its tokens first
in the choice's logprobs (echo.py). With echo, `max_tokens: 0` asks for the prompt alone (the
engine's prompt-only request: finish_reason "length", no token), the form evaluation harnesses
send to score a text (lm-evaluation-harness's local-completions); without echo it would ask for
nothing and is refused naming max_tokens.

Without max_tokens a completion is 16 tokens long: OpenAI's default for this endpoint, and
vLLM's, which clients of it rely on (an autocomplete that sends none must not generate to the
end of the context). A server started with a default_max_tokens uses that one instead.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.integrations.server.chat_request import (
    body_choice_count,
    check_envelope,
    max_tokens_key,
    sampling_from,
)
from freetoken_agent.integrations.server.errors import BadParam
from freetoken_agent.integrations.server.foreign_fields import check_text_fields
from freetoken_agent.integrations.server.logprobs_request import (
    body_prompt_logprobs,
    text_body_logprobs,
    text_prompt_logprobs,
)
from freetoken_agent.integrations.server.tool_choice import ToolChoice

# Unsupported fields of this endpoint and the values that mean "not used".
_UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
}
_NO_TOOLS = ToolChoice("none")
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's, for this endpoint only


@dataclass(slots=True)
class TextRequest:
    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices: each a run of the prompt (choices.py)
    echo: bool = False  # the prompt goes first in the choice's text (and logprobs)
    # vLLM's `prompt_logprobs` as asked: the choice's `prompt_logprobs` (None: not written).
    # `sampling.prompt_logprobs` may be larger: echo's logprobs ask for the prompt's too.
    prompt_logprobs: int | None = None


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def prompt_from(raw: Any) -> str | list[int]:
    """One prompt: a string or token ids, bare or alone in a list. Emptiness, the vocabulary
    and the context are the engine's checks (when the run starts)."""
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        return raw
    if isinstance(raw, list) and raw and all(isinstance(p, str) or _is_ids(p) for p in raw):
        if len(raw) == 1:
            return raw[0]
        raise BadParam(
            f"prompt holds {len(raw)} prompts; this server completes one prompt per request "
            "(send them as separate requests)",
            "prompt",
        )
    raise BadParam(
        f"prompt must be a string or a list of token ids (integers), got {raw!r:.60}", "prompt"
    )


def parse_text_request(
    body: Any,
    default_max: int = DEFAULT_MAX_TOKENS,
    served: str | None = None,
    names: Collection[str] = (),
) -> TextRequest:
    """The checked request; `model` first, as for chat. `default_max`: max_tokens when the
    body gives none."""
    stream, include_usage = check_envelope(body, served, names)
    if "prompt" not in body:
        raise BadParam("prompt is required: a string or a list of token ids", "prompt")
    prompt = prompt_from(body["prompt"])
    logprobs = text_body_logprobs(body)
    asked = body_prompt_logprobs(body, stream)
    for key, neutral in _UNSUPPORTED.items():
        if key in body and body[key] not in neutral:
            raise BadParam(f"{key}={body[key]!r:.40} is not supported by this server", key)
    check_text_fields(body)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadParam(f"echo must be true or false, got {echo!r:.40}", "echo")
    key = max_tokens_key(body)  # the one sampling_from reads
    # Not False, not 0.0: sampling_from refuses them.
    prompt_only = type(body.get(key)) is int and body[key] == 0
    if prompt_only and not echo:
        raise BadParam(
            f"{key} must be >= 1, got 0 (0, the prompt alone, only with echo: true)", key
        )
    plp = text_prompt_logprobs(asked, logprobs, bool(echo), prompt_only)
    sampling = sampling_from(body, None, _NO_TOOLS, default_max, logprobs, plp, fewest_tokens=0)
    return TextRequest(prompt, sampling, stream, include_usage, body_choice_count(body), bool(echo),
                       asked)  # fmt: skip
