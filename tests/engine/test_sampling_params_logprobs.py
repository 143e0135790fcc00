"""SamplingParams.logprobs: None, or a count of top alternatives in [0, MAX_LOGPROBS]; anything
else is refused naming the field (the server reads `fields` for its `param`)."""

from __future__ import annotations

import random

import pytest

from freetoken_agent.engine.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
)


def _bad(rng: random.Random):
    return rng.choice(
        [
            -rng.randint(1, 10**6),
            MAX_LOGPROBS + rng.randint(1, 10**6),
            True,  # a bool is an int to Python: True must not mean 1
            False,
            rng.uniform(0.1, MAX_LOGPROBS - 0.1),
            float("nan"),
            str(rng.randint(0, MAX_LOGPROBS)),
            [rng.randint(0, MAX_LOGPROBS)],
        ]
    )


def test_bad_logprobs_are_refused_naming_the_field(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(30):
        value = _bad(rng)
        with pytest.raises(SamplingParamsError) as caught:
            SamplingParams(logprobs=value, temperature=rng.choice([0, 0.7]))
        assert caught.value.fields == ("logprobs",), (rng_seed, value)
        assert "logprobs" in str(caught.value)


def test_bad_logprobs_beside_another_problem_name_both(rng_seed):
    rng = random.Random(rng_seed)
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(logprobs=_bad(rng), max_tokens=-rng.randint(1, 9))
    assert set(caught.value.fields) == {"logprobs", "max_tokens"}, rng_seed


def test_valid_logprobs_are_kept(rng_seed):
    rng = random.Random(rng_seed)
    for k in [None, 0, MAX_LOGPROBS, *rng.sample(range(1, MAX_LOGPROBS), 3)]:
        assert SamplingParams(logprobs=k).logprobs == k, rng_seed
    assert SamplingParams().logprobs is None  # off unless asked
