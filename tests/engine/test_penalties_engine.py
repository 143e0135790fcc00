"""Logit bias and penalties end to end on the CPU (engine/logits_processors.py): greedy
generation with them equals a reference loop that scores the growing sequence from scratch and
applies them in numpy, with overlap scheduling off and on (where the host reads step N's token
only after step N+1 is launched; the counts take it on the device); a penalised request
leaves the tokens of the unpenalised one beside it alone; a large bias forces or bans a token;
preemption by recompute neither loses nor double counts a token.

float64 engines: a re-prefill after preemption, a lagged step's dropped row and the reference's
scoring then compute what decode did, so tokens can be compared exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from penalty_reference import random_penalties, reference_greedy
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.request import Status

VOCAB = 320  # tiny_models' vocabulary


def _load(path, overlap: bool, **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    return Engine.load(path, device="cpu", progress=False, dtype="float64",
                       overlap_schedule=overlap, **options)  # fmt: skip


def _scorer(engine: Engine):
    return lambda ids: engine.score(ids).numpy()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture
def model_dir(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    return tmp_path


def test_greedy_penalties_match_the_reference_and_spare_their_neighbour(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    n = rng.randint(10, 16)
    plain = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    reference = _load(model_dir, False)
    # Each prompt ends with what the model writes after it: tiny models repeat themselves, so
    # the tokens it goes on to pick are in the prompt, where the output penalties must not look
    # and the repetition penalty must.
    prompts = [_prompt(rng, rng.randint(4, 30)) for _ in range(3)]
    ahead = reference.generate(prompts, plain)
    prompts = [p + o.token_ids[:8] for p, o in zip(prompts, ahead, strict=True)]
    # One penalised over its output for sure, one over its prompt too; others at random.
    penalised = [
        random_penalties(rng, VOCAB, max_tokens=n, presence_penalty=rng.uniform(1, 2)),
        random_penalties(rng, VOCAB, max_tokens=n, repetition_penalty=rng.uniform(1.5, 3)),
    ]
    want = [reference_greedy(_scorer(reference), p, sp, n)
            for p, sp in zip(prompts, penalised, strict=False)]  # fmt: skip
    unpenalised = [o.token_ids for o in reference.generate(prompts, [plain] * 3)]
    assert want != unpenalised[:2], f"the penalties changed nothing (seed {rng_seed})"
    for overlap in (False, True):
        engine = _load(model_dir, overlap)
        got = [o.token_ids for o in engine.generate(prompts, [*penalised, plain])]
        where = f"overlap {overlap}, seed {rng_seed}, {penalised}"
        assert got[:2] == want, where
        assert got[2] == unpenalised[2], f"the unpenalised request changed: {where}"
        assert engine.overlap.lagged_steps >= (n - 3 if overlap else 0), where
        assert all(r.token_history is None for r in engine._requests.values()), where


def test_seeded_sampling_with_processors_is_the_same_in_both_loops(model_dir, rng_seed):
    """Sampled rows with penalties, bias and min_p, seeded, beside greedy ones: overlap gives
    the plain loop's tokens (its counts are the device's, the plain loop's too, read later)."""
    rng = random.Random(rng_seed)
    prompts = [_prompt(rng, rng.randint(4, 30)) for _ in range(4)]
    params = []
    for _ in prompts:
        sp = random_penalties(rng, VOCAB, max_tokens=rng.randint(8, 16))
        if rng.random() < 0.75:
            sp.temperature, sp.seed = rng.uniform(0.5, 1.5), rng.randrange(1 << 30)
            sp.min_p, sp.top_k = rng.choice([0.0, rng.uniform(0.01, 0.3)]), rng.choice([0, 20])
        params.append(sp)
    runs = [_load(model_dir, overlap).generate(prompts, params) for overlap in (False, True)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]], f"seed {rng_seed}"


def test_a_large_logit_bias_forces_or_bans_a_token(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    prompt = _prompt(rng, rng.randint(4, 30))
    engine = _load(model_dir, True)
    n = rng.randint(6, 12)
    free = engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    forced = rng.choice([t for t in range(3, VOCAB) if t not in free.token_ids])
    for temperature in (0, 1.0):
        sp = SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True,
                            logit_bias={forced: 100}, seed=rng.randrange(1 << 30))  # fmt: skip
        assert engine.generate(prompt, sp).token_ids == [forced] * n, f"seed {rng_seed}"
    banned = set(free.token_ids)
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                        logit_bias={t: -100 for t in banned})  # fmt: skip
    out = engine.generate(prompt, sp).token_ids
    assert not banned & set(out), (out, banned, rng_seed)


def test_a_logit_bias_outside_the_vocabulary_is_refused_at_submit(model_dir, rng_seed):
    rng = random.Random(rng_seed)
    engine = _load(model_dir, False)
    bad = VOCAB + rng.randrange(0, 10**6)
    sp = SamplingParams(max_tokens=4, logit_bias={rng.randrange(VOCAB): 1.0, bad: -2.0})
    with pytest.raises(InvalidRequestError, match=f"logit_bias token id {bad} ") as caught:
        engine.submit(_prompt(rng, 5), sp)
    assert caught.value.param == "logit_bias"
    assert not engine.has_unfinished() and not engine._requests  # nothing was taken
    after = engine.generate(_prompt(rng, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(after.token_ids) == 3  # the engine serves on


def _check_counts(engine: Engine) -> None:
    """Each running request's device counts hold its output ids and its token in flight."""
    inflight = engine.overlap.inflight
    pending = {}
    if inflight is not None:
        for c, token in zip(inflight.batch.chunks, inflight.tokens.tolist(), strict=True):
            pending[c.request.id] = [token]
    for req in engine._requests.values():
        h = req.token_history
        if req.status is Status.FINISHED or h is None:
            continue
        ids = req.output_ids + pending.get(req.id, [])
        want = np.bincount(np.array(ids, dtype=np.int64), minlength=VOCAB)
        assert np.array_equal(h.generated.numpy(), want), (req.id, ids)


def test_preemption_neither_loses_nor_double_counts(tmp_path, rng_seed):
    """A KV pool too small for three requests to reach the model's length: they preempt one
    another and re-prefill their outputs, then go on with the reference's tokens, in both
    loops; the counts on the device hold each request's tokens after every call."""
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=96)
    rng = random.Random(rng_seed)
    prompts = [_prompt(rng, rng.randint(40, 64)) for _ in range(3)]
    params = [random_penalties(rng, VOCAB, max_tokens=200) for _ in prompts]
    reference = _load(tmp_path, False)
    want = [reference_greedy(_scorer(reference), p, sp, 96 - len(p))
            for p, sp in zip(prompts, params, strict=True)]  # fmt: skip
    for overlap in (False, True):
        engine = _load(tmp_path, overlap, kv_tokens=160, page_size=16)
        rids = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for _ in range(2000):
            engine.step()
            engine.check_integrity()
            _check_counts(engine)
            if not engine.has_unfinished():
                break
        where = f"overlap {overlap}, seed {rng_seed}"
        assert engine.scheduler.preemptions >= 1, where
        assert engine.overlap.lagged_steps >= (5 if overlap else 0), where
        assert [engine._collect(r).token_ids for r in rids] == want, where


def test_history_is_built_only_for_requests_that_ask(model_dir, rng_seed):
    """A plain request holds no device state; a penalised one holds it while it runs and drops
    it at its end, an abort included."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir, rng.random() < 0.5)
    sp = random_penalties(rng, VOCAB, max_tokens=50)
    plain = engine.submit(_prompt(rng, 8), SamplingParams(max_tokens=50, ignore_eos=True))
    rid = engine.submit(_prompt(rng, 8), sp)
    for _ in range(rng.randint(3, 8)):
        engine.step()
    req = engine._requests[rid]
    assert engine._requests[plain].token_history is None
    assert req.token_history is not None
    assert req.token_history.generated.dtype == torch.float64  # the logits' own
    engine.abort(rid)
    assert req.token_history is None, f"seed {rng_seed}"
