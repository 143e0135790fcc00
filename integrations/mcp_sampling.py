"""Servers' `sampling/createMessage` requests answered by the local model.

An MCP server may ask the host's model for a completion (a summariser tool, a server-side
agent). The request carries MCP messages, `maxTokens`, and optionally `systemPrompt`,
`temperature` and `stopSequences`; each maps onto a fresh Session (the host's ChatFormat, so
rendering caches are shared) with the model's own parser, so a thinking model's reasoning is
kept out of the answer. The answer is the visible text, with `stopReason` endTurn (the model
ended), stopSequence or maxTokens.

What is refused, with an ErrorData that says why rather than a silent approximation: image or
audio content (the engine reads text), tool use inside sampling (the host does not advertise
`sampling.tools`), and requests the engine rejects (a context over the model's limit).
`includeContext` is ignored: the host does not advertise `sampling.context` either.
`modelPreferences` are ignored: there is one local model.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.mcp_engine import iterate_in_thread
from freetoken_agent.messages import AssistantMessage, Message, UserMessage
from freetoken_agent.parsers import ContentDelta, parser_factory_for
from freetoken_agent.session import Session, Usage

log = logging.getLogger("freetoken.mcp")

LOG_KEPT = 256  # the sampling records kept (the most recent)


@dataclass(slots=True)
class SamplingRecord:
    """One answered (or refused) request, kept by the host in `host.sampler.log` (the last
    LOG_KEPT of them: a server sampling in a loop must not grow the host for ever)."""

    server: str
    messages: list[Message]
    system: str | None
    max_tokens: int
    text: str | None  # None when refused
    stop_reason: str | None
    error: str | None
    seconds: float


class SamplingResponder:
    """Turns a server's CreateMessageRequestParams into a local generation."""

    def __init__(
        self,
        service: Any,
        chat_format: ChatFormat,
        *,
        model_name: str,
        max_tokens_cap: int,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        self.service = service
        self.chat_format = chat_format
        self.model_name = model_name
        self.max_tokens_cap = max_tokens_cap  # a server cannot make the host generate forever
        self.defaults = dict(defaults or {})  # temperature etc. when the request names none
        self.log: deque[SamplingRecord] = deque(maxlen=LOG_KEPT)

    def callback_for(self, server: str):
        """The SDK's `sampling_callback` for one server (so records name who asked)."""

        async def callback(context: Any, params: types.CreateMessageRequestParams) -> Any:
            return await self.answer(server, params)

        return callback

    async def answer(
        self, server: str, params: types.CreateMessageRequestParams
    ) -> types.CreateMessageResult | types.ErrorData:
        start = time.perf_counter()
        record = SamplingRecord(
            server, [], params.system_prompt, params.max_tokens, None, None, None, 0.0
        )
        self.log.append(record)
        try:
            if params.tools or params.tool_choice is not None:
                raise InvalidRequestError(
                    "tool use inside sampling is not supported by this host (it does not "
                    "advertise sampling.tools)"
                )
            record.messages = [_message(m, i) for i, m in enumerate(params.messages)]
            text, stop_reason = await self._generate(record.messages, params)
        except InvalidRequestError as e:
            record.error = str(e)
            log.warning("sampling request from %r refused: %s", server, e)
            return types.ErrorData(code=types.INVALID_PARAMS, message=str(e))
        except Exception as e:  # noqa: BLE001 - the server gets an error, the host lives on
            record.error = f"{type(e).__name__}: {e}"
            log.exception("sampling request from %r failed", server)
            return types.ErrorData(code=types.INTERNAL_ERROR, message=record.error)
        finally:
            record.seconds = time.perf_counter() - start
        record.text, record.stop_reason = text, stop_reason
        return types.CreateMessageResult(
            role="assistant",
            content=types.TextContent(type="text", text=text),
            model=self.model_name,
            stop_reason=stop_reason,
        )

    async def _generate(
        self, messages: list[Message], params: types.CreateMessageRequestParams
    ) -> tuple[str, str]:
        if params.max_tokens < 1:
            raise InvalidRequestError(f"maxTokens must be at least 1, got {params.max_tokens}")
        options = dict(self.defaults)
        options["max_tokens"] = min(params.max_tokens, self.max_tokens_cap)
        if params.temperature is not None:
            options["temperature"] = params.temperature
        stops = [s for s in params.stop_sequences or [] if s]
        options["stop"] = stops
        session = Session(
            self.service,
            system=params.system_prompt or None,
            chat_format=self.chat_format,
            parser_factory=parser_factory_for(self.service, None),
        )
        sampling = session.sampling(options)  # bad values raise InvalidRequestError here
        texts: list[str] = []
        usage: Usage | None = None
        async for event in iterate_in_thread(lambda: session.send(messages, sampling)):
            if isinstance(event, ContentDelta):
                texts.append(event.text)
            elif isinstance(event, Usage):
                usage = event
        if usage is None or usage.finish_reason == "error":
            raise RuntimeError(f"generation failed: {usage.error if usage else 'no result'}")
        return "".join(texts), self._stop_reason(session, usage, bool(stops))

    def _stop_reason(self, session: Session, usage: Usage, has_stops: bool) -> str:
        if usage.finish_reason == "length":
            return "maxTokens"
        engine = getattr(self.service, "engine", self.service)
        last = session.last_output_ids[-1] if session.last_output_ids else None
        if has_stops and last not in getattr(engine, "eos_token_ids", ()):
            return "stopSequence"  # ended on "stop" without the end-of-turn token
        return "endTurn"


def _message(message: types.SamplingMessage, index: int) -> Message:
    blocks = message.content if isinstance(message.content, list) else [message.content]
    texts = []
    for block in blocks:
        if getattr(block, "type", None) != "text":
            raise InvalidRequestError(
                f"sampling message {index}: {getattr(block, 'type', '?')} content is not "
                "supported; this host's model reads text only"
            )
        texts.append(block.text)
    text = "\n".join(texts)
    return UserMessage(text) if message.role == "user" else AssistantMessage(text)
