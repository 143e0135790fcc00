"""One call of ChatFreeToken, from LangChain's options to the Session's events.

`prepare_call` reads a call's options (bound tools, tool_choice, response_format, the sampling
options, stop, timeout, parallel_tool_calls, continue_final_message) over the model's own, and
refuses a bad one before anything runs; `retried_turn` and `aretried_turn` run the turn, again
while the engine fails before producing any output (ChatFreeToken.max_retries). ChatFreeToken
(langchain.py) is the LangChain side: its fields, binding, and the four entry points that come
here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from langchain_core.messages import AIMessage, BaseMessage

from freetoken_agent.engine.sampling_params import SamplingParams, token_id_key
from freetoken_agent.engine.schema_checks import schema_of_response_format
from freetoken_agent.integrations.constrained_output import output_schema
from freetoken_agent.integrations.langchain_messages import (
    function_tools,
    parse_tool_choice,
    to_history,
    tool_names,
)
from freetoken_agent.integrations.langchain_runtime import (
    Binding,
    ChoiceGroup,
    GenerationError,
    SessionPool,
    arun_turn,
    chat_format,
    run_turn,
)
from freetoken_agent.integrations.openai_logprobs import chat_logprobs_setting
from freetoken_agent.integrations.reasoned_json import (
    answer_grammar,
    bounded_reasoning,
    writes_call_block,
)
from freetoken_agent.integrations.strict_tools import any_strict, strict_grammar
from freetoken_agent.session import Usage

# ChatFreeToken's fields (top_k a call's option only) that are SamplingParams' own, by name.
SAMPLING_OPTIONS = (
    "temperature",
    "max_tokens",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "thinking_token_budget",
)
LOGPROB_OPTIONS = ("logprobs", "top_logprobs")  # ChatOpenAI's names (openai_logprobs.py)
# Options LangChain (or an OpenAI-minded caller) may pass that mean nothing here.
_IGNORED_OPTIONS = ("stream", "strict")


class PreparedCall(NamedTuple):
    """What a call is read into: run_turn's arguments, in its order."""

    binding: Binding
    history: list
    sampling: SamplingParams
    timeout: float | None
    one_call: bool  # not parallel_tool_calls: the turn stops at its first call
    continue_final: bool = False  # the model goes on from the last (assistant) message


def prepare_call(
    messages: list[BaseMessage],
    stop: str | Sequence[str] | None,
    kwargs: dict[str, Any],
    *,
    defaults: dict[str, Any],
    timeout: float | None,
    service: Callable[[], Any],
    thinking: bool | None = None,
) -> PreparedCall:
    """Binding, history, sampling, timeout and whether one call at most may be made (not
    parallel_tool_calls) of a call; every input problem raises here.

    `stop` is the call's, else the model's; `defaults` (by SAMPLING_OPTIONS and
    LOGPROB_OPTIONS) and `timeout` are the model's, which the call's options override;
    `service` gives the model's EngineService, asked for only to compile strict tools'
    grammar and for a JSON answer's format; `thinking`: the model's `reasoning` (the
    template's enable_thinking), which says whether an answer under that format begins with
    reasoning, where the JSON answer comes after it (reasoned_json.py)."""
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    specs = function_tools(tools) if tools else []
    mode, allowed = parse_tool_choice(kwargs.pop("tool_choice", None), tool_names(specs))
    fmt = kwargs.pop("response_format", None)
    schema = schema_of_response_format(fmt) if fmt is not None else None
    if schema is not None and mode != "required":
        mode = "json_or_call" if mode == "auto" and specs else "json"
    options = {k: kwargs.pop(k, defaults.get(k)) for k in SAMPLING_OPTIONS}
    options = {k: v for k, v in options.items() if v is not None}
    if "max_tokens" not in options:
        # None is ChatOpenAI's "no limit": the reply may run to the context's end, where the
        # engine ends it (the server's default too); SamplingParams' own 256 cut replies short.
        options["max_tokens"] = service().engine.max_model_len
    if "logit_bias" in options:
        options["logit_bias"] = bias_by_id(options["logit_bias"])
    asked, top = (kwargs.pop(k, defaults.get(k)) for k in LOGPROB_OPTIONS)
    options["logprobs"] = chat_logprobs_setting(asked, top)
    timeout = kwargs.pop("timeout", timeout)
    parallel = kwargs.pop("parallel_tool_calls", None)
    if parallel is not None and not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls must be True or False, got {parallel!r:.40}")
    continuing = kwargs.pop("continue_final_message", defaults.get("continue_final_message"))
    if continuing is not None and not isinstance(continuing, bool):
        raise ValueError(f"continue_final_message must be True or False, got {continuing!r:.40}")
    for key in _IGNORED_OPTIONS:
        kwargs.pop(key, None)
    if kwargs:
        raise ValueError(f"unknown option(s) for ChatFreeToken: {', '.join(sorted(kwargs))}")
    stops = stop_list(stop)
    # Rendered under "none" too, as the server does (integrations/server/tool_choice.py): the
    # history keeps rendering the same, so an agent's last "none" turn reuses its KV.
    shown = tuple(specs) if specs else None
    by_name = {t["function"]["name"]: t for t in specs}
    constraint = output_schema(mode, [by_name[n] for n in allowed] or specs, schema)
    grammar = None
    if mode == "auto" and constraint is None and any_strict(specs):
        grammar = strict_grammar(service(), specs)
    reasoned = False
    # After the reasoning where the model thinks first: the answer's JSON, a call's or the
    # answer's, or a forced call (in the call block a Hermes-format model writes) where a
    # thinking budget bounds the reasoning (reasoned_json.bounded_reasoning).
    budget = options.get("thinking_token_budget")
    if (
        constraint is not None
        and not continuing
        and (mode != "required" or bounded_reasoning(budget, service()))
    ):
        block = writes_call_block(mode == "required", service())
        fmt = chat_format(service(), thinking)
        grammar = answer_grammar(fmt, shown, service(), constraint, block)
        reasoned = grammar is not None
    if reasoned:
        constraint = None  # held by the grammar, after the reasoning
    key = json.dumps([shown, mode, allowed, schema, reasoned, thinking], sort_keys=True,
                     default=str)  # fmt: skip
    binding = Binding(key, shown, mode, allowed, schema, reasoned, thinking)
    sampling = SamplingParams(
        **options,
        stop=stops,
        json_schema=constraint,
        grammar=grammar,
        grammar_holds_answer=reasoned,
    )
    if continuing:
        _check_continuable(messages, constraint is not None)
    history = to_history(messages)
    return PreparedCall(binding, history, sampling, timeout, parallel is False, bool(continuing))


def _check_continuable(messages: list[BaseMessage], constrained: bool) -> None:
    """continue_final_message: the last message is an AIMessage of text (the prefill), and no
    schema holds the reply, which it would match from its start (the prefill's)."""
    last = messages[-1] if messages else None
    if not isinstance(last, AIMessage) or last.tool_calls:
        what = "has tool calls" if isinstance(last, AIMessage) else "is not an AIMessage"
        raise ValueError(
            f"continue_final_message=True but the last message {what}: only an AIMessage of "
            "text can be continued"
        )
    if constrained:
        raise ValueError(
            "continue_final_message=True cannot be used with a response_format, a structured "
            "output or a forced tool call: their schema is matched from the reply's start, "
            "which the continued message has already written"
        )


def bias_by_id(bias: Any) -> Any:
    """A logit_bias with its token ids as ints: the OpenAI SDK types its keys as strings of
    digits (as they come in JSON), which the model's field converts (pydantic) and a call's
    option must too. Anything else is left for SamplingParams to refuse by name."""
    if not isinstance(bias, Mapping):
        return bias
    return {k if token_id_key(k) is None else token_id_key(k): v for k, v in bias.items()}


def retried_turn(
    pool: SessionPool, call: PreparedCall, max_retries: int, group: ChoiceGroup | None = None
) -> Iterator[Any]:
    """Session events of one call, retried while the engine fails before any output; `group`:
    the choices' group the call belongs to (langchain_choices.py)."""
    for attempt in itertools.count():
        produced = False
        turn = run_turn(pool, *call, group=group)
        with contextlib.closing(turn):
            for event in turn:
                if isinstance(event, Usage) and _failed(event):
                    if not produced and attempt < max_retries:
                        break
                    raise _failure(event)
                produced = True
                yield event
            else:
                return


async def aretried_turn(
    pool: SessionPool, call: PreparedCall, max_retries: int, group: ChoiceGroup | None = None
) -> AsyncIterator[Any]:
    """The same on an asyncio loop; closing it aborts the engine request if still running."""
    for attempt in itertools.count():
        produced = False
        turn = arun_turn(pool, *call, group=group)
        try:
            async for event in turn:
                if isinstance(event, Usage) and _failed(event):
                    if not produced and attempt < max_retries:
                        break
                    raise _failure(event)
                produced = True
                yield event
            else:
                return
        finally:
            await turn.aclose()  # cancels (aborts) the engine request if still running


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    """Stop sequences as a list. A str is one sequence (as OpenAI and SamplingParams read it),
    not its characters: LangChain's `stop: list[str]` is not enforced, and callers pass one."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _failed(usage: Usage) -> bool:
    return usage.finish_reason in ("error", "abort")


def _failure(usage: Usage) -> GenerationError:
    if usage.finish_reason == "abort":
        return GenerationError("the engine aborted the generation (was the service closed?)")
    return GenerationError(f"the generation failed in the engine: {usage.error}")
