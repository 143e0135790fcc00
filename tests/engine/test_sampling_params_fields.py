"""SamplingParams' refusal names the field of each problem (`SamplingParamsError.problems`):
callers (the server's `param`) read the field, not the wording, which may hold "; " itself.
numpy's numbers are taken and stored as Python's."""

from __future__ import annotations

import random

import numpy as np
import pytest

import freetoken_agent
from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
    SamplingParamsError,
)

# One wrong value of each field, as a draw from the kinds of wrong it can be.
BAD = {
    "max_tokens": lambda r: r.choice([0, -r.randint(1, 9), True, 2.5]),
    # Past max_tokens is refused too (a test of its own: a bad max_tokens has no bound).
    "min_tokens": lambda r: r.choice([-r.randint(1, 9), True, 2.5, "3", None]),
    "temperature": lambda r: r.choice([-r.uniform(0.1, 3), float("inf"), float("nan"), "hot"]),
    "top_k": lambda r: r.choice([-r.randint(2, 9), 1.5, None]),  # -1 is vLLM's "off"
    "top_p": lambda r: r.choice([0, 1 + r.uniform(0.01, 2), -0.5]),
    "seed": lambda r: r.choice([2**64 + r.randint(0, 9), 1.5, "s"]),
    "stop": lambda r: r.choice(
        [
            [""],
            ["x"] * (MAX_STOP_STRINGS + r.randint(1, 50)),
            ["ok", "y" * (MAX_STOP_CHARS + r.randint(1, 99))],
        ]
    ),
    "stop_token_ids": lambda r: r.choice([[-r.randint(1, 9)], ["a"], 1.5]),
    "ignore_eos": lambda r: r.choice([1, "yes", None]),
    "include_stop_str_in_output": lambda r: r.choice([1, "yes", None]),
    "response_format": lambda r: r.choice([{"type": "xml"}, "json", {}]),
    "json_schema": lambda r: r.choice([{"type": "thing"}, {"properties": 3}]),
    "grammar": lambda r: r.choice(["", "   ", 5]),
    "presence_penalty": lambda r: _bad_penalty(r),
    "frequency_penalty": lambda r: _bad_penalty(r),
    "repetition_penalty": lambda r: r.choice(
        [
            0,
            -r.uniform(0.01, 5),
            float("inf"),
            float("nan"),
            "2",
            True,
            r.uniform(1e-45, 0.0099),
            r.uniform(100.01, 1e38),
        ]  # fp32 makes a logit inf or NaN
    ),
    "min_p": lambda r: r.choice(
        [-r.uniform(0.001, 1), 1 + r.uniform(0.001, 1), float("nan"), True]
    ),
    "logit_bias": lambda r: r.choice(
        [
            {r.randrange(999): r.choice([-1, 1]) * (100 + r.uniform(0.001, 50))},
            {-r.randint(1, 9): 1.0},
            {str(r.randrange(999)): 1.0},  # a JSON key: the server converts it, not here
            {True: 1.0},
            {r.randrange(999): float("nan")},
            {r.randrange(999): "5"},
            [(r.randrange(999), 1.0)],
        ]
    ),
}


def _bad_penalty(r: random.Random):
    return r.choice([r.choice([-1, 1]) * (2 + r.uniform(0.001, 5)), float("nan"), "1", None])


def test_each_problem_names_its_field(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(40):
        fields = rng.sample(sorted(BAD), rng.randint(1, 3))
        if "grammar" in fields:  # one structured-output problem is reported at a time
            fields = [f for f in fields if f not in ("json_schema", "response_format")]
        if "response_format" in fields:
            fields = [f for f in fields if f != "json_schema"]
        kwargs = {f: BAD[f](rng) for f in fields}
        with pytest.raises(SamplingParamsError) as caught:
            SamplingParams(**kwargs)
        error = caught.value
        assert set(error.fields) == set(fields), (kwargs, error.fields)
        assert str(error) == "; ".join(text for _, text in error.problems)
        for field, text in error.problems:
            assert field in text, (field, text)  # each text is about its field
        assert isinstance(error, ValueError)  # callers catching ValueError still catch it
        assert isinstance(error, freetoken_agent.SamplingParamsError)  # the public name


def test_a_valid_request_is_not_refused(rng_seed):
    rng = random.Random(rng_seed)
    SamplingParams(
        max_tokens=rng.randint(1, 999),
        temperature=rng.uniform(0, 2),
        top_k=rng.randint(0, 50),
        top_p=rng.uniform(0.01, 1),
        seed=rng.randint(0, 2**63),
        stop=["x" * rng.randint(1, MAX_STOP_CHARS)],
        stop_token_ids=[rng.randint(0, 999)],
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.choice([-2, 2, rng.uniform(-2, 2)]),
        repetition_penalty=rng.uniform(0.01, 10),
        min_p=rng.choice([0, 1, rng.random()]),
        logit_bias={rng.randrange(10**6): rng.uniform(-100, 100) for _ in range(rng.randint(0, 9))},
    )


def test_the_processors_neutral_values_ask_for_nothing(rng_seed):
    """The defaults (existing callers) and the same values given explicitly process nothing;
    any one processor field off its neutral value does."""
    rng = random.Random(rng_seed)
    assert not SamplingParams().processes_logits and not SamplingParams().penalised
    neutral = dict(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, min_p=0.0,
                   logit_bias=rng.choice([None, {}]))  # fmt: skip
    assert not SamplingParams(**neutral).processes_logits
    field, value = rng.choice([
        ("presence_penalty", rng.uniform(0.01, 2)),
        ("frequency_penalty", -rng.uniform(0.01, 2)),
        ("repetition_penalty", rng.uniform(1.01, 3)),
        ("logit_bias", {rng.randrange(99): rng.uniform(-1, 1)}),
    ])  # fmt: skip
    sp = SamplingParams(**{**neutral, field: value})
    assert sp.processes_logits and sp.penalised == (field != "logit_bias"), (field, value)
    assert not SamplingParams(min_p=rng.uniform(0.01, 1)).processes_logits  # the sampler's


@pytest.mark.parametrize(
    "field", ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias"]
)
def test_each_processor_field_refuses_its_bad_values(rng_seed, field):
    rng = random.Random(rng_seed)
    for _ in range(8):
        value = BAD[field](rng)
        with pytest.raises(SamplingParamsError) as caught:
            SamplingParams(**{field: value})
        assert caught.value.fields == (field,), (value, caught.value.problems)


def test_top_k_minus_one_is_no_top_k(rng_seed):
    """vLLM's -1 is read as 0 (no filter): the same draws as 0, not a refusal."""
    rng = random.Random(rng_seed)
    params = SamplingParams(top_k=-1, temperature=rng.uniform(0.1, 2))
    assert params.top_k == 0 and not params.greedy


def test_min_tokens_is_bounded_by_max_tokens(rng_seed):
    """vLLM's rule: 0 <= min_tokens <= max_tokens; any min_tokens > 0 processes logits (its
    end is held back), 0 asks for nothing."""
    rng = random.Random(rng_seed)
    n = rng.randint(1, 999)
    assert SamplingParams(max_tokens=n, min_tokens=n).processes_logits
    assert SamplingParams(max_tokens=n, min_tokens=rng.randint(1, n)).processes_logits
    assert not SamplingParams(max_tokens=n, min_tokens=0).processes_logits
    over = n + rng.randint(1, 99)
    with pytest.raises(SamplingParamsError, match=f"min_tokens \\({over}\\)") as caught:
        SamplingParams(max_tokens=n, min_tokens=over)
    assert caught.value.fields == ("min_tokens",)


def test_the_end_ids_are_the_ids_that_end_a_request(rng_seed):
    """`end_ids` (what min_tokens holds back) is what `ends_with` (the accept's rule) says."""
    rng = random.Random(rng_seed)
    eos = frozenset(rng.sample(range(50), rng.randint(0, 3)))
    for _ in range(20):
        sp = SamplingParams(
            stop_token_ids=rng.sample(range(50), rng.randint(0, 4)),
            ignore_eos=rng.random() < 0.5,
            json_schema=rng.choice([None, {"type": "object"}]),
        )
        assert sp.end_ids(eos) == [t for t in range(60) if sp.ends_with(t, eos)], (sp, eos)


def test_min_tokens_refused_with_a_prompt_only_request(rng_seed):
    """max_tokens 0 (a prompt-only request) generates nothing: any min_tokens > 0 asks for
    what it cannot give."""
    rng = random.Random(rng_seed)
    with pytest.raises(SamplingParamsError, match="min_tokens") as caught:
        SamplingParams(max_tokens=0, prompt_logprobs=rng.randint(0, 5),
                       min_tokens=rng.randint(1, 9))  # fmt: skip
    assert caught.value.fields == ("min_tokens",)


def test_numpy_numbers_are_taken_as_pythons(tmp_path, rng_seed):
    """numpy's integers pass the checks (numbers.Integral) and are stored as Python ints: a
    numpy seed drew inside the step through torch, which refuses them, and failed every
    request batched beside it. Here it draws what the same int seed draws, beside another."""
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=2048, max_model_len=512)  # fmt: skip
    seed = rng.randrange(1 << 40)
    prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(4, 12))]

    def params(seed):
        return SamplingParams(max_tokens=np.int64(6), temperature=np.float32(0.9), seed=seed,
                              top_k=np.int32(40), stop_token_ids=[np.int64(5)],
                              logit_bias={np.int64(7): np.float32(1)}, ignore_eos=True)  # fmt: skip

    numpy_params = params(np.int64(seed))
    assert type(numpy_params.seed) is int and type(numpy_params.temperature) is float
    assert type(numpy_params.stop_token_ids[0]) is int
    assert {type(k) for k in numpy_params.logit_bias} == {int}
    other = SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True)
    outs = engine.generate([prompt, prompt[::-1]], [numpy_params, other])
    assert [o.error for o in outs] == [None, None]
    # A draw of the stop id (5) ends it early (seed 3142375138 drew it).
    assert outs[0].finish_reason in ("length", "stop") and outs[1].finish_reason == "length"
    assert outs[0].token_ids == engine.generate(prompt, params(seed)).token_ids
