"""Fields of other OpenAI-style APIs, and what this server does with each: honour, or refuse
by name. Unknown fields are ignored (chat_request.py), but these are known to change what the
client gets, so ignoring them would answer another request than the one sent (a `functions`
request answered as if no tool existed, a grammar never applied) without telling anyone.

OpenAI's legacy function calling: `functions` and `function_call` are refused, pointing at
`tools` and `tool_choice`, which say the same thing in the current form.

vLLM's extensions:
- `stop_token_ids`, `repetition_penalty`, `min_p`, `min_tokens` and `thinking_token_budget`
  are honoured (SamplingParams has them; chat_request.sampling_from reads them).
- `chat_template_kwargs`: `enable_thinking` (true or false) renders the prompt with that
  template variable, as ChatFreeToken's `reasoning` does (a ChatFormat per value, hub.py);
  read, with `reasoning_effort`, by thinking_switch.py.
- `include_stop_str_in_output` is honoured (the stop string stays at the end of the text).
- `top_k: -1` is vLLM's "no top-k", as 0 is: taken.
- Refused unless at their neutral values, for what they would change is not built here:
  `use_beam_search` (and `best_of` above 1 on the chat route; the text route refuses it
  itself), `length_penalty`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens` (the
  prompt is never cut here: a prompt too long is refused), `skip_special_tokens` false and
  `spaces_between_special_tokens` false (the text keeps only the parsers' markers),
  `return_tokens_as_token_ids`, `logits_processors`; on the chat route `chat_template` (a
  template sent with the request: the model's own is the one its parsers read) and `echo`
  true (the last message written before the reply).
- `guided_json`, `guided_choice`, `guided_regex`, `guided_grammar`, `structured_outputs`:
  refused. `response_format` json_schema is the way to constrain output here; guided_choice's
  output is the bare string, not JSON, so it is not a JSON-schema enum; the API takes no regex
  or grammar (the engine's `SamplingParams.grammar` is llguidance's Lark syntax, which vLLM's
  grammars are not written in).
- `reasoning_effort` (OpenAI's; LangChain's ChatOpenAI and Open WebUI send it): the thinking
  switch, read by thinking_switch.py.
- `prompt_logprobs` is honoured (0..20; not with a stream: logprobs_request.py), on the
  text completion's choice and on the chat completion's top level, where vLLM puts it.
- `continue_final_message: true` is honoured: the model goes on from the last message, the
  assistant's (a "prefill", continuation.py), and the reply is the continuation alone, as
  vLLM answers. `add_generation_prompt` may be false beside it (vLLM's form, which refuses
  both true); false alone, a prompt that ends after the last message with no turn opened, is
  refused: what the model writes then is no assistant reply the parsers can read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from freetoken_agent.integrations.server.errors import BadParam, body_flag

_CONSTRAIN = "constrain the output with response_format {'type': 'json_schema', ...}"

# field: (its neutral values besides null, why it is refused / what to send instead)
_SAMPLING: dict[str, tuple[tuple, str]] = {
    "guided_json": ((), _CONSTRAIN),
    "guided_choice": ((), _CONSTRAIN + " (an enum schema; the answer is then JSON text)"),
    "guided_regex": ((), "this API takes no regex constraint; " + _CONSTRAIN),
    "guided_grammar": (
        (),
        "this API takes no grammar (the engine's SamplingParams.grammar "
        "is llguidance's Lark syntax, not vLLM's); " + _CONSTRAIN,
    ),
    "structured_outputs": ((), _CONSTRAIN),
    "use_beam_search": ((False,), "beam search is not built; sample with n"),
    "length_penalty": ((1, 1.0), "it weighs beam search, which is not built"),
    "allowed_token_ids": (([],), "it is not built; bias tokens with logit_bias"),
    "bad_words": (([],), "it is not built; bias tokens with logit_bias"),
    "truncate_prompt_tokens": (
        (),
        "a prompt is never cut here (one too long is refused): send a shorter one",
    ),  # fmt: skip
    "skip_special_tokens": ((True,), "the text keeps only the markers the parsers read"),
    "spaces_between_special_tokens": (
        (True,),
        "the text keeps only the markers the parsers read",
    ),  # fmt: skip
    "return_tokens_as_token_ids": ((False,), "logprobs name tokens by their text"),
    "logits_processors": (([],), "custom logits processors are not loaded by this server"),
}
_CHAT: dict[str, tuple[tuple, str]] = {
    "functions": ((), "it is the legacy form of tools: send tools=[{'type': 'function', "
                      "'function': {'name': ..., 'parameters': ...}}]"),
    "function_call": ((), "it is the legacy form of tool_choice: send tool_choice 'auto', "
                          "'none' or {'type': 'function', 'function': {'name': ...}}"),
    "best_of": ((1,), "beam search is not built; sample several choices with n"),
    "chat_template": ((), "the model's own template is the one its parsers read"),
    "echo": ((False,), "the reply is the new text alone"),
}  # fmt: skip
_TEXT: dict[str, tuple[tuple, str]] = {
    "chat_template_kwargs": ((), "a text completion's prompt goes to the model as it is"),
    "reasoning_effort": ((), "a text completion's prompt goes to the model as it is"),
}
_INT64_MAX = 2**63 - 1


def _neutral(value: Any, neutral: tuple) -> bool:
    # `True == 1` in Python: a flag where a number belongs is not the neutral number, and
    # a number where a flag belongs is not the neutral flag.
    if value is None:
        return True
    if isinstance(value, bool):
        return any(n is value for n in neutral)
    return any(not isinstance(n, bool) and n == value for n in neutral)


def _refuse(body: Mapping[str, Any], fields: Mapping[str, tuple[tuple, str]]) -> None:
    for key, (neutral, why) in fields.items():
        if key in body and not _neutral(body[key], neutral):
            # The value matters only where another one would have been accepted.
            named = f"{key}={body[key]!r:.40}" if neutral else key
            raise BadParam(f"{named} is not supported by this server: {why}", key)


def check_sampling_fields(body: Mapping[str, Any]) -> None:
    """vLLM's sampling and guided-decoding fields this server cannot honour (both endpoints)."""
    _refuse(body, _SAMPLING)


def check_chat_fields(body: Mapping[str, Any]) -> None:
    """The legacy function-calling fields and reasoning_effort (chat completions)."""
    _refuse(body, _CHAT)


def check_text_fields(body: Mapping[str, Any]) -> None:
    """Chat-only fields sent to the text completions endpoint, which renders no template."""
    _refuse(body, _TEXT)


def stop_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """vLLM's stop_token_ids: token ids that end the generation (as EOS does)."""
    value = body.get("stop_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT64_MAX for t in value
    ):
        raise BadParam(
            f"stop_token_ids must be a list of token ids (integers >= 0), got {value!r:.40}",
            "stop_token_ids",
        )
    return value


def generation_flags(body: Mapping[str, Any]) -> tuple[bool, bool | None]:
    """(continue_final_message, add_generation_prompt), read and checked together (vLLM
    refuses both true); add_generation_prompt None when absent. /tokenize takes these too."""
    continuing = body_flag(body, "continue_final_message")
    generation = body_flag(body, "add_generation_prompt", None)  # absent: neither way
    if continuing and generation:
        raise BadParam(
            "continue_final_message and add_generation_prompt cannot both be true: the first "
            "goes on with the last message, the second opens a new turn after it",
            "add_generation_prompt",
        )
    return continuing, generation


def continue_final_message(body: Mapping[str, Any]) -> bool:
    """vLLM's continue_final_message (with add_generation_prompt, see the module docstring)."""
    continuing, generation = generation_flags(body)
    if generation is False and not continuing:
        raise BadParam(
            "add_generation_prompt=false is supported only with continue_final_message=true "
            "(the model goes on from the last message, the assistant's)",
            "add_generation_prompt",
        )
    return bool(continuing)
