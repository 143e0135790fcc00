"""ChatFreeToken: LangChain's chat-model contract on the demo engine, plus scripted replies.

The demo model has random weights, so what it writes is gibberish: tests on it check what must
hold whatever the text is (stream == invoke under greedy decoding, usage once and consistent
with the engine's counters, forced calls and structured output valid for random schemas thanks
to the grammar, KV reuse, aborts). Reasoning, free-form tool calls and malformed calls never
come out of it, so `ScriptedEngine` (tests/helpers/) answers with chosen random texts through a real
EngineService and the real parsers.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Literal

import pytest
from held_schema import held_schema
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelInvalidRequestError,
    ModelTimeoutError,
    OutputParserException,
)
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_tests.integration_tests import ChatModelIntegrationTests
from pydantic import BaseModel, ConfigDict, Field, create_model
from scripted_engine import ScriptedEngine

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import ContextLengthError
from freetoken_agent.integrations.constrained_output import closed
from freetoken_agent.integrations.langchain import (
    ChatFreeToken,
    GenerationError,
    GenerationTimeout,
)
from freetoken_agent.integrations.langchain_chunks import _spoil
from freetoken_agent.integrations.langchain_messages import function_tools
from freetoken_agent.integrations.langchain_runtime import service_for
from freetoken_agent.parsers.json_scan import loads_strict
from freetoken_agent.service import EngineService

ROOT = Path(__file__).resolve().parents[2]
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "zo", "pe", "xi", "qu"]
WORDS = ["alpha", "beta", "café", "你好", "🙂", "x,", "{a:", "1}", "!?", "line\nbreak"]


def word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def text(rng: random.Random, n: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def random_model(rng: random.Random, name: str) -> type[BaseModel]:
    """A random pydantic model whose values are bounded (strings, lists, integer ranges), so a
    constrained answer always closes within a few dozen tokens."""
    fields: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["int", "bool", "enum", "str", "list"])
        lo = rng.randint(-50, 50)
        options = tuple({word(rng) for _ in range(rng.randint(1, 4))})
        fields[f"{word(rng)}_{i}"] = {
            "int": (int, Field(ge=lo, le=lo + rng.randint(0, 500))),
            "bool": (bool, ...),
            "enum": (Literal[options], ...),
            "str": (str, Field(max_length=rng.randint(1, 10))),
            "list": (list[Literal[options]], Field(max_length=3)),
        }[kind]
    doc = f"A random record: {text(rng)}"
    return create_model(name, __config__=ConfigDict(extra="forbid"), __doc__=doc, **fields)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    engine = Engine.load(path, device="cpu", progress=False, kv_tokens=8192, max_model_len=2048)
    yield engine
    service_for(engine).close()


def unfinished(llm: ChatFreeToken) -> bool:
    with llm.service.lock:
        return llm.service.engine.has_unfinished()


def totals(llm: ChatFreeToken) -> tuple[int, int]:
    tokens = llm.service.stats()["tokens"]
    return tokens["reused"], tokens["prefilled"]


def aggregate(chunks: list) -> AIMessageChunk:
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


def check_usage_once(chunks: list) -> dict:
    """usage_metadata on exactly one chunk, the last; returns it."""
    with_usage = [i for i, c in enumerate(chunks) if c.usage_metadata]
    assert with_usage == [len(chunks) - 1], with_usage
    assert chunks[-1].chunk_position == "last"
    usage = chunks[-1].usage_metadata
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return usage


# ------------------------------------------------------------------------ the demo engine


def test_stream_adds_up_to_invoke_and_usage_matches_the_engine(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=rng.randint(4, 24))
    history = [SystemMessage(text(rng)), HumanMessage(text(rng))]
    before = totals(llm)
    message = llm.invoke(history)
    after = totals(llm)
    prompt = llm.last_prompt
    usage = message.usage_metadata
    assert usage["input_tokens"] == len(prompt.token_ids)
    assert 0 < usage["output_tokens"] <= llm.max_tokens
    # One request ran: the engine's counters moved by exactly this call's figures.
    assert after[0] - before[0] == usage["input_token_details"]["cache_read"]
    assert sum(after) - sum(before) == usage["input_tokens"]
    assert message.response_metadata["model_name"] == "qwen3_moe"

    chunks = list(llm.stream(history))
    streamed = aggregate(chunks)
    check_usage_once(chunks)
    assert streamed.content == message.content and message.content
    assert streamed.tool_calls == message.tool_calls == []
    assert streamed.response_metadata == message.response_metadata
    for key in ("input_tokens", "output_tokens"):
        assert streamed.usage_metadata[key] == usage[key]
    # The second run reuses the whole prompt but its last token (the engine recomputes it).
    assert streamed.usage_metadata["input_token_details"]["cache_read"] == usage["input_tokens"] - 1


def test_async_matches_sync(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=rng.randint(4, 16))
    question = text(rng)
    expected = llm.invoke(question).content

    async def run():
        message = await llm.ainvoke(question)
        chunks = [c async for c in llm.astream(question)]
        return message, chunks

    message, chunks = asyncio.run(run())
    check_usage_once(chunks)
    assert message.content == aggregate(chunks).content == expected
    assert not unfinished(llm)


def test_streaming_field_streams_invoke_and_reports_each_delta(engine, rng_seed):
    """streaming=True (LangChain's convention): invoke goes through _stream, callbacks see
    every text delta, and the message is the one a plain invoke returns."""
    rng = random.Random(rng_seed)
    question = text(rng)
    options = {"engine": engine, "temperature": 0, "max_tokens": rng.randint(4, 16)}
    plain = ChatFreeToken(**options).invoke(question)
    tokens: list[str] = []

    class Tokens(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            tokens.append(token)

    streamed = ChatFreeToken(**options, streaming=True).invoke(
        question, config={"callbacks": [Tokens()]}
    )
    assert streamed.content == plain.content == "".join(tokens) and len(tokens) > 1
    assert streamed.usage_metadata["output_tokens"] == plain.usage_metadata["output_tokens"]
    assert streamed.response_metadata["finish_reason"] == plain.response_metadata["finish_reason"]


def test_stop_strings_cut_the_greedy_answer(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=24)
    for _ in range(5):  # an answer long enough to cut (the model may end early)
        question = text(rng)
        full = llm.invoke(question).content
        if len(full) >= 4:
            break
    start = rng.randrange(1, len(full) - 2)
    stop = full[start : start + rng.randint(1, 3)]
    cut = llm.invoke(question, stop=[stop])
    assert cut.content == full[: full.find(stop)]
    assert cut.response_metadata["finish_reason"] == "stop"


def test_a_string_stop_is_one_sequence(engine, rng_seed):
    """LangChain types `stop` as a list, but callers pass a str (OpenAI takes either): that is
    one stop sequence, not one per character."""
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=24)
    for _ in range(10):  # an answer with a piece whose characters also occur before it
        question = text(rng)
        full = llm.invoke(question).content
        pieces = {full[i : i + n] for n in (2, 3) for i in range(1, len(full) - n)}
        stops = sorted(
            p for p in pieces if "\ufffd" not in p and set(p) & set(full[: full.find(p)])
        )
        if stops:
            break
    stop = rng.choice(stops)
    cut = llm.invoke(question, stop=stop)
    assert cut.content == full[: full.find(stop)]
    assert cut.response_metadata["finish_reason"] == "stop"


def test_reasoning_switch_reaches_the_template(engine, rng_seed):
    rng = random.Random(rng_seed)
    quiet = ChatFreeToken(engine=engine, max_tokens=2, reasoning=False)
    quiet.invoke(text(rng))
    assert quiet.last_prompt.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    default = ChatFreeToken(engine=engine, max_tokens=2)
    question = text(rng)
    default.invoke(question)
    assert default.last_prompt.text.endswith("<|im_start|>assistant\n")
    # Changed after construction (or on a copy, which shares the warm sessions): the next
    # call renders with the new setting (the pooled session kept the first one).
    default.reasoning = False
    default.invoke(question)
    assert default.last_prompt.text.endswith("<think>\n\n</think>\n\n")
    copy = default.model_copy(update={"reasoning": None})
    copy.invoke(question)
    assert copy.last_prompt.text.endswith("<|im_start|>assistant\n")


def test_threads_share_one_engine(engine, rng_seed):
    rng = random.Random(rng_seed)
    questions = [text(rng) for _ in range(3)]
    llms = [ChatFreeToken(engine=engine, temperature=0, max_tokens=8) for _ in range(2)]
    alone = [llms[0].invoke(q).content for q in questions]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = llms[i % 2].invoke(questions[i]).content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(len(questions))] == alone


@pytest.mark.parametrize("choice", ["name", "any"])
def test_forced_tool_call_streams_valid_arguments(engine, rng_seed, choice):
    rng = random.Random(rng_seed)
    models = [random_model(rng, f"t_{word(rng)}_{i}") for i in range(rng.randint(1, 3))]
    target = rng.choice(models)
    tool_choice = target.__name__ if choice == "name" else "any"
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=200)
    bound = llm.bind_tools(models, tool_choice=tool_choice)
    question = [HumanMessage(text(rng))]

    chunks = list(bound.stream(question))
    check_usage_once(chunks)
    pieces = [p for c in chunks for p in c.tool_call_chunks]
    assert pieces and {p["index"] for p in pieces} == {0}
    assert pieces[0]["id"] and pieces[0]["name"]
    assert all(p["id"] is None and p["name"] is None for p in pieces[1:])
    streamed = aggregate(chunks)
    assert len(streamed.tool_calls) == 1 and not streamed.invalid_tool_calls
    call = streamed.tool_calls[0]
    by_name = {m.__name__: m for m in models}
    assert call["id"] == pieces[0]["id"]
    if choice == "name":
        assert call["name"] == target.__name__
    by_name[call["name"]].model_validate(call["args"])  # extra="forbid": no stray keys either
    assert streamed.response_metadata["finish_reason"] == "tool_calls"

    message = bound.invoke(question)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [(call["name"], call["args"])]
    assert message.tool_calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("choice", ["name", "any"])
def test_forced_tool_call_cut_by_max_tokens_is_the_model_s_text_alone(engine, rng_seed, choice):
    """The call's opener (in the prompt) and closer (fed to the parser) are not the model's
    text: a forced call cut short is content, and an invalid call, holding only what the model
    wrote."""
    rng = random.Random(rng_seed)
    models = [random_model(rng, f"t_{word(rng)}_{i}") for i in range(rng.randint(1, 3))]
    tool_choice = rng.choice(models).__name__ if choice == "name" else "any"
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=rng.randint(1, 8))
    bound = llm.bind_tools(models, tool_choice=tool_choice)
    question = [HumanMessage(text(rng))]
    message = bound.invoke(question)
    streamed = aggregate(list(bound.stream(question)))
    openings = [f'{{"name": "{m.__name__}", "arguments": {{' for m in models]
    for m in (message, streamed):
        assert m.response_metadata["finish_reason"] == "length" and not m.tool_calls
        assert any(o.startswith(m.content) or m.content.startswith(o) for o in openings), m
    assert streamed.content == message.content
    assert all(c["args"] == message.content for c in message.invalid_tool_calls)


@pytest.mark.parametrize(
    "form", ["pydantic", "json_schema", "function_calling", "response_format", "named_tool"]
)
def test_structured_output_is_valid_for_a_random_schema(engine, rng_seed, form):
    rng = random.Random(rng_seed)
    model = random_model(rng, f"Out_{word(rng)}")
    # (the demo's template reasons first: a budget makes the random model answer in time)
    llm = ChatFreeToken(engine=engine, temperature=rng.choice([0, 0.8]), max_tokens=200,
                        thinking_token_budget=rng.randint(0, 8))  # fmt: skip
    question = text(rng)
    if form == "pydantic":
        result = llm.with_structured_output(model).invoke(question)
        assert isinstance(result, model)
    elif form == "json_schema":
        schema = model.model_json_schema()
        out = llm.with_structured_output(schema, include_raw=True).invoke(question)
        assert out["parsing_error"] is None and isinstance(out["raw"], AIMessage)
        assert loads_strict(out["raw"].content) == out["parsed"]  # JSON as a call's arguments
        model.model_validate(out["parsed"])
    elif form == "function_calling":
        result = llm.with_structured_output(model, method="function_calling").invoke(question)
        assert isinstance(result, model)
    else:  # OpenAI's response_format objects, as ChatOpenAI takes them: held to their schema
        named = {"name": model.__name__, "schema": model.model_json_schema(), "strict": True}
        wrapped = {"type": "json_schema", "json_schema": named}
        schema = rng.choice([named, wrapped]) if form == "response_format" else named
        method = "json_schema" if form == "response_format" else "function_calling"
        model.model_validate(llm.with_structured_output(schema, method=method).invoke(question))


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_cut_by_max_tokens_is_an_error(engine, rng_seed, method):
    """Not a silently completed partial object (LangChain's JSON parsers would complete it)."""
    rng = random.Random(rng_seed)
    model = random_model(rng, f"Out_{word(rng)}")
    extra = {f"{word(rng)}_x": (int, Field(ge=0, le=9)) for _ in range(2)}
    model = create_model(model.__name__ + "2", __base__=model, **extra)  # at least 3 fields
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=rng.randint(1, 6))
    structured = llm.with_structured_output(model, method=method, include_raw=True)
    out = structured.invoke(text(rng))
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
    assert out["raw"].response_metadata["finish_reason"] == "length"
    # Streamed too: the error reported, not raised (a fallback around the chain cannot catch
    # an error raised after raw's chunks went out).
    chunks = list(structured.stream(text(rng)))

    async def streamed() -> list:
        return [c async for c in structured.astream(text(rng))]

    for got in (chunks, asyncio.run(streamed())):
        last = {k: v for c in got for k, v in c.items() if k != "raw"}
        assert last["parsed"] is None, last
        assert isinstance(last["parsing_error"], OutputParserException), last
    with pytest.raises(OutputParserException):
        llm.with_structured_output(model, method=method).invoke(text(rng))


def test_tools_with_a_response_format_give_a_call_or_the_answer(engine, rng_seed):
    """How create_agent binds a ProviderStrategy: tools plus response_format."""
    rng = random.Random(rng_seed)
    tools = [random_model(rng, f"t_{word(rng)}") for _ in range(2)]
    answer = random_model(rng, f"Answer_{word(rng)}")
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": answer.model_json_schema()},
    }
    # (the demo's template reasons first: a budget makes the random model answer in time)
    llm = ChatFreeToken(engine=engine, temperature=1.0, seed=rng.randrange(1 << 30),
                        max_tokens=200, thinking_token_budget=rng.randint(0, 8))  # fmt: skip
    message = llm.bind_tools(tools).bind(response_format=fmt).invoke(text(rng))
    if message.tool_calls:
        call = message.tool_calls[0]
        {t.__name__: t for t in tools}[call["name"]].model_validate(call["args"])
    else:
        answer.model_validate_json(message.content)


def test_longer_history_reuses_the_cached_prompt(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=8)
    history = [HumanMessage(text(rng, 12))]
    first = llm.invoke(history)
    history += [first, HumanMessage(text(rng))]
    before = totals(llm)
    second = llm.invoke(history)
    reused = totals(llm)[0] - before[0]
    # The whole first prompt is a prefix of the second (give or take the token where BPE may
    # merge the generation prefix's newline with the reply's first characters).
    assert reused >= first.usage_metadata["input_tokens"] - 2 > 0
    assert second.usage_metadata["input_token_details"]["cache_read"] == reused


def test_reasoning_goes_back_into_the_prompt(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=4)
    thought = f"{word(rng)} {text(rng)}"
    tool = random_model(rng, f"t_{word(rng)}")
    call = {"name": tool.__name__, "args": {}, "id": f"call_{word(rng)}"}
    history = [
        HumanMessage(text(rng)),
        AIMessage("", additional_kwargs={"reasoning_content": thought}, tool_calls=[call]),
        ToolMessage(text(rng), tool_call_id=call["id"]),
    ]
    llm.bind_tools([tool]).invoke(history)
    assert f"<think>\n{thought.strip()}\n</think>" in llm.last_prompt.text
    # The v1 form (a reasoning content block) is read too.
    blocks = [{"type": "reasoning", "reasoning": thought}, {"type": "text", "text": "ok"}]
    history[1] = AIMessage(blocks, tool_calls=[call])
    llm.bind_tools([tool]).invoke(history)
    assert f"<think>\n{thought.strip()}\n</think>\n\nok" in llm.last_prompt.text


def test_cancelling_astream_aborts_the_request(engine):
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=900)

    async def run() -> bool:
        three = asyncio.Event()

        async def read() -> None:
            n = 0
            async for _ in llm.astream("tell me everything"):
                n += 1
                if n == 3:
                    three.set()

        task = asyncio.create_task(read())
        await three.wait()
        running = unfinished(llm)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return running

    assert asyncio.run(run())  # it was generating when cancelled...
    assert not unfinished(llm)  # ...and no longer is, right after


def test_timeout_and_early_close_abort(engine):
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=900, timeout=0.3)
    with pytest.raises(GenerationTimeout) as timed_out:
        llm.invoke("go on")
    assert isinstance(timed_out.value, ModelTimeoutError)  # langchain-core's typed error
    assert not unfinished(llm)
    stream = llm.stream("go on", timeout=None)
    next(stream)
    stream.close()
    assert not unfinished(llm)


def test_bad_input_is_a_clear_value_error(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, max_tokens=4)
    tool = random_model(rng, f"t_{word(rng)}")
    cases = {
        "tool_choice": lambda: llm.bind_tools([tool], tool_choice="nope"),
        "text only": lambda: llm.invoke([HumanMessage([{"type": "image", "url": "x"}])]),
        "matches no earlier call": lambda: llm.invoke(
            [HumanMessage("a"), ToolMessage("b", tool_call_id="zz")]
        ),
        "unknown option": lambda: llm.invoke("a", frobnicate=1),
        "temperature": lambda: llm.invoke("a", temperature=-1),
        "no messages": lambda: llm.invoke([]),
        "not a model folder": lambda: ChatFreeToken(model=str(ROOT / "nope")),
    }
    cases["not a function tool"] = lambda: llm.bind_tools([{"type": "web_search_preview"}])
    for expected, call in cases.items():
        with pytest.raises(ValueError, match=expected):
            call()
    # Refusals of a call are langchain-core's typed errors too (agent middleware reads them:
    # ModelRetryMiddleware does not retry them, SummarizationMiddleware trims on overflow).
    refused = [{"temperature": -1}, {"response_format": {"type": "xml"}}, {"n": 0},
               {"parallel_tool_calls": "no"}, {"continue_final_message": "yes"},
               {word(rng) + "_option": 1}]  # fmt: skip
    for options in refused:
        for run in (llm.invoke, lambda *a, **k: list(llm.stream(*a, **k))):
            with pytest.raises(ModelInvalidRequestError):
                run("a", **options)
    with pytest.raises(ModelInvalidRequestError, match="n must be 1"):
        list(llm.stream("a", n=2))
    long = " ".join(word(rng) for _ in range(3000))  # past the test engine's 2048
    for stream in (False, True):
        with pytest.raises(ContextOverflowError) as overflow:
            list(llm.stream(long)) if stream else llm.invoke(long)
        assert isinstance(overflow.value, ContextLengthError)  # still the engine's error
        assert overflow.value.prompt_tokens > engine.max_model_len


def test_a_flat_responses_function_tool_is_the_nested_one(engine, rng_seed):
    """The Responses API's flat function tool ({type, name, description, parameters, strict})
    binds as the chat form of the same tool does (it was refused as "not a function tool")."""
    rng = random.Random(rng_seed)
    model = random_model(rng, f"t_{word(rng)}")
    nested = convert_to_openai_tool(model, strict=rng.choice([None, True, False]))
    flat = {"type": "function", **nested["function"]}
    assert function_tools([flat]) == function_tools([nested])
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=200,
                        thinking_token_budget=rng.randint(0, 8))  # fmt: skip
    (call,) = llm.bind_tools([flat], tool_choice=model.__name__).invoke(text(rng)).tool_calls
    assert call["name"] == model.__name__
    model.model_validate(call["args"])


def test_no_max_tokens_means_up_to_the_context(engine, rng_seed):
    """max_tokens None is ChatOpenAI's "no limit": the engine's 256 default cut replies."""
    fake = ScriptedEngine(engine)
    reply = text(random.Random(rng_seed), 40)
    fake.replies = [(reply, "stop")]
    with EngineService(fake) as service:
        message = ChatFreeToken(engine=service).invoke("hi")
    assert fake.samplings[-1].max_tokens == engine.max_model_len
    assert message.content == reply


def test_an_argument_the_model_does_not_take_warns(engine):
    with pytest.warns(UserWarning, match="ignores temprature"):
        ChatFreeToken(engine=engine, temprature=0)


def test_profile_and_identity(engine):
    llm = ChatFreeToken(engine=engine)
    profile = llm.profile
    assert profile["max_input_tokens"] == engine.max_model_len - 1
    assert profile["tool_calling"] and profile["structured_output"] and profile["tool_choice"]
    assert profile["reasoning_output"]  # the demo template thinks
    assert llm._llm_type == "freetoken"
    assert llm.get_num_tokens_from_messages([HumanMessage("hi")]) > 2


def test_importing_the_package_does_not_import_langchain():
    code = (
        "import sys, freetoken_agent; assert not any(m.startswith('langchain') for m in "
        "sys.modules); from freetoken_agent import ChatFreeToken; print(ChatFreeToken.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ChatFreeToken", out.stderr


def test_the_example_agent_calls_a_tool(capsys):
    spec = importlib.util.spec_from_file_location(
        "langchain_agent", ROOT / "examples/langchain_agent.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    messages = module.main(["--device", "cpu", "--max-tokens", "48", "--max-steps", "2"])
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls and any(isinstance(m, ToolMessage) for m in messages)
    assert "[tool call]" in capsys.readouterr().out


# ---------------------------------------------------------------------- scripted replies


def test_scripted_reasoning_and_tool_calls_stream_like_invoke(scripted, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted
    tools = [random_model(rng, f"t_{word(rng)}_{i}") for i in range(2)]
    thought, answer = text(rng), text(rng)
    calls = [(rng.choice(tools).__name__, {word(rng): rng.randint(-9, 99)}) for _ in range(2)]
    blocks = "".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>\n'
        for n, a in calls
    )
    broken = f'<tool_call>\n{{"name": "{word(rng)}", "arguments": {{"k": [1, "x\\\\'
    reply = f"<think>\n{thought}\n</think>\n\n{answer}\n{blocks}{broken}\n</tool_call>"
    llm = ChatFreeToken(engine=service, max_tokens=64).bind_tools(tools)
    fake.replies = [(reply, "stop", None)] * 2

    chunks = list(llm.stream([HumanMessage(text(rng))]))
    check_usage_once(chunks)
    streamed = aggregate(chunks)
    message = llm.invoke([HumanMessage(text(rng))])
    for m in (streamed, message):
        assert m.additional_kwargs["reasoning_content"] == thought
        assert m.content.startswith(answer) and m.content.endswith("</tool_call>")
        assert [(c["name"], c["args"]) for c in m.tool_calls] == calls
        assert len(m.invalid_tool_calls) == 1
        assert len({c["id"] for c in m.tool_calls + m.invalid_tool_calls}) == 3
    assert message.invalid_tool_calls[0]["error"].startswith("tool call is not valid JSON")
    assert message.invalid_tool_calls[0]["args"] == broken + "\n</tool_call>"
    indexes = [p["index"] for c in chunks for p in c.tool_call_chunks]
    assert sorted(set(indexes)) == [0, 1, 2] and indexes == sorted(indexes)
    assert message.response_metadata["finish_reason"] == "tool_calls"

    # The turn goes back with its reasoning; the template keeps it (after the last user turn).
    history = [HumanMessage(text(rng)), message] + [
        ToolMessage(text(rng), tool_call_id=c["id"]) for c in message.tool_calls
    ]
    fake.replies = [(answer, "stop", None)]
    llm.invoke(history)
    assert f"<think>\n{thought}\n</think>" in fake.tokenizer.decode(fake.prompts[-1], False)


def test_scripted_v1_stream_keeps_reasoning_text_and_calls_apart(scripted, rng_seed):
    """output_version="v1": LangChain merges streamed content blocks by index, so a call's
    chunks must not share an index with the reasoning or text blocks (they would merge into one
    garbled block); the streamed message reads like the invoked one."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    tools = [random_model(rng, f"t_{word(rng)}_{i}") for i in range(2)]
    thought, answer = text(rng), text(rng)
    calls = [(rng.choice(tools).__name__, {word(rng): rng.randint(-9, 99)}) for _ in range(2)]
    blocks = "".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>\n'
        for n, a in calls
    )
    fake.replies = [(f"<think>\n{thought}\n</think>\n\n{answer}\n{blocks}", "stop", None)] * 2
    llm = ChatFreeToken(engine=service, max_tokens=64, output_version="v1").bind_tools(tools)
    message = llm.invoke([HumanMessage(text(rng))])
    chunks = list(llm.stream([HumanMessage(text(rng))]))
    check_usage_once(chunks)
    streamed = aggregate(chunks)
    kinds_at: dict[int, set[str]] = {}  # block index -> the block types streamed under it
    for chunk in chunks:
        for block in chunk.content:
            kinds_at.setdefault(block["index"], set()).add(block["type"])
    assert sorted(kinds_at) == list(range(4)) and all(len(k) == 1 for k in kinds_at.values())
    for m in (message, streamed):
        kinds = [b["type"] for b in m.content_blocks]
        assert kinds == ["reasoning", "text", "tool_call", "tool_call"], m.content_blocks
        assert m.content_blocks[0]["reasoning"] == thought
        assert m.content_blocks[1]["text"].strip() == answer.strip()
        assert [(c["name"], c["args"]) for c in m.tool_calls] == calls
        assert [(b["name"], b["args"]) for b in m.content_blocks[2:]] == calls
        assert m.additional_kwargs["reasoning_content"] == thought


def test_scripted_call_or_answer_is_told_apart_by_the_whole_output(scripted, rng_seed):
    """tools + response_format: the output is either a {"name", "arguments"} call of a bound
    tool or the answer's JSON (the grammar allows both; the parser decides at the end). With
    thinking on (the demo's hybrid template) the JSON follows the reasoning, which comes back
    as the reasoning."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    tool = random_model(rng, f"t_{word(rng)}")
    args = {word(rng): rng.randint(0, 9)}
    answer = {"name": word(rng), "arguments": {}}  # call-shaped, but names no bound tool
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    reasoning = rng.choice([None, False])
    thought = text(rng) if reasoning is None else ""
    head = thought + "\n</think>\n\n" if thought else ""
    llm = ChatFreeToken(engine=service, max_tokens=64, reasoning=reasoning)
    llm = llm.bind_tools([tool]).bind(response_format=fmt)
    fake.replies = [
        (head + json.dumps({"name": tool.__name__, "arguments": args}), "stop", None),
        (head + json.dumps(answer), "stop", None),
    ]
    called = llm.invoke(text(rng))
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [(tool.__name__, args)]
    assert called.content == ""
    assert called.additional_kwargs.get("reasoning_content", "") == thought, called
    chunks = list(llm.stream(text(rng)))
    answered = aggregate(chunks)
    assert not answered.tool_calls and json.loads(answered.content) == answer
    assert answered.additional_kwargs.get("reasoning_content", "") == thought, answered
    schemas = [held_schema(s) for s in fake.samplings]
    assert all(s is not None and s == schemas[0] for s in schemas), schemas
    assert [bool(s.grammar) for s in fake.samplings] == [reasoning is None] * 2


def test_scripted_failures_raise_and_retry(scripted, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted
    problem = f"boom {word(rng)}"
    fake.replies = [("", "error", problem)]
    with pytest.raises(GenerationError, match=problem):
        ChatFreeToken(engine=service).invoke("a")
    fake.replies = [("", "error", problem), (answer := text(rng), "stop", None)]
    assert ChatFreeToken(engine=service, max_retries=1).invoke("a").content == answer


class _StandardSuite(ChatModelIntegrationTests):
    """LangChain's standard integration tests, to run single test bodies on a scripted model
    (not collected: the whole suite runs on the demo model in test_langchain_standard.py)."""

    @property
    def chat_model_class(self) -> type[ChatFreeToken]:
        return ChatFreeToken

    @property
    def supports_json_mode(self) -> bool:
        return True


def _call(name: str, args: dict) -> str:
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


_JOKE = json.dumps(
    {"setup": "Why did the cat sit on the laptop?", "punchline": "To keep an eye on the mouse."}
)
_WEATHER = (
    "<tool_call>\n" + _call("get_weather", {"location": "San Francisco, CA"}) + "\n</tool_call>"
)
# A structured answer under the demo's hybrid template in thinking mode: the prompt opened the
# think block (integrations/reasoned_json.py), so a capable model reasons, closes it, answers.
_REASONED_JOKE = "A cat, a laptop, a mouse.\n</think>\n\n" + _JOKE
# Every standard test test_langchain_standard.py expects to fail on the random demo model, with
# the replies a capable model would write (forced calls: the call body the grammar starts at).
_COMPETENT: dict[str, tuple[list[str], dict, tuple]] = {
    "test_tool_calling": ([_call("magic_function", {"input": 3})] * 2, {}, ()),
    "test_tool_calling_async": ([_call("magic_function", {"input": 3})] * 2, {}, ()),
    "test_bind_runnables_as_tools": (
        [_call("greeting_generator", {"answer_style": "pirate"})],
        {},
        (),
    ),
    "test_unicode_tool_call_integration": (
        [
            _call("unicode_customer", {"customer_name": "你好啊集团", "description": "科技"}),
            _call(
                "unicode_customer", {"customer_name": "こんにちは株式会社", "description": "会社"}
            ),
        ],
        {},
        (),
    ),
    "test_agent_loop": ([_WEATHER, "It is sunny in San Francisco."], {}, ()),
    "test_structured_output": ([_REASONED_JOKE] * 2, {}, ("pydantic",)),
    "test_structured_output_async": ([_REASONED_JOKE] * 2, {}, ("typeddict",)),
    "test_structured_output_pydantic_2_v1": ([_REASONED_JOKE] * 4, {}, ()),
    "test_structured_output_optional_param": (
        ["Setup only.\n</think>\n\n" + json.dumps({"setup": "A cat walks in."})]
        + [_REASONED_JOKE] * 3,
        {},
        (),
    ),
    "test_json_mode": ([_REASONED_JOKE] * 4, {}, ()),
}


@pytest.mark.parametrize("output_version", [None, "v1"])
@pytest.mark.parametrize("name", sorted(_COMPETENT))
def test_scripted_competent_model_passes_the_xfailed_standard_tests(scripted, name, output_version):
    """The standard tests expected to fail on the random demo model pass, body unchanged, when
    the model writes what a capable one would: they fail for the model, not for the plumbing."""
    fake, service = scripted
    replies, params, args = _COMPETENT[name]
    fake.replies = [(r, "stop", None) for r in replies]
    extra = {"output_version": output_version} if output_version else {}
    model = ChatFreeToken(engine=service, temperature=0, max_tokens=64, **params, **extra)
    outcome = getattr(ChatModelIntegrationTests, name)(_StandardSuite(), model, *args)
    if inspect.iscoroutine(outcome):
        asyncio.run(outcome)
    assert not fake.replies, "the test asked for fewer answers than scripted"
    if name == "test_json_mode":  # JSON mode constrains to some JSON object, not the schema
        answers = [held_schema(s) for s in fake.samplings]
        assert {a["type"] for a in answers} == {"object"}
        assert all("properties" not in a for a in answers)


def test_constrained_schemas_are_closed_but_keep_their_own_choice():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "many": {"type": "array", "items": {"anyOf": [{"properties": {}}, {"type": "null"}]}},
        },
    }
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert set(props) == {"properties", "open", "many"}  # a property named "properties" stays
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["many"]["items"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["many"]["items"]["anyOf"][1]


def test_spoiled_arguments_never_parse_as_a_call(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(200):
        value = {word(rng): rng.choice([1, 'a\\b"c', [1, {"x": "y"}], {"z": []}, None])}
        full = json.dumps(value)
        cut = full[: rng.randint(1, len(full))]
        piece = {"name": "f", "args": cut + _spoil(cut), "id": "c", "index": 0}
        chunk = AIMessageChunk(content="", tool_call_chunks=[piece])
        assert not chunk.tool_calls and len(chunk.invalid_tool_calls) == 1, cut
