"""Tools and `tool_choice`: which parser reads a turn, and how a forced call is generated.

- "auto" (the default with tools): the model decides; the model's own tool-call parser reads it.
- "none": tools stay in the prompt (the history keeps rendering the same, so its KV is reused),
  but nothing is parsed as a call: all non-reasoning text is content.
- "required" or {"type": "function", "function": {"name": ...}}: a call is forced by constrained
  decoding. A call that comes first renders the template with thinking off (turn_run.py
  `turn_format`: the template's own closed block where it has the switch, as ChatFreeToken
  renders it). The prompt is extended with what closes a think block still open and opens a call
  (`</think>\\n\\n` when the template left `<think>` open, then `<tool_call>\\n` for Hermes-style
  models), and the output is constrained to `{"name": ..., "arguments": {...}}` valid against
  the tool's schema (`tool_call_schema`; "required" allows any of the tools). The model thus
  writes the call where and how it was trained to. Models of other formats get the same JSON
  without an opener (vLLM's way for named calls). Either way the parser sees the call wrapped
  as a Hermes block, so forced calls stream as the same tool-call events as free ones.
  Where the model thinks first (below: `reasoned_answer`) and a thinking budget bounds the
  reasoning (a forced call must come: unbounded reasoning could reach max_tokens first), the
  call follows the reasoning instead, as vLLM applies a forced call's structured output after
  it: the prompt keeps the block open, and the grammar is the reasoning, `</think>`, then the
  call, inside the
  `<tool_call>` block the grammar writes for Hermes-format models (their own parser reads it),
  the JSON alone for others (read by JsonOrCallParser).
- "auto" with a response_format of JSON (json_schema or json_object), as the OpenAI Agents SDK
  sends on every turn: the output is constrained to one call of one of the tools or the answer
  (`call_or_answer_schema`, ChatFreeToken's json_or_call schema), read by JsonOrCallParser
  (integrations/constrained_output.py), after the reasoning where the model thinks first (as
  below). The answer is sent whole, as one content delta, once the output has ended, not
  streamed: only the whole text tells a call from an answer (a json_object answer may be
  call-shaped), and content sent cannot be taken back. The reasoning streams.
  With "none" the response_format alone constrains the output; with a forced call it is refused.
- A response_format of JSON (a call or the answer, or the answer alone), or a forced call,
  where the answer begins with reasoning (the template opens a think block, or a hybrid one
  like Qwen3's is in thinking mode and the prompt is given the `<think>\\n` its model would
  write): the model reasons, then writes JSON valid against the schema (`reasoned_answer`,
  integrations/reasoned_json.py), as vLLM and SGLang apply structured output only after the
  reasoning. Elsewhere the schema holds from the first token and an open think block is
  closed in the prompt.
- "auto" with a tool marked `strict: true` (the OpenAI Agents SDK's function tools are), no
  response_format: text stays free, and every call the model writes keeps to a known tool and
  a strict tool's arguments to its schema (integrations/strict_tools.py). Models that write
  Hermes, XML (Qwen3-Coder, Qwen3.5) or Mistral (`[TOOL_CALLS]`: the list, or name and
  `[ARGS]` for v11+ tokenizers) calls; a model of no known format is read unconstrained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from freetoken_agent.engine.constrained import (
    schema_refusal,
    tool_arguments_schema,
    tool_call_schema,
)
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.engine.schema_checks import schema_of_response_format, schema_problems
from freetoken_agent.integrations.constrained_output import (
    JsonOrCallParser,
    WrappedBlock,
    inline,
    is_json,
    output_schema,
    rooted,
)
from freetoken_agent.integrations.reasoned_json import (
    answer_grammar,
    bounded_reasoning,
    writes_call_block,
)
from freetoken_agent.integrations.server.bridge import Turn
from freetoken_agent.integrations.server.errors import BadParam, check_nesting
from freetoken_agent.integrations.strict_tools import (
    any_strict,
    call_schema,
    is_strict,
    strict_grammar,
)
from freetoken_agent.parsers import OutputParser, engine_tool_format, opens_think_block
from freetoken_agent.parsers.reasoning import CLOSE as THINK_CLOSE
from freetoken_agent.parsers.reasoning import OPEN as THINK_OPEN
from freetoken_agent.parsers.reasoning import added_think_ids

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


@dataclass(slots=True, frozen=True)
class ToolChoice:
    mode: str  # auto | none | required | named
    name: str | None = None  # the function, when mode is "named"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def parse_tools(raw: Any, param: str = "tools") -> list[dict] | None:
    """OpenAI tools, checked: each a function with a unique non-empty name and, if given,
    an object schema for its parameters."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadParam(f"{param} must be a list of tools, got {type(raw).__name__}", param)
    seen: set[str] = set()
    tools = []
    for i, tool in enumerate(raw):
        where = f"{param}[{i}]"
        check_nesting(tool, where)  # first: rendering walks the schema recursively
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise BadParam(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise BadParam(f"{where}.function must be an object with a name", where)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise BadParam(f"{where}.function.name must be a non-empty string", where)
        if name in seen:
            raise BadParam(f"{where}: tool name {name!r} appears twice", where)
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise BadParam(f"{where}.function.parameters must be a JSON schema object", where)
        # OpenAI's own rule: a function takes an object of named arguments.
        if params is not None and params.get("type", "object") != "object":
            raise BadParam(
                f"{where}.function.parameters must be an object schema (type 'object'), "
                f"got type {params.get('type')!r:.40}",
                where,
            )
        if params is not None and not isinstance(params.get("properties", {}), Mapping):
            raise BadParam(f"{where}.function.parameters.properties must be an object", where)
        for key in ("description",):
            if fn.get(key) is not None and not isinstance(fn[key], str):
                raise BadParam(f"{where}.function.{key} must be a string", where)
        # "yes" would read as not strict (strict_tools.is_strict takes true only): a client
        # that asked for its arguments checked must not silently get them unchecked.
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise BadParam(f"{where}.function.strict must be true or false, "
                           f"got {fn['strict']!r:.40}", where)  # fmt: skip
        tools.append({"type": "function", "function": dict(fn)})
    return tools or None


def parse_tool_choice(raw: Any, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    names = [t["function"]["name"] for t in tools or []]
    if raw is None:
        return ToolChoice("auto" if names else "none")
    if raw in ("auto", "none", "required"):
        if raw == "required" and not names:
            raise BadParam("tool_choice 'required' needs at least one tool in tools", "tool_choice")
        return ToolChoice(raw)
    name = None
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise BadParam(
            "tool_choice must be 'auto', 'none', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {raw!r:.80}",
            "tool_choice",
        )
    if name not in names:
        raise BadParam(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(names) or 'none given'})",
            "tool_choice",
        )
    return ToolChoice("named", name)


def forced_schema(choice: ToolChoice, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON schema of the call a forced turn must write: closed, as ChatFreeToken's and a
    call-or-answer's (constrained_output.output_schema): an object schema that does not say
    whether other keys may come gets none, so the arguments hold only the tool's parameters (a
    model could otherwise add keys until max_tokens, which the random demo model does)."""
    chosen = [t for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name]
    try:
        return output_schema("required", [dict(t) for t in chosen], None)
    except (KeyError, ValueError, TypeError, AttributeError):
        # A $ref that resolves nowhere (closing inlines them): as given, for the grammar
        # compiler to refuse by name, the 400 naming `tools` (turn_run.py).
        schemas = [tool_call_schema(t) for t in chosen]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def call_or_answer_schema(tools: Sequence[Mapping[str, Any]], fmt: Any) -> dict[str, Any] | None:
    """The schema of "one call of one of `tools`, or the answer `fmt` asks for" (None: `fmt` is
    plain text, which leaves the turn free). The answer's schema and each tool's parameters are
    checked on their own first, so a refusal names the field at fault: the grammar and the
    $ref inlining would otherwise only see the combined schema."""
    try:
        answer = schema_of_response_format(fmt)
    except ValueError as e:
        raise BadParam(str(e), "response_format") from None
    if answer is None:
        return None
    parts = [("response_format", answer)]
    parts += [(f"tools[{i}]", tool_arguments_schema(t)) for i, t in enumerate(tools)]
    for field, schema in parts:
        problems = schema_problems(schema)
        if not problems:
            try:
                inline(schema)  # the combined schema nests it, so its $refs must resolve
                continue
            except (KeyError, ValueError, TypeError, AttributeError) as e:
                problems = [f"a $ref in it cannot be resolved ({type(e).__name__}: {e})"]
        raise BadParam(f"{field}: " + "; ".join(problems), field)
    return output_schema("json_or_call", [dict(t) for t in tools], answer)


class ForcedCallParser:
    """The model's output of a forced call (the JSON alone) read as a whole Hermes block.

    The opener and the closer are the server's text, not the model's: when the parser voids the
    block they wrap (the JSON cut by max_tokens), the content it gives back, and the warning's
    text, are only what the model wrote, as the client would otherwise see markup nobody wrote.
    The closer is fed only after a whole JSON body: fed after one cut inside a string, its
    newline broke the string there, the block closed at a `</tool_call>` the string held, and
    the closer was left over as content."""

    def __init__(self, inner: OutputParser, lead: str) -> None:
        self._inner = inner
        self._lead = lead  # fed before the first generated text; ends with CALL_OPEN
        self._block = WrappedBlock(CALL_OPEN)  # the block the lead opened
        self._body: list[str] = []  # what the model wrote

    def feed(self, text: str) -> list:
        lead, self._lead = self._lead, ""
        self._body.append(text)
        return self._block.as_written(self._inner.feed(lead + text), "")

    def finish(self) -> list:
        lead, self._lead = self._lead, ""
        closer = CALL_CLOSE if is_json("".join(self._body)) else ""
        closed = self._block.as_written(self._inner.feed(lead + closer), closer)
        return closed + self._block.as_written(self._inner.finish(), "")


ParserFactory = Callable[[Any], Any]


def turn_sampling(
    choice: ToolChoice, tools: list[dict] | None, engine: Any, sampling: SamplingParams
) -> SamplingParams:
    """`sampling` with the strict tools' grammar when this turn takes one: tool_choice auto, a
    strict tool among `tools`, no other constraint, and a model writing Hermes, XML or Mistral
    calls."""
    if choice.mode != "auto" or not any_strict(tools) or sampling.constraint is not None:
        return sampling
    writes = engine_tool_format(engine) if engine.tokenizer is not None else None
    json_calls = writes in ("hermes", "mistral")  # the formats whose grammar holds JSON calls
    for i, tool in enumerate(tools or []):  # a schema the grammar cannot take: the client's 400
        if is_strict(tool):
            field = f"tools[{i}].function.parameters"
            defs: dict = {}
            try:
                call = rooted([call_schema(tool, defs)], defs)
            except (KeyError, ValueError, TypeError, AttributeError) as e:
                raise BadParam(
                    f"{field}: a strict tool's schema cannot be used ({type(e).__name__}: {e})",
                    field,
                ) from None
            # Judged alone: compiled within the whole grammar, the refusal named no tool and
            # listed the grammar's text, every tool's schema in it. Where that JSON call is
            # what the grammar compiles (Hermes, Mistral): the XML grammar holds each
            # parameter instead, and a tool it cannot hold so is left unconstrained.
            problem = schema_refusal(call) if json_calls else None
            if problem is not None:
                raise BadParam(f"{field}: a strict tool's schema cannot be used: {problem}", field)
    grammar = strict_grammar(engine, tools or [])
    return sampling if grammar is None else dataclasses.replace(sampling, grammar=grammar)


def reasoned_answer(
    choice: ToolChoice,
    tools: list[dict] | None,
    sampling: SamplingParams,
    call_or_answer: bool,
    chat_format: Any,
    engine: Any,
) -> str | None:
    """The grammar of reasoning, then the JSON (reasoned_json.py), for a turn whose output is
    held to a schema (the answer's, `call_or_answer`'s "a call or the answer", or a forced
    call's, inside the call block of a Hermes-format model), where an answer under
    `chat_format` begins with reasoning (the tools are rendered as the turn renders them); None
    otherwise, and for a forced call whose reasoning no thinking budget bounds
    (reasoned_json.bounded_reasoning). `engine`: the bridge."""
    if not reasons_before_answer(choice, tools, sampling, chat_format, engine):
        return None
    block = writes_call_block(choice.forced, engine)
    return answer_grammar(chat_format, tools, engine.service, sampling.json_schema, block)


def reasons_before_answer(
    choice: ToolChoice,
    tools: list[dict] | None,
    sampling: SamplingParams,
    chat_format: Any,
    engine: Any,
) -> bool:
    """Whether `reasoned_answer` holds the turn's schema after the reasoning, decided without
    building its grammar (turn_run.turn_format asks before the turn is planned): as
    answer_grammar, the format reasons first and the tokenizer has think tokens of its own."""
    if sampling.json_schema is None:
        return False
    if choice.forced and not bounded_reasoning(sampling.thinking_token_budget, engine.service):
        return False
    return (
        chat_format.reasons_first(tools) and added_think_ids(engine.service.tokenizer) is not None
    )


def parser_factory(
    choice: ToolChoice,
    tools: list[dict] | None,
    engine: Any,
    turn: Turn,
    call_or_answer: bool = False,
    json_answer: bool = False,
    reasoned: bool = False,
) -> ParserFactory:
    """The Session's parser factory for one turn. For a constrained turn (a forced call, a call
    or the answer, a JSON answer) it also sets the Turn's prompt suffix: Session.send calls the
    factory with the rendered prompt just before it streams, and the bridge appends
    `turn.suffix_ids` to that prompt.
    `json_answer`: the output is held to a JSON schema from its first token (a response_format
    without tools to call): a think block the template left open is closed in the prompt
    too, or the JSON would be read as reasoning and the answer's content left empty; unless
    `reasoned`: the grammar lets the model reason first (`reasoned_answer`: a JSON answer, a
    call or the answer, or a forced call under a thinking budget), so the block stays open, or
    is opened where the model would open it itself (a hybrid template in thinking mode)."""
    tokenizer = engine.tokenizer
    tool_format = engine_tool_format(engine)

    def factory(prompt: Any) -> Any:
        thinking = opens_think_block(prompt, tokenizer)
        if reasoned:  # the block stays open (or is opened, as the model would): then JSON
            turn.suffix_ids = [] if thinking else tokenizer.encode(THINK_OPEN + "\n")
            if choice.forced or call_or_answer:  # the call's JSON (or the answer's)
                block = writes_call_block(choice.forced, engine)  # the grammar writes it
                return JsonOrCallParser(True, tools or [], in_block=block)
            return OutputParser(tool_format if choice.mode == "auto" else None, True, tools)
        if call_or_answer:
            # The grammar starts at the first token, which must be the JSON's: a think block
            # the template left open is closed in the prompt, and the parser starts past it.
            turn.suffix_ids = tokenizer.encode(THINK_CLOSE + "\n\n") if thinking else []
            return JsonOrCallParser(False, tools or [])
        if not choice.forced:
            fmt = tool_format if choice.mode == "auto" else None
            if json_answer and thinking:
                turn.suffix_ids = tokenizer.encode(THINK_CLOSE + "\n\n")
                return OutputParser(fmt, False, tools)
            return OutputParser(fmt, thinking, tools)
        close = THINK_CLOSE + "\n\n" if thinking else ""
        native = tool_format == "hermes"
        sent = close + (CALL_OPEN if native else "")
        turn.suffix_ids = tokenizer.encode(sent) if sent else []
        # The suffix is prompt, not output: the parser reads it to know where it stands.
        return ForcedCallParser(OutputParser("hermes", thinking, tools), close + CALL_OPEN)

    return factory
