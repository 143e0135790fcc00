"""SamplingParams.logprobs and prompt_logprobs: None, or a count of top alternatives in
[0, MAX_LOGPROBS]; anything else is refused naming the field (the server reads `fields` for its
`param`). max_tokens 0 (a prompt-only request) only with prompt_logprobs."""

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


FIELDS = ["logprobs", "prompt_logprobs"]


@pytest.mark.parametrize("field", FIELDS)
def test_bad_logprobs_are_refused_naming_the_field(rng_seed, field):
    rng = random.Random(rng_seed)
    for _ in range(30):
        value = _bad(rng)
        with pytest.raises(SamplingParamsError) as caught:
            SamplingParams(**{field: value}, temperature=rng.choice([0, 0.7]))
        assert caught.value.fields == (field,), (rng_seed, value)
        assert field in str(caught.value)


@pytest.mark.parametrize("field", FIELDS)
def test_bad_logprobs_beside_another_problem_name_both(rng_seed, field):
    rng = random.Random(rng_seed)
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**{field: _bad(rng)}, max_tokens=-rng.randint(1, 9))
    assert set(caught.value.fields) == {field, "max_tokens"}, rng_seed


@pytest.mark.parametrize("field", FIELDS)
def test_valid_logprobs_are_kept(rng_seed, field):
    rng = random.Random(rng_seed)
    for k in [None, 0, MAX_LOGPROBS, *rng.sample(range(1, MAX_LOGPROBS), 3)]:
        assert getattr(SamplingParams(**{field: k}), field) == k, rng_seed
    assert getattr(SamplingParams(), field) is None  # off unless asked


def test_no_token_asked_only_with_prompt_logprobs(rng_seed):
    """max_tokens 0 is a prompt-only request when the prompt's entries are asked for; without
    them it would compute nothing for anyone, and is refused naming max_tokens (and saying
    what would make it valid)."""
    rng = random.Random(rng_seed)
    k = rng.randint(0, MAX_LOGPROBS)
    assert SamplingParams(max_tokens=0, prompt_logprobs=k).max_tokens == 0
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(max_tokens=0, logprobs=rng.choice([None, k]))
    assert caught.value.fields == ("max_tokens",), rng_seed
    assert "prompt_logprobs" in str(caught.value), caught.value
    for bad in (-rng.randint(1, 9), True, False, 0.0):  # below 0, or not an integer: still
        with pytest.raises(SamplingParamsError) as caught:
            SamplingParams(max_tokens=bad, prompt_logprobs=k)
        assert caught.value.fields == ("max_tokens",), (rng_seed, bad)
