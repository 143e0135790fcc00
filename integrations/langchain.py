"""ChatFreeToken: a LangChain chat model (langchain-core 1.x `BaseChatModel`) on a local engine.

    llm = ChatFreeToken(model="path/to/model", temperature=0, max_tokens=256)   # or model="demo"
    llm = ChatFreeToken(engine=engine_or_service)                               # share an engine
    llm.bind_tools([add, count_words], tool_choice="any").invoke("...")
    llm.with_structured_output(Answer).invoke("...")        # JSON-schema constrained decoding

Why it is built this way:
- Agents resend their whole history every call. Each ChatFreeToken keeps one warm Session per
  tool binding (langchain_runtime.SessionPool), so a call renders only its new messages and the
  engine reuses the KV of everything it has seen (`usage_metadata.input_token_details
  .cache_read` says how much).
- The engine is shared: all calls go through one EngineService per engine (one stepping
  thread), so threads, asyncio tasks and several ChatFreeToken instances can run at once.
  Cancelling an async call or hitting `timeout` aborts the engine request (at its next step).
- A forced tool call (`tool_choice` "any"/"required"/a name) and `with_structured_output(
  method="json_schema")` use constrained decoding: the output is valid JSON for the schema even
  from a weak model. Both follow the reasoning where the model thinks first (the template
  opens a think block, or a hybrid template is in thinking mode: reasoning, then the JSON,
  integrations/reasoned_json.py; `thinking_token_budget` caps it), a forced call only where a
  thinking budget bounds the reasoning (else it does not think: the call must come).
  `method="json_mode"` constrains the answer to some JSON object (the prompt names the keys).
- `bind_tools(..., parallel_tool_calls=False)` keeps OpenAI's promise of at most one call: the
  generation stops at the first complete call (FirstCallOnly, shared with the server).
- `logprobs=True` (and `top_logprobs`, as ChatOpenAI names them) puts each token's raw
  log-probability in `response_metadata["logprobs"]`, ChatOpenAI's shape; every generated
  token has one, thinking and tool-call tokens included (integrations/openai_logprobs.py).
- `n` (ChatOpenAI's) makes a call return n generations, each its own engine request sharing
  the prompt's KV (langchain_choices.py); streaming takes one, as ChatOpenAI's does.
- Reasoning streams in `additional_kwargs["reasoning_content"]` (and, with
  `output_version="v1"`, as reasoning content blocks) and goes back to the model in later
  turns, where the chat template keeps it.
- The sampling options are SamplingParams' (temperature, max_tokens, top_p, top_k, seed, the
  presence, frequency and repetition penalties, min_p, min_tokens, logit_bias and
  thinking_token_budget), as fields and per call; so is `continue_final_message` (the model
  goes on from a trailing AIMessage: a prefill).
- LangChain's standard test suites (langchain-tests) run on it: tests/integrations/
  test_langchain_standard.py declares what it supports.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import (
    BaseChatModel,
    LangSmithParams,
    LanguageModelInput,
    ModelProfile,
)
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from pydantic import Field, PrivateAttr, model_validator

from freetoken_agent.integrations.langchain_call import (
    LOGPROB_OPTIONS,
    SAMPLING_OPTIONS,
    PreparedCall,
    aretried_turn,
    prepare_call,
    retried_turn,
    stop_list,
)
from freetoken_agent.integrations.langchain_choices import (
    arun_choices,
    chat_result,
    choice_calls,
    one_choice,
    run_choices,
    split_n,
)
from freetoken_agent.integrations.langchain_chunks import PROVIDER, ChunkBuilder
from freetoken_agent.integrations.langchain_messages import (
    function_tools,
    parse_tool_choice,
    to_history,
    tool_names,
)
from freetoken_agent.integrations.langchain_profile import model_profile
from freetoken_agent.integrations.langchain_runtime import (
    GenerationError,
    GenerationTimeout,
    SessionPool,
    chat_format,
    load_service,
    request_problems,
    typed_errors,
)
from freetoken_agent.integrations.langchain_structured import structured_runnable
from freetoken_agent.integrations.openai_logprobs import TokenStrings
from freetoken_agent.service import shared_service

__all__ = ["ChatFreeToken", "GenerationError", "GenerationTimeout"]

# The fields that tell two models' replies apart: LangChain's cache key (_identifying_params).
_KEYED = (
    "device",
    "policy",
    *(k for k in SAMPLING_OPTIONS if k != "top_k"),  # top_k: a call's option only
    "continue_final_message",
    "logprobs",
    "top_logprobs",
    "n",
    "reasoning",
)


def _release_elsewhere(service: Any) -> None:
    """Release a holder's service from a thread of its own: a collection runs finalizers in
    whatever thread it happens in, which may hold the engine's lock mid-step (closing the
    service there would wait on its thread, which waits on that lock)."""
    threading.Thread(target=service.release, name="freetoken-release", daemon=True).start()


class ChatFreeToken(BaseChatModel):
    """A FreeToken engine as a LangChain chat model (see the module docstring)."""

    model: str | None = None
    """A model folder (HF or FTW), or None / "demo" for the embedded random demo model."""
    engine: Any = Field(default=None, exclude=True)
    """An already loaded Engine or EngineService to use instead of loading `model`. An
    Engine's service (made on the first call, shared with the other integrations) is released
    when the last model using it is collected: its thread then stops and lets the engine go."""
    device: str = "auto"
    policy: str = "adaptive"
    gpu_budget: int | None = None
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """More `Engine.load` options (kv_tokens, max_model_len, max_num_seqs, ...)."""
    temperature: float | None = None
    max_tokens: int | None = None
    """The most tokens a reply may take; None: up to the end of the model's context."""
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    """OpenAI's, in [-2, 2]: subtracted once from the logit of each token generated so far."""
    frequency_penalty: float | None = None
    """OpenAI's, in [-2, 2]: subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float | None = None
    """vLLM's (in [0.01, 100], 1 = off): divides the positive logits of tokens in the prompt
    or output so far, multiplies their negative ones."""
    min_p: float | None = None
    """vLLM's, in [0, 1]: keep the tokens at least min_p times as likely as the likeliest."""
    min_tokens: int | None = None
    """vLLM's, at most max_tokens: EOS and stop ids are held back and stop sequences ignored
    until this many tokens are generated."""
    logit_bias: dict[int, float] | None = None
    """OpenAI's: token id -> bias in [-100, 100] added to its logit."""
    thinking_token_budget: int | None = None
    """vLLM's: the most tokens the model's think block may take; then the block is closed
    for it and the model answers (0: no thinking). Only for models with <think> tokens."""
    stop: list[str] | None = None
    timeout: float | None = None
    """Seconds a generation may take; past it the request is aborted (GenerationTimeout)."""
    max_retries: int = 0
    """Retries of a generation that failed in the engine before producing any output."""
    reasoning: bool | None = None
    """enable_thinking for templates that have it; None keeps the template's default."""
    streaming: bool = False
    """invoke() streams under the hood (LangChain's convention), so callbacks see each delta."""
    logprobs: bool | None = None
    """Each generated token's log-probability (the model's raw distribution, before temperature
    or any other processing) in `response_metadata["logprobs"]`, in ChatOpenAI's shape:
    {"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}; a streamed chunk holds
    the tokens since the chunk before, so the chunks add up to the whole list."""
    top_logprobs: int | None = None
    """With logprobs=True: the most likely alternatives (0..20) listed for each token."""
    n: int | None = None
    """Generations per call (ChatOpenAI's; None: 1), seeded seed + i; not when streaming."""
    continue_final_message: bool | None = None
    """vLLM's: the model goes on from the last message, an AIMessage of text (a prefill, as
    ChatAnthropic continues a trailing AIMessage); the reply is the continuation alone."""

    _service: Any = PrivateAttr(default=None)
    _pool: SessionPool | None = PrivateAttr(default=None)

    # --- the engine -----------------------------------------------------------------------
    def _ensure_engine(self) -> SessionPool:
        if self._pool is None:
            holds = False
            if self.engine is not None:
                service, holds = shared_service(self.engine)
            else:
                service = load_service(
                    self.model, self.device, self.policy, self.gpu_budget, self.engine_options
                )
            self._service = service
            self._pool = SessionPool(service)
            if holds:  # let go once no model uses the pool (copies of this one share it): the
                # service held the engine for the program's life (a notebook cell run again
                # kept every engine it had loaded, VRAM and all)
                weakref.finalize(self._pool, _release_elsewhere, service)
        return self._pool

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> ChatFreeToken:
        """A deep copy (`copy.deepcopy`, `model_copy(deep=True)`) shares the engine, its
        service and session pool, as a shallow copy does: an engine is not data to copy (its
        locks and threads cannot be; the copy failed on an RLock), and a second one would
        load the model again."""
        memo = {} if memo is None else memo
        private = self.__pydantic_private__ or {}
        for shared in (self.engine, private.get("_service"), private.get("_pool")):
            if shared is not None:
                memo[id(shared)] = shared
        return super().__deepcopy__(memo)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, values: Any) -> Any:
        """An argument this model does not take is ignored with a warning, as ChatOpenAI warns
        of one (a typo such as `temprature`, or top_k, which only a call takes, otherwise did
        nothing without a word); LangChain's own tooling passes api_key and the like."""
        if isinstance(values, dict):
            unknown = sorted(set(values) - set(cls.model_fields))
            if unknown:
                warnings.warn(
                    f"ChatFreeToken ignores {', '.join(unknown)}: not an option of this model "
                    "(a call's option such as top_k goes to invoke(), or bind())",
                    stacklevel=2,
                )
        return values

    @model_validator(mode="after")
    def _check_n(self) -> ChatFreeToken:
        """ChatOpenAI's rules for n (its messages): a stream carries one generation."""
        if self.streaming:
            one_choice({}, self.n)  # a stream carries one: past 1 raises
        else:
            split_n({}, self.n)  # a bad n raises
        return self

    @model_validator(mode="after")
    def _start_freetoken_engine(self) -> ChatFreeToken:
        """Load (or attach to) the engine at construction: a bad path fails here, clearly."""
        self._ensure_engine()
        return self

    @property
    def service(self):
        """The EngineService every call of this model goes through."""
        self._ensure_engine()
        return self._service

    @property
    def model_name(self) -> str:
        if self.model:
            return self.model
        return "demo" if self.engine is None else str(self.service.spec.arch)

    @property
    def last_prompt(self):
        """The Prompt (token ids, text, anchors) of the last finished call, for inspection."""
        session = self._ensure_engine().last
        return None if session is None else session.last_prompt

    def _resolve_model_profile(self) -> ModelProfile | None:
        return model_profile(self.service)

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """No: an instance may hold a live engine (`engine=`), and a model folder is a path on
        this machine; neither means anything in a serialized chain elsewhere."""
        return False

    @property
    def _llm_type(self) -> str:
        return "freetoken"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        params = {"model_name": self.model_name, **{k: getattr(self, k) for k in _KEYED}}
        # Not "stop": LangChain's cache key sets that to the call's stop, None without one,
        # and two models with different stops would share cached replies.
        params["model_stop"] = self.stop
        return params

    def get_token_ids(self, text: str) -> list[int]:
        return self.service.tokenizer.encode(text)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence | None = None
    ) -> int:
        """Exact: the length of the rendered prompt (chat template included)."""
        specs = function_tools(tools) if tools else None
        fmt = chat_format(self.service, self.reasoning)
        return len(fmt.render(to_history(messages), tools=specs, anchors=False))

    # --- binding --------------------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Tools in OpenAI form, rendered by the chat template. tool_choice: None/"auto",
        "none", "any"/"required"/True (one call of some tool) or a tool name / dict (a call of
        that tool); forced calls are constrained to the tool's argument schema. `strict=True`
        (as ChatOpenAI takes it) marks the tools strict: under "auto" the calls the model
        writes keep to their schemas too (integrations/strict_tools.py; Hermes-, XML- and
        Mistral-format models)."""
        specs = function_tools(tools, strict)
        if strict is not None:  # a tool already in OpenAI form comes back unmarked
            specs = [{**t, "function": {**t["function"], "strict": strict}} for t in specs]
        parse_tool_choice(tool_choice, tool_names(specs))  # a bad choice fails here
        return self.bind(tools=specs, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        """Outputs parsed into `schema` (pydantic model -> instance; TypedDict / JSON schema ->
        dict). "json_schema": the answer is constrained to the schema; "function_calling": a
        forced, constrained call of a tool made from the schema; "json_mode": the answer is
        constrained to some JSON object (the prompt must ask for the schema's keys), then
        validated. `strict` is accepted for OpenAI-style callers; the first two are always
        strict here, since the grammar enforces the schema (json_mode has no schema to be
        strict about, so it takes no `strict`)."""
        if kwargs:
            raise ValueError(f"unexpected with_structured_output options: {sorted(kwargs)}")
        if method == "json_mode" and strict is not None:
            raise ValueError("strict does not apply to method='json_mode' (no schema is sent)")
        return structured_runnable(self, schema, method, include_raw)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangSmith's standard fields: the provider, the model (a per-call `model` wins, as
        the tracing contract asks) and the sampling options this instance really applies."""
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = PROVIDER
        model = kwargs.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.model_name
        stops = stop_list(stop if stop is not None else self.stop)
        if stops:
            params["ls_stop"] = stops
        return params

    # --- one call -------------------------------------------------------------------------
    def _prepare(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> PreparedCall:
        """The call's parts (langchain_call.prepare_call), over this model's own options."""
        return prepare_call(
            messages,
            stop if stop is not None else self.stop,
            kwargs,
            defaults={
                k: getattr(self, k, None)
                for k in (*SAMPLING_OPTIONS, *LOGPROB_OPTIONS, "continue_final_message")
            },
            timeout=self.timeout,
            service=lambda: self.service,
            thinking=self.reasoning,
        )

    def _builder(self) -> ChunkBuilder:
        strings = TokenStrings(self.service.tokenizer)  # decodes only if logprobs come
        return ChunkBuilder(self.model_name, self.output_version == "v1", strings)

    def _turn(self, messages, stop, kwargs) -> Iterator[Any]:
        """Session events of one streamed call, retried while the engine fails before any
        output."""
        with request_problems():
            call = self._prepare(messages, stop, one_choice(kwargs, self.n))
        return retried_turn(self._ensure_engine(), call, self.max_retries)

    def _aturn(self, messages, stop, kwargs) -> AsyncIterator[Any]:
        with request_problems():
            call = self._prepare(messages, stop, one_choice(kwargs, self.n))
        return aretried_turn(self._ensure_engine(), call, self.max_retries)

    def _choices(self, messages, stop, kwargs) -> tuple[list, list[ChunkBuilder]]:
        """Each choice's call (the call's n, else the model's) and its builder."""
        with request_problems():
            n, kwargs = split_n(kwargs, self.n)
            calls = choice_calls(self._prepare(messages, stop, kwargs), n)
        return calls, [self._builder() for _ in calls]

    # --- LangChain's four entry points ----------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with typed_errors():
            calls, builders = self._choices(messages, stop, kwargs)
            run_choices(self._ensure_engine(), calls, self.max_retries, builders)
        return chat_result(builders)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        builder = self._builder()
        with typed_errors():
            for event in self._turn(messages, stop, kwargs):
                chunk = builder.chunk(event)
                if chunk is not None:
                    piece = ChatGenerationChunk(message=chunk)
                    if run_manager is not None:
                        run_manager.on_llm_new_token(_text(chunk), chunk=piece)
                    yield piece
        yield _last(builder)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with typed_errors():
            calls, builders = self._choices(messages, stop, kwargs)
            await arun_choices(self._ensure_engine(), calls, self.max_retries, builders)
        return chat_result(builders)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        builder = self._builder()
        with typed_errors():
            turn = self._aturn(messages, stop, kwargs)
            try:
                async for event in turn:
                    chunk = builder.chunk(event)
                    if chunk is not None:
                        piece = ChatGenerationChunk(message=chunk)
                        if run_manager is not None:
                            await run_manager.on_llm_new_token(_text(chunk), chunk=piece)
                        yield piece
            finally:
                await turn.aclose()
        yield _last(builder)


# ------------------------------------------------------------------------------- helpers


def _text(chunk: Any) -> str:
    """The text of a chunk for on_llm_new_token (v1 chunks hold it in text blocks)."""
    return chunk.text


def _last(builder: ChunkBuilder) -> ChatGenerationChunk:
    return ChatGenerationChunk(
        message=builder.last_chunk(), generation_info=builder.generation_info()
    )
