"""EngineService: many callers on one engine, each seeing exactly its own tokens."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from freetoken_agent import Engine, SamplingParams, Session
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.service import EngineService


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=512)


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(3, 300) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def test_threads_streaming_at_once_get_their_own_greedy_tokens(engine, rng_seed):
    rng = random.Random(rng_seed)
    prompts = _prompts(rng, 4)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [engine.generate(p, sp).token_ids for p in prompts]
    got: dict[int, list[int]] = {}
    with EngineService(engine) as service:

        def read(i: int) -> None:
            got[i] = [e.token_id for e in service.stream(prompts[i], sp) if e.token_id is not None]

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got[i] for i in range(len(prompts))] == alone
        stats = service.stats()["requests"]
        assert stats["running"] == stats["waiting"] == 0 and stats["finished"] >= 8
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_overlap_scheduling_under_the_service(model_dir, rng_seed):
    """An engine with overlap scheduling behind the service: concurrent streams get the plain
    engine's tokens and text, a stop string included (its lagged row is dropped)."""
    rng = random.Random(rng_seed)
    plain = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=512)
    prompts = _prompts(rng, 3)
    sps = [SamplingParams(max_tokens=rng.randint(8, 16), temperature=0, ignore_eos=True)
           for _ in prompts]  # fmt: skip
    free = plain.generate(prompts[0], sps[0])
    cut = rng.randint(2, len(free.text) - 2)
    sps[0] = SamplingParams(max_tokens=sps[0].max_tokens, temperature=0, ignore_eos=True,
                            stop=[free.text[cut - 2 : cut]])  # fmt: skip
    want = [plain.generate(p, sp) for p, sp in zip(prompts, sps, strict=True)]
    engine = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=512, overlap_schedule=True)  # fmt: skip
    got: dict[int, list] = {}
    with EngineService(engine) as service:

        def read(i: int) -> None:
            got[i] = list(service.stream(prompts[i], sps[i]))

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    for i, out in enumerate(want):
        events = got[i]
        assert [e.token_id for e in events if e.token_id is not None] == out.token_ids
        assert "".join(e.text for e in events) == out.text
        assert events[-1].finish_reason == out.finish_reason
    assert want[0].finish_reason == "stop"
    assert engine.stats()["overlap"]["lagged_steps"] > 0
    engine.check_integrity()


def test_async_readers_and_a_cancelled_one(engine, rng_seed):
    rng = random.Random(rng_seed)
    prompts = _prompts(rng, 3)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = [engine.generate(p, sp).token_ids for p in prompts[:2]]
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main(service: EngineService):
        async def read(p) -> list[int]:
            return [e.token_id async for e in service.astream(p, sp) if e.token_id is not None]

        async def abandoned() -> int:
            seen = 0
            async for event in service.astream(prompts[2], long):
                seen += event.token_id is not None
                if seen == 3:
                    break  # the client went away: the request must be aborted
            return seen

        return await asyncio.gather(read(prompts[0]), read(prompts[1]), abandoned())

    with EngineService(engine) as service:
        first, second, seen = asyncio.run(main(service))
        assert [first, second] == alone and seen == 3
        with service.lock:
            assert not engine.has_unfinished()  # the abandoned one no longer runs
            engine.check_integrity()


def test_bad_input_fails_in_the_caller_and_others_go_on(engine, rng_seed):
    rng = random.Random(rng_seed)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with EngineService(engine) as service:
        with pytest.raises(InvalidRequestError, match="tokens"):
            list(service.stream([rng.randrange(3, 300) for _ in range(600)], sp))
        tokens = [e.token_id for e in service.stream(_prompts(rng, 1)[0], sp) if e.token_id]
        assert len(tokens) == 5


def test_session_runs_over_the_service(engine, rng_seed):
    rng = random.Random(rng_seed)
    with EngineService(engine) as service:
        session = Session(service, max_tokens=6, temperature=0)
        word = "".join(rng.choice("abcdefgh") for _ in range(6))
        events = list(session.send([{"role": "user", "content": f"say {word}"}]))
        usage = events[-1]
        assert usage.completion_tokens == 6 and usage.prompt_tokens > 0
        events = list(session.send([{"role": "user", "content": f"say {word}"}]))
        assert events[-1].reused_tokens > 0  # the same prompt again: its KV is reused


def test_session_with_the_models_parser_yields_parsed_events(engine, rng_seed):
    """The demo model's template writes Hermes tool calls; the factory's parser turns the
    raw text into content events whose text is exactly what was generated."""
    import re

    from freetoken_agent.parsers import (
        ContentDelta,
        ParseWarning,
        ReasoningDelta,
        ToolCallStart,
        parser_factory_for,
    )

    rng = random.Random(rng_seed)
    session = Session(engine, max_tokens=8, temperature=0)
    word = "".join(rng.choice("abcdefgh") for _ in range(5))
    raw = list(session.send([{"role": "user", "content": word}], parser_factory=None))
    text = "".join(e.text for e in raw[:-1])
    factory = parser_factory_for(engine)
    session = Session(engine, max_tokens=8, temperature=0, parser_factory=factory)
    events = list(session.send([{"role": "user", "content": word}]))
    assert all(type(e).__name__ != "TextDelta" for e in events)
    if "<tool_call>" in text:
        assert any(isinstance(e, ToolCallStart | ParseWarning) for e in events)
    else:  # the same greedy text, split into reasoning and content (tags and spacing aside)
        parsed = "".join(e.text for e in events if isinstance(e, ContentDelta | ReasoningDelta))
        assert re.sub(r"\s|</?think>", "", parsed) == re.sub(r"\s|</?think>", "", text)


def test_idle_service_polls_memory_and_a_failed_poll_keeps_it_alive(engine, rng_seed, monkeypatch):
    """An idle engine still follows free device memory (another program may take or release
    VRAM between agent turns): the service's thread wakes every IDLE_POLL_S to call
    poll_memory, and a poll that raises is logged, not fatal."""
    import freetoken_agent.service as service_mod

    monkeypatch.setattr(service_mod, "IDLE_POLL_S", 0.01)
    polls, fail_at = [], random.Random(rng_seed).randint(1, 3)

    def poll():
        polls.append(1)
        if len(polls) == fail_at:
            raise RuntimeError("simulated driver error")

    monkeypatch.setattr(engine, "poll_memory", poll, raising=False)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with EngineService(engine) as service:
        deadline = threading.Event()
        for _ in range(200):
            if len(polls) > fail_at + 2:
                break
            deadline.wait(0.01)
        assert len(polls) > fail_at + 2  # went on polling after the failure
        out = [e.token_id for e in service.stream([5, 6, 7], sp) if e.token_id is not None]
        assert len(out) == 4  # and still serves requests
