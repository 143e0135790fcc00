"""Session events -> LangChain `AIMessageChunk`s while streaming, and the final `AIMessage`.

Chunk conventions (what LangChain's `+` and agents expect):
- content deltas are `content`; reasoning deltas are `additional_kwargs["reasoning_content"]`
  (strings concatenate when chunks are added);
- a tool call is `tool_call_chunks` entries with one stable `index`: the first carries `id` and
  `name` (they would concatenate if repeated), later ones only `args` text, which adds up to
  the call's JSON arguments;
- `usage_metadata`, `response_metadata` (finish_reason, model_name) and `chunk_position="last"`
  are on the last chunk only, so they are counted once;
- with logprobs asked, a chunk's `response_metadata["logprobs"]` holds ChatOpenAI's
  `{"content": [...], "refusal": None}` for the tokens since the chunk before (LangChain
  concatenates the lists as it adds chunks); `invoke`'s message holds them all.

With `output_version="v1"` LangChain turns each chunk's content into content blocks and merges
blocks by their `index`. It numbers blocks that carry no index itself (one more per change of
block type), but keeps a tool_call_chunk's own index: a call's number (0, 1...) then collides
with the reasoning or text block of the same number and the two merge into one garbled block.
So in v1 mode every chunk carries its blocks with explicit indices, counted over the whole
turn (reasoning, text, each call: a new index whenever the kind of block changes), and tool
call chunks use their block's index. The v0 chunks are unchanged (content strings, calls
numbered 0, 1...), as OpenAI-style consumers expect.

A call block the parser rejects after its start went out (ParseWarning with an index) cannot be
taken back from a stream, so its chunks get a closing args piece that makes the JSON malformed
(`_spoil`): the aggregated message then lists it under `invalid_tool_calls` instead of running
a half-parsed call. The block's text is also re-emitted as content, by the parser. `invoke`
reports the same call in `invalid_tool_calls` with the raw block and the parser's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk

from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.integrations.openai_logprobs import Pending, TokenStrings, chat_logprobs
from freetoken_agent.parsers import (
    ContentDelta,
    ParseWarning,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken_agent.session import TextDelta, Usage

PROVIDER = "freetoken"


@dataclass(slots=True)
class _CallState:
    id: str
    name: str
    args: str = ""  # the streamed argument text
    arguments: dict | None = None  # set by ToolCallEnd
    error: str | None = None  # set by a ParseWarning that voided the call
    raw: str = ""


def _spoil(args: str) -> str:
    """A suffix after which `args` is no JSON object, even to LangChain's lenient
    `parse_partial_json`: close an open string, then a bracket that mismatches the innermost
    open one (or any, at depth 0)."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in args:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]" and stack:
            stack.pop()
    suffix = ("n" if escaped else "") + ('"' if in_string else "")
    return suffix + ("}" if stack and stack[-1] == "[" else "]")


class ChunkBuilder:
    """Turns one turn's events into chunks and keeps what the final message needs.
    `blocks`: emit v1 content blocks with explicit indices (see the module docstring)."""

    def __init__(
        self, model_name: str, blocks: bool = False, strings: TokenStrings | None = None
    ) -> None:
        """`strings`: token strings for log-probabilities, when a turn brings them."""
        self.model_name = model_name
        self.blocks = blocks
        self.strings = strings or TokenStrings(None)
        self.logprobs: list[TokenLogprob] = []  # every token's, when the turn asked
        self._pending = Pending()  # those not on a chunk yet
        self._block = -1  # index of the current content block (v1)
        self._kind: Any = None  # its kind: "text", "reasoning" or ("call", index)
        self._call_blocks: dict[int, int] = {}  # call index -> its block index (v1)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, _CallState] = {}
        self.warnings: list[str] = []
        self.usage: Usage | None = None

    def chunk(self, event: Any) -> AIMessageChunk | None:
        """The chunk for one event (None for events that add nothing to the stream). A chunk
        carries the log-probabilities of the tokens since the chunk before, if asked."""
        if isinstance(event, TokenLogprob):
            self.logprobs.append(event)
            self._pending.add(event)
            return None
        piece = self._chunk(event)
        if piece is not None:
            self._attach_logprobs(piece)
        return piece

    def _attach_logprobs(self, piece: AIMessageChunk) -> None:
        """Put the pending log-probabilities on `piece`: ChatOpenAI's response_metadata entry,
        whose `content` lists LangChain concatenates as it adds chunks."""
        entries = self._pending.take()
        if entries:
            logprobs = chat_logprobs(entries, self.strings)
            piece.response_metadata = {**piece.response_metadata, "logprobs": logprobs}

    def _chunk(self, event: Any) -> AIMessageChunk | None:
        if isinstance(event, (ContentDelta, TextDelta)):
            if not event.text:
                return None
            self.content.append(event.text)
            if self.blocks:
                block = {"type": "text", "text": event.text, "index": self._index("text")}
                return AIMessageChunk(content=[block])
            return AIMessageChunk(content=event.text)
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return None
            self.reasoning.append(event.text)
            extra = {"reasoning_content": event.text}
            if self.blocks:
                index = self._index("reasoning")
                block = {"type": "reasoning", "reasoning": event.text, "index": index}
                return AIMessageChunk(content=[block], additional_kwargs=extra)
            return AIMessageChunk(content="", additional_kwargs=extra)
        if isinstance(event, ToolCallStart):
            self.calls[event.index] = _CallState(event.id, event.name)
            self._call_blocks[event.index] = self._index(("call", event.index))
            index = self._call_index(event.index)
            piece = tool_call_chunk(name=event.name, args="", id=event.id, index=index)
            return AIMessageChunk(content=self._empty(), tool_call_chunks=[piece])
        if isinstance(event, ToolCallArgsDelta):
            self.calls[event.index].args += event.text
            return self._args(event.index, event.text)
        if isinstance(event, ToolCallEnd):
            self.calls[event.index].arguments = event.arguments
            return None
        if isinstance(event, ParseWarning):
            self.warnings.append(event.message)
            state = self.calls.get(event.index) if event.index is not None else None
            if state is None:
                return None
            state.error, state.raw = event.message, event.raw_text
            return self._args(event.index, _spoil(state.args))
        if isinstance(event, Usage):
            self.usage = event
            return None
        raise TypeError(f"unexpected session event {type(event).__name__}")

    def _args(self, index: int, text: str) -> AIMessageChunk:
        piece = tool_call_chunk(name=None, args=text, id=None, index=self._call_index(index))
        return AIMessageChunk(content=self._empty(), tool_call_chunks=[piece])

    def _index(self, kind: Any) -> int:
        """The block index for a piece of `kind`: a new block whenever the kind changes."""
        if kind != self._kind:
            self._kind = kind
            self._block += 1
        return self._block

    def _call_index(self, call: int) -> int:
        """A tool_call_chunk's index: the call's number (v0) or its block's index (v1)."""
        return self._call_blocks[call] if self.blocks else call

    def _empty(self) -> str | list:
        return [] if self.blocks else ""

    # --- the end of the turn --------------------------------------------------------------
    @property
    def finish_reason(self) -> str | None:
        reason = self.usage.finish_reason if self.usage else None
        if reason == "stop" and any(c.arguments is not None for c in self.calls.values()):
            return "tool_calls"  # OpenAI's name for a turn that ends in calls
        return reason

    def usage_metadata(self) -> UsageMetadata | None:
        u = self.usage
        if u is None:
            return None
        usage = UsageMetadata(
            input_tokens=u.prompt_tokens,
            output_tokens=u.completion_tokens,
            total_tokens=u.prompt_tokens + u.completion_tokens,
            input_token_details={"cache_read": u.reused_tokens},
        )
        if u.reasoning_tokens is not None:  # of output_tokens, the think block's (ChatOpenAI's)
            usage["output_token_details"] = {"reasoning": u.reasoning_tokens}
        return usage

    def response_metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "finish_reason": self.finish_reason,
            "model_name": self.model_name,
            "model_provider": PROVIDER,
        }
        if self.warnings:
            meta["parse_warnings"] = list(self.warnings)
        return meta

    def last_chunk(self) -> AIMessageChunk:
        piece = AIMessageChunk(
            content=self._empty(),
            usage_metadata=self.usage_metadata(),
            response_metadata=self.response_metadata(),
            chunk_position="last",
        )
        self._attach_logprobs(piece)  # the tokens after the last text (an EOS, held text)
        return piece

    def message(self) -> AIMessage:
        """The whole turn as one AIMessage (what `invoke` returns)."""
        extra = {"reasoning_content": "".join(self.reasoning)} if self.reasoning else {}
        ordered = [self.calls[i] for i in sorted(self.calls)]
        return AIMessage(
            content="".join(self.content),
            additional_kwargs=extra,
            tool_calls=[
                tool_call(name=c.name, args=c.arguments, id=c.id)
                for c in ordered
                if c.arguments is not None
            ],
            invalid_tool_calls=[
                invalid_tool_call(name=c.name, args=c.raw, id=c.id, error=c.error)
                for c in ordered
                if c.arguments is None
            ],
            usage_metadata=self.usage_metadata(),
            response_metadata=self._whole_metadata(),
        )

    def generation_info(self) -> dict[str, Any]:
        """The `generation_info` of the turn's (last) ChatGeneration."""
        return {"finish_reason": self.finish_reason, "model_name": self.model_name}

    def _whole_metadata(self) -> dict[str, Any]:
        meta = self.response_metadata()
        if self.logprobs:  # only when asked: each generated token has one
            meta["logprobs"] = chat_logprobs(self.logprobs, self.strings)
        return meta
