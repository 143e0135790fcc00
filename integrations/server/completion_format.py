"""OpenAI completion objects from a run's events: chunks while streaming, or one whole.

`CompletionFormat` writes chat completions (from a TurnRun's parser events), and
`TextCompletionFormat` legacy text completions (from a TextRun's text pieces): `object`
"text_completion", `choices[0].text`, whole or as streamed deltas, under a `cmpl-` id. Both
end a stream alike: a chunk with the finish_reason, then the usage chunk if asked for.

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
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from freetoken_agent.engine.outputs import TokenEvent, TokenLogprob
from freetoken_agent.integrations.openai_logprobs import (
    Pending,
    TextLogprobs,
    TokenStrings,
    chat_logprobs,
)
from freetoken_agent.integrations.server.reply import Reply
from freetoken_agent.parsers import ContentDelta, ReasoningDelta, ToolCallEnd
from freetoken_agent.session import Usage


def usage_json(usage: Usage | None) -> dict[str, Any]:
    if usage is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.reused_tokens},
    }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: a `data:` line and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


class CompletionFormat:
    def __init__(self, model: str, strings: TokenStrings | None = None) -> None:
        """`strings`: the token strings of a request that asked for logprobs (None: not)."""
        self.model = model
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self._calls = 0  # tool calls streamed so far: the next one's index
        self._strings = strings
        self._pending = Pending()  # entries for the next chunk (openai_logprobs.py)

    def _envelope(self, kind: str, choices: list) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        """A chunk; asked for, its `logprobs` are the tokens' since the chunk before (null
        when it carries none, as OpenAI's role chunk and vLLM's chunks without tokens do)."""
        logprobs = None
        taken = self._pending.take() if self._strings is not None else []
        if taken:
            logprobs = chat_logprobs(taken, self._strings)
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", [choice])

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def last_chunk(self, finish_reason: str | None) -> dict[str, Any]:
        return self.chunk({}, finish_reason)

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage_json(usage)}

    def delta(self, event: Any) -> dict[str, Any] | None:
        """The delta carrying one parser event (None: nothing to send for it). A token's
        log-probabilities wait for the next chunk."""
        if isinstance(event, TokenLogprob):
            self._pending.add(event)
            return None
        if isinstance(event, ContentDelta) and event.text:
            return {"content": event.text}
        if isinstance(event, ReasoningDelta) and event.text:
            return {"reasoning_content": event.text}
        if isinstance(event, ToolCallEnd):
            call = {
                "index": self._calls,
                "id": event.id,
                "type": "function",
                "function": {
                    "name": event.name,
                    "arguments": json.dumps(event.arguments, ensure_ascii=False),
                },
            }
            self._calls += 1
            return {"tool_calls": [call]}
        return None  # ToolCallStart, ToolCallArgsDelta (held: see above), warnings, Usage

    def completion(
        self,
        reply: Reply,
        usage: Usage | None,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprob] = (),
    ):
        """The whole completion; `logprobs`: every token's, when asked."""
        written = None if self._strings is None else chat_logprobs(logprobs, self._strings)
        choice = {
            "index": 0,
            "message": reply.openai_message(),
            "logprobs": written,
            "finish_reason": finish_reason,
        }
        return {**self._envelope("chat.completion", [choice]), "usage": usage_json(usage)}


class TextCompletionFormat:
    """The legacy `text_completion` object, whole or in chunks (one choice, index 0)."""

    def __init__(self, model: str, logprobs: TextLogprobs | None = None) -> None:
        """`logprobs`: the writer of a request that asked for them (None: not)."""
        self.model = model
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self._logprobs = logprobs
        self._pending: list[tuple[TokenLogprob, int]] = []  # (entry, offset) for the next chunk
        self._released = 0  # characters of text released so far: the next token's offset

    def _envelope(self, choices: list) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        """A chunk; asked for, its `logprobs` are the tokens' since the chunk before."""
        logprobs = None
        if self._logprobs is not None and self._pending:  # no tokens in it: null, as chat's
            logprobs, self._pending = self._logprobs.block(self._pending), []
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope([choice])

    def first_chunks(self) -> list[dict[str, Any]]:
        return []  # no role to announce: the first chunk carries text

    def last_chunk(self, finish_reason: str | None) -> dict[str, Any]:
        return self.chunk("", finish_reason)

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage_json(usage)}

    def delta(self, event: Any) -> str | None:
        """The text a TextRun event carries (None: nothing to send for it). Its token's
        log-probabilities, asked for, wait for the next chunk."""
        if not isinstance(event, TokenEvent):
            return None
        entry = event.token_logprob()
        if entry is not None:
            self._pending.append((entry, self._released))
        self._released += len(event.text)
        return event.text or None

    def completion(
        self,
        text: str,
        usage: Usage | None,
        finish_reason: str | None,
        logprobs: Sequence[tuple[TokenLogprob, int]] = (),
    ):
        """The whole completion; `logprobs`: every token's (entry, text offset), when asked."""
        written = None if self._logprobs is None else self._logprobs.block(logprobs)
        choice = {"index": 0, "text": text, "logprobs": written, "finish_reason": finish_reason}
        return {**self._envelope([choice]), "usage": usage_json(usage)}
