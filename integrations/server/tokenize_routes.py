"""POST /tokenize and POST /detokenize, in vLLM's form: what a client needs to count tokens and
fit a history to the context before it sends it (an agent trimming old turns, a UI showing how
full the context is), with the server's own tokenizer and chat template.

/tokenize takes either
- `prompt` (a string): encoded as /v1/completions encodes it, with the model's BOS unless
  `add_special_tokens` is false; or
- `messages` (chat messages, checked as /v1/chat/completions checks them), with `tools` and
  `chat_template_kwargs.enable_thinking`: rendered by the chat template as a chat completion's
  prompt is (`add_generation_prompt`, default true, adds the assistant's opening). The template
  writes its special tokens itself, so `add_special_tokens: true` is refused here (vLLM's
  default for messages is false too). `continue_final_message: true` counts the prompt that
  goes on from the last message, the assistant's, as the chat route renders it.
It answers {"count", "max_model_len", "tokens", "token_strs"} (`token_strs`, the tokens'
strings, when `return_token_strs` is true, else null). A count at or past max_model_len is
answered, not refused: the caller asked in order to know.

/detokenize takes `tokens` (ids within the vocabulary) and answers {"prompt": text}, special
tokens included (as vLLM's does: the ids are the caller's, shown whole).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.server.chat_request import check_model, parse_messages
from freetoken_agent.integrations.server.errors import (
    BadParam,
    body_flag,
    error_response,
    invalid_response,
    parse_json_body,
    unexpected_error_response,
)
from freetoken_agent.integrations.server.foreign_fields import generation_flags
from freetoken_agent.integrations.server.heavy_work import heavy
from freetoken_agent.integrations.server.thinking_switch import enable_thinking
from freetoken_agent.integrations.server.tool_choice import parse_tools


def _checked_body(body: Any, state: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadParam(f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body.get("model"), state.model_id, state.model_names)
    return body


def tokenize_ids(body: Any, state: Any) -> list[int]:
    """The token ids a /tokenize body asks for (BadParam naming the field when it is wrong)."""
    body = _checked_body(body, state)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadParam("give exactly one of prompt (a string) or messages (a chat history)")
    tokenizer = state.service.tokenizer
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadParam(f"prompt must be a string, got {prompt!r:.40}", "prompt")
        special = body_flag(body, "add_special_tokens", True)
        return list(tokenizer.encode(prompt, add_special_tokens=special))
    if body_flag(body, "add_special_tokens", False):
        raise BadParam(
            "add_special_tokens must be false with messages: the chat template writes the "
            "special tokens itself",
            "add_special_tokens",
        )
    history = parse_messages(messages)
    tools = parse_tools(body.get("tools"))
    fmt = state.hub.formats.get(enable_thinking(body))
    continuing, generation = generation_flags(body)  # add_generation_prompt false alone: a count
    rendered = fmt.render(
        history,
        tools=tools,
        add_generation_prompt=generation is not False,
        anchors=False,
        continue_final=continuing,
    )
    return rendered.token_ids


def detokenize_text(body: Any, state: Any) -> str:
    body = _checked_body(body, state)
    ids = body.get("tokens")
    vocab = state.service.spec.vocab_size
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
    ):
        raise BadParam(f"tokens must be a list of token ids in [0, {vocab}), got {ids!r:.60}",
                       "tokens")  # fmt: skip
    return state.service.tokenizer.decode(ids, skip_special_tokens=False)


async def _answer(request: Request, work) -> Response:
    """Read the body, run `work(body, state)` off the event loop (a long history's render is
    CPU work), answer its dict or the refusal."""
    state = request.app.state.server
    if state.service.tokenizer is None:
        return error_response(400, "this model has no tokenizer", "invalid_request_error")
    try:
        body = parse_json_body(await request.body())
        return JSONResponse(await heavy(work, body, state))
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - a checker's bug: still an OpenAI error object
        return unexpected_error_response(e, "tokenize")


def _tokenized(body: Any, state: Any) -> dict[str, Any]:
    ids = tokenize_ids(body, state)
    strs = None
    if body_flag(body, "return_token_strs", False):
        strs = [state.service.tokenizer.id_to_token(t) for t in ids]
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


async def tokenize(request: Request) -> Response:
    return await _answer(request, _tokenized)


async def detokenize(request: Request) -> Response:
    return await _answer(request, lambda body, state: {"prompt": detokenize_text(body, state)})


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
