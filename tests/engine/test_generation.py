"""Engine-level generation: chunked prefill, seeds, stop conditions, streaming, aborts."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams


@pytest.fixture
def model_dir(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    return tmp_path


def _load(path, dtype=None, **options) -> Engine:
    return Engine.load(path, device="cpu", dtype=dtype, progress=False, kv_tokens=4096, **options)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 320) for _ in range(n)]


def test_chunked_prefill_matches_whole_prefill(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    ids = _prompt(rng, 150)
    # float64: in fp32 the different GEMM shapes of chunks can flip a near-tied router choice.
    whole = _load(model_dir, max_batched_tokens=2048, dtype="float64")
    chunked = _load(model_dir, max_batched_tokens=16, max_num_seqs=4, dtype="float64")
    assert max_rel_err(chunked.score(ids), whole.score(ids)) <= 1e-12
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert chunked.generate(ids, sp).token_ids == whole.generate(ids, sp).token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    engine = _load(model_dir)
    prompt = _prompt(rng, 20)
    sp = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=rng_seed, ignore_eos=True)
    alone = engine.generate(prompt, sp).token_ids
    others = SamplingParams(max_tokens=30, temperature=1.2, ignore_eos=True)
    outs = engine.generate([_prompt(rng, 9), prompt, _prompt(rng, 33)], [others, sp, others])
    assert outs[1].token_ids == alone
    unseeded = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    draws = {tuple(engine.generate(prompt, unseeded).token_ids) for _ in range(3)}
    assert len(draws) > 1  # unseeded sampling really samples


def test_stop_token_ids_and_max_tokens(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    engine = _load(model_dir)
    prompt = _prompt(rng, 12)
    free = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_at = free.token_ids[7]
    first = free.token_ids.index(stop_at)
    sp = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at], ignore_eos=True)
    out = engine.generate(prompt, sp)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    # The model's eos id (2) ends generation unless ignore_eos.
    eos_engine = _load(model_dir)
    assert 2 in eos_engine.eos_token_ids


def test_stream_events_and_early_close(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    engine = _load(model_dir)
    prompt = _prompt(rng, 30)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    events = list(engine.stream(prompt, sp))
    assert [e.index for e in events] == list(range(10))
    assert [e.finished for e in events] == [False] * 9 + [True]
    assert [e.token_id for e in events] == engine.generate(prompt, sp).token_ids
    stream = engine.stream(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    stream.close()  # the client went away: the request is aborted, its pages released
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.stats()["requests"]["running"] == 0


def test_abort_mid_batch_leaves_others_intact(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    engine = _load(model_dir)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    p1, p2 = _prompt(rng, 25), _prompt(rng, 40)
    ref = engine.generate(p2, sp).token_ids
    r1, r2 = engine.submit(p1, sp), engine.submit(p2, sp)
    engine.step()
    engine.step()
    engine.abort(r1)
    while engine.has_unfinished():
        engine.step()
    assert engine._collect(r2).token_ids == ref
    assert engine._collect(r1).finish_reason == "abort"
    engine.check_integrity()


def test_score_is_placement_of_tokens_not_of_batching(model_dir, rng_seed):
    """score() of a sequence equals the logits generation sees at its last position."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir)
    ids = _prompt(rng, 40)
    logits = engine.score(ids)
    out = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    assert out.token_ids[0] == int(torch.argmax(logits[-1]))


def test_auto_ids_skip_ids_a_client_chose(model_dir, rng_seed):
    """A client may name its requests `req-N`, the form of the engine's own ids: an id-less
    submit then takes the next free one instead of failing."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    chosen = {f"req-{n}" for n in rng.sample(range(8), rng.randint(2, 5))}
    for rid in chosen:
        engine.submit(_prompt(rng, 5), sp, request_id=rid)
    auto = [engine.submit(_prompt(rng, 5), sp) for _ in range(8)]
    assert len(set(auto)) == len(auto) and not chosen & set(auto)
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("call", ["generate", "score"])
def test_an_interrupted_generate_or_score_leaves_nothing_running(model_dir, rng_seed, call):
    """Ctrl-C out of a step (a KeyboardInterrupt raised by step) inside generate or score:
    what it submitted is aborted and dropped, and the next call runs alone."""
    rng = random.Random(rng_seed)
    # A prompt takes several steps: the engine raises a 16-token step budget to 32 (a page),
    # and 100+ tokens take at least 4 of them, more than the 1-3 steps before the interrupt
    # (60-token prompts took 2: score finished before the interrupt on some seeds).
    engine = _load(model_dir, max_batched_tokens=16)
    real, steps, stop_at = engine.step, [], rng.randint(1, 3)

    def step():
        steps.append(1)
        if len(steps) == stop_at:
            raise KeyboardInterrupt
        return real()

    engine.step = step
    prompts = [_prompt(rng, rng.randint(100, 160)) for _ in range(3)]
    with pytest.raises(KeyboardInterrupt):
        if call == "generate":
            engine.generate(prompts[:2], SamplingParams(max_tokens=50, ignore_eos=True))
        else:
            engine.score(prompts[2])
    assert not engine.has_unfinished()
    assert engine._requests == {} and engine._events == {} and engine._scores == {}
    engine.check_integrity()
