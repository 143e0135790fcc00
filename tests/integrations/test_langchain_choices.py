"""ChatFreeToken's `n` (integrations/langchain_choices.py): a call returns n generations, sync
and async, as the model's field or the call's option; seeded, choice i is the single call of
seed + i (so they differ and come back the same); greedy ones are identical; forced tool calls
are made by every choice; the later choices reuse the prompt the first one prefilled; a
failing choice raises and ends the others; streaming refuses n > 1 as ChatOpenAI does; n is in
the cache key."""

from __future__ import annotations

import asyncio
import random
import string
import threading

import pytest
from langchain_core.messages import HumanMessage
from lookup_tool import LOOKUP_TOOL
from scripted_engine import PacedEngine

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.choice_sampling import MAX_CHOICES
from freetoken_agent.integrations.langchain import ChatFreeToken, GenerationError
from freetoken_agent.service import EngineService, service_for

TOOL = LOOKUP_TOOL


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    engine = Engine.load(path, device="cpu", progress=False, kv_tokens=8192, max_model_len=2048)
    yield engine
    service_for(engine).close()


def _text(rng: random.Random, lo: int = 3, hi: int = 12) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(rng.randint(lo, hi))
    )


def _answers(llm: ChatFreeToken, prompt: str, **options) -> list[str]:
    (generations,) = llm.generate([[HumanMessage(prompt)]], **options).generations
    return [g.message.content for g in generations]


def test_seeded_choices_differ_and_each_is_its_seeds_single_call(engine, rng_seed):
    rng = random.Random(rng_seed)
    n, seed = rng.randint(2, 4), rng.randrange(2**31)
    llm = ChatFreeToken(engine=engine, max_tokens=10, temperature=1.0, seed=seed, n=n)
    prompt = _text(rng)
    answers = _answers(llm, prompt)
    assert len(answers) == n and len(set(answers)) > 1, answers
    assert _answers(llm, prompt) == answers
    for i, answer in enumerate(answers):
        assert _answers(llm, prompt, n=1, seed=seed + i) == [answer], (i, seed)
    result = asyncio.run(llm.agenerate([[HumanMessage(prompt)]]))
    assert [g.message.content for g in result.generations[0]] == answers


def test_greedy_choices_are_identical_and_n_may_be_a_call_option(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, max_tokens=8, temperature=0)
    prompt = _text(rng)
    (alone,) = _answers(llm, prompt)
    assert _answers(llm, prompt, n=3) == [alone] * 3


def test_forced_tool_calls_are_made_by_every_choice(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, max_tokens=40, temperature=1.0, seed=rng.randrange(2**31))
    n = rng.randint(2, 3)
    result = llm.generate([[HumanMessage(_text(rng))]], tools=[TOOL], tool_choice="required", n=n)
    (generations,) = result.generations
    assert len(generations) == n
    for g in generations:
        (call,) = g.message.tool_calls
        assert call["name"] == "lookup" and set(call["args"]) == {"q"}, g.message
        assert g.generation_info["finish_reason"] == "tool_calls"


def test_the_later_choices_reuse_the_prompt(tmp_path, rng_seed):
    """A prompt of a few hundred tokens, prefilled 64 a step: choices started beside the first
    would prefill it too (the cache takes it only once its prefill ends)."""
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=8192, max_model_len=2048, max_batched_tokens=64)  # fmt: skip
    try:
        for way in ("sync", "async"):
            llm = ChatFreeToken(engine=engine, max_tokens=3, temperature=1.0)
            prompt = _text(rng, 60, 90)
            n = rng.randint(2, 4)
            before = dict(engine.outcomes.totals)
            if way == "sync":
                result = llm.generate([[HumanMessage(prompt)]], n=n)
            else:
                result = asyncio.run(llm.agenerate([[HumanMessage(prompt)]], n=n))
            reused = engine.outcomes.totals["reused"] - before["reused"]
            prefilled = engine.outcomes.totals["prefilled"] - before["prefilled"]
            length = result.generations[0][0].message.usage_metadata["input_tokens"]
            page, where = engine.kv.page_size, (way, reused, prefilled, length)
            assert reused >= (n - 1) * (length - page), where
            assert prefilled <= length + (n - 1) * page, where
    finally:
        service_for(engine).close()


@pytest.mark.parametrize("way", ["sync", "async"])
def test_a_failing_choice_raises_and_ends_the_others(engine, rng_seed, way):
    rng = random.Random(rng_seed)
    fake = PacedEngine(engine)
    fake.slow_after = 1
    service = EngineService(fake)
    try:
        n = rng.randint(2, 4)
        problem = f"boom {_text(rng, 1, 2)}"
        fake.replies = [(_text(rng, 300, 300), "stop")] + [("", "error", problem)] * (n - 1)
        llm = ChatFreeToken(engine=service, max_tokens=2000, n=n)
        with pytest.raises(GenerationError, match=problem):
            if way == "sync":
                llm.generate([[HumanMessage("ka lo")]])
            else:
                asyncio.run(llm.agenerate([[HumanMessage("ka lo")]]))
        # An abort never waits for the engine's lock (service.py): one asked while the engine
        # stepped is applied under the lock's next holder, which stats() is.
        service.stats()
        with service.lock:  # the long one was aborted, not run to its end (a choice may not
            # have started at all: a sibling's error cancelled the group first)
            assert not fake.running and 1 <= fake.finished < fake.submitted <= n
    finally:
        service.close()


def test_streaming_refuses_more_than_one_choice(engine):
    with pytest.raises(ValueError, match="n must be 1 when streaming"):
        ChatFreeToken(engine=engine, n=2, streaming=True)
    for bad in (0, -1):  # (pydantic reads True as 1, as ChatOpenAI's field does)
        with pytest.raises(ValueError, match="n must be"):
            ChatFreeToken(engine=engine, n=bad)
    llm = ChatFreeToken(engine=engine, max_tokens=3)
    with pytest.raises(ValueError, match="n must be 1 when streaming"):
        list(llm.stream("ka lo", n=2))
    assert list(llm.stream("ka lo", n=1))


def test_n_is_in_the_cache_key(engine, rng_seed):
    rng = random.Random(rng_seed)
    base = ChatFreeToken(engine=engine, max_tokens=4)
    other = ChatFreeToken(engine=engine, max_tokens=4, n=rng.randint(2, 9))
    assert base._get_llm_string() != other._get_llm_string()


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1])
def test_a_choice_count_outside_the_servers_range_is_refused(engine, n):
    """The server's cap (choice_sampling.MAX_CHOICES), for the same reason: each choice is an
    engine request of its own."""
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 16\]"):
        ChatFreeToken(engine=engine, n=n)


def test_async_choices_wait_for_the_first_in_one_thread(engine, rng_seed, monkeypatch):
    """The later choices of an async call wait for the first one's prompt in one executor
    thread between them, not one each (the loop's default executor is the process's)."""
    rng = random.Random(rng_seed)
    n = rng.randint(3, 6)
    waits = []
    to_thread = asyncio.to_thread

    def counted(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "wait" and isinstance(
            getattr(fn, "__self__", None), threading.Event
        ):
            waits.append(fn)
        return to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    llm = ChatFreeToken(engine=engine, max_tokens=4, temperature=1.0, n=n)
    result = asyncio.run(llm.agenerate([[HumanMessage(_text(rng))]]))
    assert len(result.generations[0]) == n
    assert len(waits) == 1, len(waits)
