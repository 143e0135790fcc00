"""How a request's stream ends when it does not end by itself: an aborted request's events add
up to its output's text (text held back for a possible stop string is released at the end), and
stop strings on a model without a tokenizer are refused, not ignored."""

from __future__ import annotations

import json
import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, InvalidRequestError, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model


@pytest.mark.parametrize("overlap", [False, True])
def test_an_aborted_requests_events_add_up_to_its_text(tmp_path, rng_seed, overlap):
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=2048, max_model_len=512, overlap_schedule=overlap)  # fmt: skip
    stop = "".join(rng.choice("qxz") for _ in range(rng.randint(4, 9)))  # long: holds text back
    sp = SamplingParams(max_tokens=40, temperature=rng.choice([0, 0.8]), stop=[stop],
                        ignore_eos=True)  # fmt: skip
    rid = engine.submit([rng.randrange(3, 1000) for _ in range(rng.randint(4, 20))], sp)
    for _ in range(rng.randint(3, 8)):
        engine.step()
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    events = engine.take_events(rid)
    assert events[-1].finish_reason == "abort" and events[-1].finished
    out = engine._collect(rid)
    assert out.text and "".join(e.text for e in events) == out.text


def test_stop_strings_without_a_tokenizer_are_refused(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    assert not (tmp_path / "tokenizer.json").exists()
    engine = Engine.load(tmp_path, device="cpu", progress=False)
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(3, 320) for _ in range(6)]
    with pytest.raises(InvalidRequestError, match="stop strings need the model's tokenizer"):
        engine.submit(prompt, SamplingParams(stop=[json.dumps(rng.random())]))
    out = engine.generate(prompt, SamplingParams(max_tokens=3, stop_token_ids=[5]))
    assert out.finish_reason in ("length", "stop")


def test_a_hand_driven_engine_forgets_what_it_released(tmp_path, rng_seed):
    """submit / step / take_events by hand: a finished request stays in the engine's tables
    (its owner may still read it) until release(), which drops it and frees its id; releasing
    an unfinished one aborts it; an unknown id does nothing."""
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=2048, max_model_len=512)  # fmt: skip
    sp = SamplingParams(max_tokens=rng.randint(2, 6), temperature=0.8, ignore_eos=True)
    ids = [f"job-{i}" for i in range(rng.randint(3, 6))]
    for round_ in range(2):  # the same ids again once released
        for rid in ids:
            engine.submit([rng.randrange(3, 1000) for _ in range(rng.randint(4, 12))], sp, rid)
        while engine.has_unfinished():
            engine.step()
        for rid in ids:
            assert engine.take_events(rid)[-1].finished
            engine.release(rid)
        assert not engine._requests and not engine._outputs and not engine._events, round_
    rid = engine.submit([rng.randrange(3, 1000) for _ in range(8)], sp)
    engine.step()
    engine.release(rid)  # unfinished: aborted and dropped
    while engine.has_unfinished():
        engine.step()
    assert not engine._requests and not engine.has_unfinished()
    engine.release(f"never-{rng.randrange(99)}")
    engine.check_integrity()  # the aborted request's pages back with the pool or the tree


def test_a_request_aborted_before_it_ran_reports_no_prompt_work(tmp_path, rng_seed):
    """One request runs (max_num_seqs 1), a second waits and is aborted before its admission:
    its final event's figures (what its usage reports) are 0 reused and 0 prefilled, not its
    whole prompt as prefilled; the running one's add up to its prompt."""
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=2048, max_model_len=512, max_num_seqs=1)  # fmt: skip
    sp = SamplingParams(max_tokens=rng.randint(4, 12), temperature=0, ignore_eos=True)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(5, 60))] for _ in range(2)]
    first, waiting = (engine.submit(p, sp) for p in prompts)
    engine.step()
    engine.abort(waiting)
    while engine.has_unfinished():
        engine.step()
    (ended,) = [e for e in engine.take_events(waiting) if e.finished]
    assert ended.finish_reason == "abort"
    assert (ended.reused_tokens, ended.prefilled_tokens) == (0, 0)
    (done,) = [e for e in engine.take_events(first) if e.finished]
    assert done.reused_tokens + done.prefilled_tokens == len(prompts[0])
