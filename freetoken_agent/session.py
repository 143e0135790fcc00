"""Session: one agent conversation against an Engine, rendered and diffed turn by turn.

    session = Session(engine, system="...", tools=[...], temperature=0, max_tokens=256)
    for event in session.send(messages): ...         # reasoning / content / tool-call events, Usage
    session.diff(messages)                           # what the next send would reuse

Agents resend their whole history every turn (OpenAI style). The Session renders it (ChatFormat:
token ids + anchors), compares the ids with what it last sent (the previous prompt plus the
tokens generated after it) and submits the new prompt. The engine's radix tree reuses KV up to
the common prefix on its own; the diff says beforehand how much that will be and which anchor
is the deepest at or before the divergence (where recurrent layers would resume), and per-turn
stats record what the engine then reported.

Streaming: by default (`parser_factory="auto"`) `send` yields the events of the model's own
reasoning and tool-call parsers (`parsers.parser_factory_for(engine, session.tools)`: reasoning,
content, tool-call deltas); `parser_factory=None` yields `TextDelta`s of the raw text. Any other
`parser_factory(prompt)` returns an object with `feed(text) -> iterable of events` and
`finish() -> iterable of events`; it gets the Prompt so it can see what the generation prefix
opened (`prompt.generation_prefix`, e.g. "...<think>\\n").

With `SamplingParams.logprobs` set, `send` also yields each generated token's TokenLogprob
(engine/outputs.py), ahead of the events its text makes (whose text may come later: held back
by the parser or the stop strings): one per token, thinking and tool-call tokens included, in
order. Without it none come, so consumers that never ask need not know them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from freetoken_agent.anchor_options import AnchorOptions, is_hybrid
from freetoken_agent.chat_format import Anchor, ChatFormat, Prompt, common_prefix, normalize_tools
from freetoken_agent.engine.kv.checkpoint_mode import CheckpointMode
from freetoken_agent.engine.outputs import EngineClosedError, InvalidRequestError
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.engine.thinking_budget import ThinkingMarkers, reasoning_tokens
from freetoken_agent.hooks import ToolHooks, ToolRun, arun_tool, run_tool
from freetoken_agent.messages import (
    Message,
    SystemMessage,
    ToolCall,
    ToolResult,
    coerce_messages,
)
from freetoken_agent.parsers import parser_factory_for

RECORDS_KEPT = 256  # turn_stats and tool_runs keep the most recent this many


@dataclass(slots=True)
class TextDelta:
    """Generated text, in order; the deltas of a turn add up to its whole text."""

    text: str


@dataclass(slots=True)
class Usage:
    """The last event of a turn. Reuse figures are the engine's own when it could attribute them
    to this request (`exact`), else the Session's prediction from the diff."""

    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    exact: bool = True
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")
    # Of completion_tokens, those of the think block (OpenAI's reasoning_tokens); None for a
    # model without think tokens (or an engine that does not say).
    reasoning_tokens: int | None = None


@dataclass(slots=True)
class HistoryDiff:
    """A new history against what the Session last sent (prompt + generated tokens)."""

    first_divergence: int  # tokens the new prompt shares with the last sent sequence
    anchor: Anchor | None  # deepest anchor of the new prompt with offset <= first_divergence
    reused_tokens: int  # KV the engine can reuse: the shared tokens that it has computed
    prefill_tokens: int  # len(prompt) - reused_tokens
    prompt: Prompt  # the new rendering

    @property
    def resume_offset(self) -> int:
        """The anchor's offset (0 without one): a model with recurrent layers resumes there
        at the latest. Under anchor checkpoints it may resume later, from a deeper checkpoint
        in the shared prefix (the last turn's end, or a decode marker): `reused_tokens`."""
        return self.anchor.offset if self.anchor is not None else 0


class StreamParser(Protocol):
    def feed(self, text: str) -> Iterable[Any]: ...

    def finish(self) -> Iterable[Any]: ...


ParserFactory = Callable[[Prompt], StreamParser]
_UNSET: Any = object()


def _holders(engine: Any) -> tuple[Any, Any, Any]:
    """What a Session may get for its engine and the Engine behind it: the Engine itself, an
    EngineService (`.engine`) or a view of one (`.service.engine`)."""
    return (
        engine,
        getattr(engine, "engine", None),
        getattr(getattr(engine, "service", None), "engine", None),
    )


def _thinking_markers(engine: Any) -> ThinkingMarkers | None:
    """The think-block markers of the Engine behind what a Session got (None: none known)."""
    for holder in _holders(engine):
        markers = getattr(holder, "thinking", None)
        if isinstance(markers, ThinkingMarkers):
            return markers
    return None


def context_limit(engine: Any) -> int | None:
    """The engine's context (`max_model_len`), read through what a Session may get for its
    engine: the Engine, an EngineService (`.engine`) or a view of one (`.service.engine`,
    unless the view says it itself). None when there is none (a duck-typed engine): the
    rendering is then not checked against it, and the engine refuses what does not fit."""
    for holder in _holders(engine):
        value = getattr(holder, "max_model_len", None)  # None too once an Engine is closed
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class Session:
    def __init__(
        self,
        engine: Any,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_format: ChatFormat | None = None,
        *,
        parser_factory: ParserFactory | Literal["auto"] | None = "auto",
        hooks: ToolHooks | None = None,
        **sampling_defaults: Any,
    ) -> None:
        self.engine = engine
        self.system = system
        self.tools = tools  # checked (normalize_tools): a malformed tool fails here
        self.chat_format = chat_format or ChatFormat(engine.tokenizer)
        self.parser_factory = self._model_parser if parser_factory == "auto" else parser_factory
        self.hooks = hooks or ToolHooks()
        self.sampling_defaults = dict(sampling_defaults)
        self.sampling()  # unknown or invalid options fail here, not at the first turn
        # The most recent turns' figures and tool calls (a pooled or long-lived Session, as
        # ChatFreeToken's, the server's and the MCP host's are, must not grow for ever).
        self.turn_stats: deque[dict[str, Any]] = deque(maxlen=RECORDS_KEPT)
        self._turns = 0  # turns recorded so far (turn_stats' "turn")
        self.tool_runs: dict[str, ToolRun] = {}  # by call id, the last RECORDS_KEPT calls
        self.last_prompt: Prompt | None = None  # the last prompt sent, as rendered
        self.last_output_ids: list[int] = []  # tokens generated after it
        # Tokens the engine adapter put between them (the server's forced-call opener: its
        # `prompt_suffix`): the engine saw them, so they are part of what was sent.
        self.last_suffix_ids: list[int] = []
        self.last_output_text = ""
        self._kv_tokens = 0  # leading tokens of the last sent sequence whose KV the engine has
        self._anchor_options = AnchorOptions(engine, self.chat_format.tokenizer)

    @property
    def tools(self) -> list[Mapping[str, Any]] | None:
        """The tools the prompt offers (OpenAI form, or bare {"name", "parameters"})."""
        return self._tools

    @tools.setter
    def tools(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        normalize_tools(tools)  # refuses a malformed list now, not at the next render
        self._tools = list(tools) if tools is not None else None

    # --- rendering and diffing ------------------------------------------------------------
    def sampling(
        self, overrides: SamplingParams | Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """SamplingParams from the session's defaults; a mapping overrides some of them."""
        if isinstance(overrides, SamplingParams):
            return overrides
        if overrides is not None and not isinstance(overrides, Mapping):
            raise InvalidRequestError(
                "sampling must be SamplingParams or a mapping of its fields, got "
                f"{type(overrides).__name__}"
            )
        options = {**self.sampling_defaults, **(overrides or {})}
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise InvalidRequestError(f"unknown sampling option(s): {', '.join(unknown)}")
        try:
            return SamplingParams(**options)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e

    def render(
        self, messages: Sequence[Message | Mapping[str, Any]], *, continue_final: bool = False
    ) -> Prompt:
        """The prompt for `messages`, behind the session's system message and with its tools.
        Anchor message indices count the system message. A prompt that does not fit the
        engine's context raises ContextLengthError here, before its anchors are located.
        `continue_final`: the last message, the assistant's, is left open for the model to go
        on from (ChatFormat.render)."""
        records = coerce_messages(messages)
        if self.system is not None:
            if records and isinstance(records[0], SystemMessage):
                raise InvalidRequestError(
                    "the history starts with a system message but this Session already has "
                    "system=...; give one or the other"
                )
            records = [SystemMessage(self.system), *records]
        limit = context_limit(self.engine)
        return self.chat_format.render(
            records, tools=self.tools, max_model_len=limit, continue_final=continue_final
        )

    @property
    def last_sent(self) -> list[int]:
        """The token sequence the engine last saw: prompt + generated tokens."""
        if self.last_prompt is None:
            return []
        return self.last_prompt.token_ids + self.last_suffix_ids + self.last_output_ids

    def diff(
        self, messages: Sequence[Message | Mapping[str, Any]], *, continue_final: bool = False
    ) -> HistoryDiff:
        prompt = self.render(messages, continue_final=continue_final)
        shared = common_prefix(self.last_sent, prompt.token_ids)
        # The engine computes the logits of a prompt's last token itself, and it never has the
        # KV of the last generated token, hence the two caps. A hybrid model resumes from its
        # deepest checkpoint, which the engine places by its checkpoint mode: at anchors, every
        # N tokens, or nowhere (the Session's guess when the engine's own figures are not to
        # be had: usage of overlapping turns).
        reused = max(0, min(shared, self._kv_tokens, len(prompt) - 1))
        if is_hybrid(self.engine):
            mode = _checkpoint_mode(self.engine)
            if mode.kind == "anchors":
                anchor = prompt.deepest_anchor(reused)
                reused = anchor.offset if anchor is not None else 0
            else:  # positional: the last multiple of N; none: no reuse
                reused = reused // mode.interval * mode.interval if mode.reuses else 0
        return HistoryDiff(
            shared, prompt.deepest_anchor(shared), reused, len(prompt) - reused, prompt
        )

    def _model_parser(self, prompt: Prompt) -> StreamParser:
        """The default parser: the model's own formats, for the session's tools of the moment."""
        return parser_factory_for(self.engine, self.tools)(prompt)

    # --- a turn ---------------------------------------------------------------------------
    def send(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        *,
        parser_factory: ParserFactory | None = _UNSET,
        continue_final: bool = False,
        shares_prompt: bool = False,
    ) -> Iterator[Any]:
        """Render, diff, generate. Yields TextDelta (or the parser's events), then Usage; with
        logprobs asked, each token's TokenLogprob ahead of its text's events.
        `continue_final`: the model goes on from the last message, the assistant's (a
        "prefill"); the events are the continuation's alone. `shares_prompt`: other requests
        send the same prompt beside this one (a request's `n` choices, AnchorOptions).
        Closing the iterator early aborts the request; what was generated so far is kept as
        sent (the engine caches it too)."""
        diff = self.diff(messages, continue_final=continue_final)
        params = self.sampling(sampling)
        factory = self.parser_factory if parser_factory is _UNSET else parser_factory
        parser = factory(diff.prompt) if factory is not None else None
        suffix = list(getattr(self.engine, "prompt_suffix", ()))  # set by the factory, if any
        before = _totals(self.engine)
        out_ids: list[int] = []
        out_text: list[str] = []
        end: dict[str, Any] = {"reason": None, "error": None, "started": False, "stop_string": None,
                               "figures": None}  # fmt: skip
        stream = self.engine.stream(
            diff.prompt.token_ids, params, **self._anchor_options(diff.prompt, shares_prompt)
        )
        try:
            for event in stream:
                end["started"] = True
                if event.token_id is not None:
                    out_ids.append(event.token_id)
                    if event.logprob is not None:  # asked for: ahead of the text it makes
                        yield event.token_logprob()
                if event.finished:
                    end["reason"], end["error"] = event.finish_reason, event.error
                    # getattr: duck-typed engines (tests, wrappers) may send older events
                    end["stop_string"] = getattr(event, "stop_string", None)
                    figures = (getattr(event, "reused_tokens", None),
                               getattr(event, "prefilled_tokens", None))  # fmt: skip
                    end["figures"] = None if None in figures else figures
                if event.text:
                    out_text.append(event.text)
                    yield from parser.feed(event.text) if parser else [TextDelta(event.text)]
            if parser is not None:
                yield from parser.finish()
        finally:
            stream.close()  # aborts the request if we were closed early
            if end["started"]:
                self._record(diff, suffix, out_ids, "".join(out_text), end["reason"] or "abort")
        usage = self._usage(diff, suffix, out_ids, end, before)
        if not end["started"]:  # the engine yielded nothing at all: nothing was sent
            raise RuntimeError("the engine's stream ended without a single event")
        self.turn_stats[-1].update(
            reused_tokens=usage.reused_tokens,
            prefilled_tokens=usage.prefilled_tokens,
            source="engine" if usage.exact else "predicted",
        )
        yield usage

    def _record(
        self, diff: HistoryDiff, suffix: list[int], out_ids: list[int], text: str, reason: str
    ) -> None:
        self.last_prompt = diff.prompt
        self.last_suffix_ids = suffix
        self.last_output_ids = list(out_ids)
        self.last_output_text = text
        # After a clean or aborted finish the engine caches every token it computed: the prompt
        # and all generated tokens but the last. After an error it caches nothing.
        n = len(diff.prompt) + len(suffix) + len(out_ids) - 1
        self._kv_tokens = n if out_ids and reason != "error" else 0
        anchor = diff.anchor
        self._turns += 1
        self.turn_stats.append(
            {
                "turn": self._turns - 1,
                "prompt_tokens": len(diff.prompt),
                "completion_tokens": len(out_ids),
                "first_divergence": diff.first_divergence,
                "anchor": None if anchor is None else dataclasses.asdict(anchor),
                "predicted_reused": diff.reused_tokens,
                "reused_tokens": diff.reused_tokens,
                "prefilled_tokens": diff.prefill_tokens,
                "source": "predicted",
                "finish_reason": reason,
            }
        )

    def _usage(
        self, diff: HistoryDiff, suffix: list[int], out_ids: list[int], end: dict, before
    ) -> Usage:
        reused, prefilled, exact = diff.reused_tokens, diff.prefill_tokens, False
        # The engine's own figures, on the request's final event; else (an engine that sends
        # none) its counters, read again only then: stats() takes the service's lock.
        after = None if end["figures"] is not None else _totals(self.engine)
        if end["figures"] is not None:
            (reused, prefilled), exact = end["figures"], True
        elif before is not None and after is not None and after[2] - before[2] == 1:
            # Exactly one request finished during the turn, so it was ours: the engine's
            # counters moved by our request's figures alone.
            reused, prefilled, exact = after[0] - before[0], after[1] - before[1], True
        markers = _thinking_markers(self.engine)
        sent = diff.prompt.token_ids + suffix
        return Usage(
            len(diff.prompt),
            len(out_ids),
            reused,
            prefilled,
            end["reason"],
            end["error"],
            exact,
            end["stop_string"],
            None if markers is None else reasoning_tokens(sent, out_ids, markers),
        )

    # --- tools ----------------------------------------------------------------------------
    def run_tool(self, call: ToolCall, fn: Callable[..., Any]) -> ToolResult:
        """Run `fn(**call.arguments)` through the session's hooks; the ToolResult to append."""
        run = run_tool(call, fn, self.hooks, self)
        self._keep_run(call.id, run)
        return run.result

    async def arun_tool(
        self, call: ToolCall, fn: Callable[..., Awaitable[Any] | Any]
    ) -> ToolResult:
        run = await arun_tool(call, fn, self.hooks, self)
        self._keep_run(call.id, run)
        return run.result

    def _keep_run(self, call_id: str, run: ToolRun) -> None:
        self.tool_runs.pop(call_id, None)  # a reused id counts as the newest
        self.tool_runs[call_id] = run
        while len(self.tool_runs) > RECORDS_KEPT:
            del self.tool_runs[next(iter(self.tool_runs))]

    def anchor_for(self, tool_call_id: str) -> Anchor | None:
        """The anchor a change to that call's result touches: the tool_output anchor of the
        message carrying it in the last sent prompt (its turn_start if the template gave no
        tool_output anchor). None until a prompt holding the result has been sent."""
        prompt = self.last_prompt
        if prompt is None:
            return None
        for index in range(len(prompt.messages) - 1, -1, -1):
            msg = prompt.messages[index]
            if isinstance(msg, ToolResult) and msg.tool_call_id == tool_call_id:
                return prompt.find("tool_output", index) or prompt.find("turn_start", index)
        return None


def _totals(engine: Any) -> tuple[int, int, int] | None:
    """(reused, prefilled, finished requests) from engine.stats(), when it reports them (not
    once the engine has closed: the turn's usage is then the Session's own estimate)."""
    try:
        stats = engine.stats()
        tokens, requests = stats["tokens"], stats["requests"]
        return int(tokens["reused"]), int(tokens["prefilled"]), int(requests["finished"])
    except (AttributeError, KeyError, TypeError, EngineClosedError):
        return None


def _checkpoint_mode(engine: Any) -> CheckpointMode:
    """The checkpoint mode of the Engine behind `engine` (`_holders`); the engine's default
    where none is found (a duck-typed engine)."""
    for holder in _holders(engine):
        text = getattr(getattr(holder, "config", None), "checkpoints", None)
        if isinstance(text, str):
            return CheckpointMode.parse(text)
    return CheckpointMode.parse("anchors")
