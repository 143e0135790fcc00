"""OpenAI completion objects from a run's events: chunks while streaming, or one whole.

`CompletionFormat` writes chat completions (from a TurnRun's parser events), and
`TextCompletionFormat` legacy text completions (from a TextRun's text pieces): `object`
"text_completion", `choices[i].text`, whole or as streamed deltas, under a `cmpl-` id. Both
end a stream alike: each choice's chunk with its finish_reason, then the usage chunk if asked
for.

A request with n > 1 has n choices (choices.py), indexed 0..n-1: a whole completion lists
them in order; streamed, each chunk holds one choice's delta under its `index`, chunks of
different choices interleave, and every choice has a state of its own here (its tool calls'
numbers, its log-probabilities waiting for a chunk, its text offset), as if it were alone.

Chat deltas follow OpenAI's shapes exactly, since clients accumulate them by field:
`role` in the first chunk, `content` and `reasoning_content` text pieces, and `tool_calls`
entries keyed by `index`. A final chunk has an empty delta and the `finish_reason`; the usage
chunk (`choices: []`) follows when the client asked for it with `stream_options.include_usage`.

A tool call goes out whole, in one delta (`id`, `type`, `function.name` and the complete
`function.arguments`, as the non-streamed reply writes them), once the parser has closed it
(ToolCallEnd). Its start and argument pieces are not streamed: the parser may still void the
block (never closed, cut by max_tokens, bad JSON), and a delta cannot be taken back; an agent
would run a call the non-streamed reply says was not made. A voided block's text arrives as
content instead, as in that reply. Calls are numbered 0, 1... in the order they complete, as
the reply lists them (the parser's own numbers skip voided calls). With tools and a JSON
response_format, the answer too comes in one delta at the end (tool_choice.py says why).

Log-probabilities, when the request asked (openai_logprobs.py has the shapes): a whole
completion's choice holds every generated token's, reasoning and tool-call tokens included
(vLLM puts them all in `content` too); while streaming, each chunk carries the tokens accepted
since the chunk before, so a token whose text is held back, or a tool call that goes out
whole, has its entries in the chunk that carries its text (or in the last chunk).

vLLM's `prompt_logprobs` (openai_logprobs.PromptLogprobs), asked for, go on the whole text
completion's choice and on the whole chat completion's top level, where vLLM puts them (a
stream cannot ask for them: logprobs_request.py). A text completion's `echo` is its run's first
piece (echo.py): the prompt's text and entries, in the first chunk of a stream.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from freetoken_agent.engine.outputs import TokenEvent, TokenLogprob
from freetoken_agent.integrations.openai_logprobs import (
    Pending,
    PromptLogprobs,
    TextLogprobs,
    TokenStrings,
    chat_logprobs,
)
from freetoken_agent.integrations.server.echo import Echo, Entry, reply_offset
from freetoken_agent.integrations.server.reply import Reply
from freetoken_agent.parsers import ContentDelta, ReasoningDelta, ToolCallEnd
from freetoken_agent.session import Usage


class Choice(NamedTuple):
    """One choice of a whole completion: its reply (a Reply for chat, the text for a text
    completion), finish_reason and log-probabilities (chat: TokenLogprobs; text: (entry,
    text offset) pairs; empty when not asked), and its prompt's entries."""

    reply: Reply | str
    finish_reason: str | None
    logprobs: Sequence[Any] = ()
    # vLLM's prompt_logprobs: the engine's prompt entries (None: not asked, or none came)
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None


def usage_json(usage: Usage | None) -> dict[str, Any]:
    if usage is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    out = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.reused_tokens},
    }
    if usage.reasoning_tokens is not None:  # OpenAI's: of completion_tokens, the reasoning's
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return out


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: a `data:` line and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


@dataclass(slots=True)
class _ChatChoice:
    """What a streamed chat choice carries from one chunk to the next."""

    calls: int = 0  # tool calls streamed so far: the next one's index
    pending: Pending = field(default_factory=Pending)  # entries for its next chunk


class CompletionFormat:
    def __init__(
        self,
        model: str,
        strings: TokenStrings | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        """`strings`: the token strings of a request that asked for logprobs (None: not);
        `prompt_logprobs`: the writer of a request that asked for vLLM's (None: not)."""
        self.model = model
        self._prompt_logprobs = prompt_logprobs
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self._strings = strings
        self._choices: dict[int, _ChatChoice] = {}  # by index, made on first use

    def _choice(self, index: int) -> _ChatChoice:
        return self._choices.setdefault(index, _ChatChoice())

    def _envelope(self, kind: str, choices: list) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, index: int = 0
    ) -> dict[str, Any]:
        """A chunk of choice `index`; asked for, its `logprobs` are that choice's tokens'
        since its chunk before (null when it carries none, as OpenAI's role chunk and vLLM's
        chunks without tokens do)."""
        logprobs = None
        taken = self._choice(index).pending.take() if self._strings is not None else []
        if taken:
            logprobs = chat_logprobs(taken, self._strings)
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self._envelope("chat.completion.chunk", [choice])

    def first_chunks(self, n: int = 1) -> list[dict[str, Any]]:
        """Each choice's role chunk."""
        return [self.chunk({"role": "assistant", "content": ""}, index=i) for i in range(n)]

    def last_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({}, finish_reason, index)

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage_json(usage)}

    def delta(self, event: Any, index: int = 0) -> dict[str, Any] | None:
        """The delta carrying one parser event of choice `index` (None: nothing to send for
        it). A token's log-probabilities wait for that choice's next chunk."""
        state = self._choice(index)
        if isinstance(event, TokenLogprob):
            state.pending.add(event)
            return None
        if isinstance(event, ContentDelta) and event.text:
            return {"content": event.text}
        if isinstance(event, ReasoningDelta) and event.text:
            return {"reasoning_content": event.text}
        if isinstance(event, ToolCallEnd):
            call = {
                "index": state.calls,
                "id": event.id,
                "type": "function",
                "function": {
                    "name": event.name,
                    "arguments": json.dumps(event.arguments, ensure_ascii=False),
                },
            }
            state.calls += 1
            return {"tool_calls": [call]}
        return None  # ToolCallStart, ToolCallArgsDelta (held: see above), warnings, Usage

    def completion(self, choices: Sequence[Choice], usage: Usage | None) -> dict[str, Any]:
        """The whole completion: each choice's message (its `reply` a Reply) and, when asked,
        every token's log-probabilities; vLLM's `prompt_logprobs`, asked for, at the top level
        (the choices share the prompt: the first choice's entries)."""
        written = [
            {
                "index": i,
                "message": choice.reply.openai_message(),
                "logprobs": self._written(choice.logprobs),
                "finish_reason": choice.finish_reason,
            }
            for i, choice in enumerate(choices)
        ]
        whole = {**self._envelope("chat.completion", written), "usage": usage_json(usage)}
        if self._prompt_logprobs is not None:
            whole["prompt_logprobs"] = self._prompt_logprobs.write(choices[0].prompt_logprobs)
        return whole

    def _written(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        return None if self._strings is None else chat_logprobs(logprobs, self._strings)


@dataclass(slots=True)
class _TextChoice:
    """What a streamed text choice carries from one chunk to the next."""

    pending: list[Entry] = field(default_factory=list)  # (entry, offset)
    echo_chars: int = 0  # the echoed prompt's characters, before the reply's
    # The echoed prompt's entries still pending: they go in the next chunk whatever their
    # offsets (a token whose cut character is left to the reply points past the echo's text).
    echo_entries: int = 0
    released: int = 0  # characters of the reply released so far


class TextCompletionFormat:
    """The legacy `text_completion` object, whole or in chunks."""

    def __init__(
        self,
        model: str,
        logprobs: TextLogprobs | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        """`logprobs`, `prompt_logprobs`: the writers of a request that asked for them (None:
        not)."""
        self.model = model
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._choices: dict[int, _TextChoice] = {}  # by index, made on first use

    def _choice(self, index: int) -> _TextChoice:
        return self._choices.setdefault(index, _TextChoice())

    def _envelope(self, choices: list) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(self, text: str, finish_reason: str | None = None, index: int = 0) -> dict[str, Any]:
        """A chunk of choice `index`; asked for, its `logprobs` are that choice's tokens'
        since its chunk before whose text begins in the text sent (the last chunk: all)."""
        logprobs = None
        state = self._choice(index)
        end = state.echo_chars + state.released
        if finish_reason is None:  # a token whose text is still held waits for it
            waiting = state.pending[state.echo_entries :]
            sendable = itertools.takewhile(lambda p: p[1] < end, waiting)
            ready = state.pending[: state.echo_entries] + list(sendable)
        else:  # all; a token a stop string cut away points at the text's end
            ready = [(e, min(offset, end)) for e, offset in state.pending]
        if self._logprobs is not None and ready:  # no tokens in it: null, as chat's
            logprobs, state.pending = self._logprobs.block(ready), state.pending[len(ready) :]
            state.echo_entries = 0
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self._envelope([choice])

    def first_chunks(self, n: int = 1) -> list[dict[str, Any]]:
        return []  # no role to announce: a choice's first chunk carries text

    def last_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        return self.chunk("", finish_reason, index)

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage_json(usage)}

    def delta(self, event: Any, index: int = 0) -> str | None:
        """The text a TextRun event of choice `index` carries (None: nothing to send for it).
        Its token's log-probabilities, asked for, wait for that choice's next chunk; an Echo's
        too (the prompt's: with its text, they make the choice's first chunk)."""
        if isinstance(event, Echo):
            state = self._choice(index)
            state.pending.extend(event.logprobs)
            state.echo_entries = len(event.logprobs)
            state.echo_chars = len(event.text)
            return event.text or None
        if not isinstance(event, TokenEvent):
            return None
        state = self._choice(index)
        entry = event.token_logprob()
        if entry is not None:
            state.pending.append((entry, state.echo_chars + reply_offset(event, state.released)))
        state.released += len(event.text)
        return event.text or None

    def completion(self, choices: Sequence[Choice], usage: Usage | None) -> dict[str, Any]:
        """The whole completion: each choice's text (its `reply`) and, when asked, every
        token's (entry, text offset), an echo's prompt first, and vLLM's `prompt_logprobs`."""
        written = []
        for i, choice in enumerate(choices):
            logprobs = None if self._logprobs is None else self._logprobs.block(choice.logprobs)
            one = {"index": i, "text": choice.reply, "logprobs": logprobs,
                   "finish_reason": choice.finish_reason}  # fmt: skip
            if self._prompt_logprobs is not None:
                one["prompt_logprobs"] = self._prompt_logprobs.write(choice.prompt_logprobs)
            written.append(one)
        return {**self._envelope(written), "usage": usage_json(usage)}
