"""Engines ChatFreeToken loads by path live for the process, once per settings; one that was
closed is loaded again, not handed out to refuse every request."""

from __future__ import annotations

import random

import pytest

from freetoken_agent import SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain_runtime import load_service


@pytest.mark.parametrize("closing", ["service", "engine"])
def test_a_closed_engine_is_loaded_again(tmp_path, rng_seed, closing):
    rng = random.Random(rng_seed)
    path = str(ensure_demo_model(tmp_path))
    options = {"kv_tokens": 1024 + 64 * rng.randrange(8), "max_model_len": 512}
    first = load_service(path, "cpu", "resident", None, options)
    assert load_service(path, "cpu", "resident", None, options) is first  # once per settings
    first.close() if closing == "service" else first.engine.close()
    again = load_service(path, "cpu", "resident", None, options)
    assert again is not first and not again.closed and first.closed
    prompt = [rng.randrange(3, 900) for _ in range(8)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    events = list(again.stream(prompt, sp))
    assert [e.finish_reason for e in events] == [None] * 3 + ["length"]
    again.close()


def test_an_engine_handed_to_chatfreetoken_is_let_go_with_the_last_model(tmp_path, rng_seed):
    """ChatFreeToken(engine=...) started a service that held the engine for the program's life
    (a notebook cell run again kept every engine it loaded). The service is released when the
    last model sharing it is collected (a copy shares it, and keeps answering): its thread
    stops and the engine can be collected."""
    import gc
    import weakref

    from freetoken_agent import ChatFreeToken, Engine

    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=1024, max_model_len=512)  # fmt: skip
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=rng.randint(2, 5))
    question = " ".join(random_words(rng))
    first = llm.invoke(question).content
    copy = llm.model_copy()
    service, engine_ref = llm._service, weakref.ref(engine)
    del llm
    gc.collect()
    assert copy.invoke(question).content == first  # the copy's pool holds the service
    del copy, engine
    gc.collect()
    service._thread.join(timeout=30)
    assert service.closed and not service._thread.is_alive()
    del service
    gc.collect()
    assert engine_ref() is None, gc.get_referrers(engine_ref())


@pytest.mark.parametrize("how", ["deepcopy", "model_copy"])
@pytest.mark.parametrize("given", [False, True])
def test_a_deep_copy_shares_the_engine(tmp_path, rng_seed, how, given):
    """copy.deepcopy and model_copy(deep=True) of a model that has run: they failed on the
    engine's lock (an RLock cannot be copied). The copy shares the engine, its service and
    session pool, keeps its own fields, and answers as the original does."""
    import copy

    from freetoken_agent import ChatFreeToken, Engine

    rng = random.Random(rng_seed)
    path = ensure_demo_model(tmp_path)
    if given:
        engine = Engine.load(path, device="cpu", progress=False, kv_tokens=1024,
                             max_model_len=512)  # fmt: skip
        llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=rng.randint(2, 5))
    else:
        llm = ChatFreeToken(model=str(path), device="cpu", temperature=0,
                            max_tokens=rng.randint(2, 5),
                            engine_options={"kv_tokens": 1024, "max_model_len": 512})  # fmt: skip
    llm.stop = ["zz"]
    question = " ".join(random_words(rng))
    first = llm.invoke(question).content
    twin = copy.deepcopy(llm) if how == "deepcopy" else llm.model_copy(deep=True)
    assert twin._pool is llm._pool and twin._service is llm._service
    assert twin.engine is llm.engine
    assert twin.stop == ["zz"] and twin.stop is not llm.stop  # its own fields, copied
    assert twin.invoke(question).content == first


def random_words(rng: random.Random) -> list[str]:
    return ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6))) for _ in range(5)]
