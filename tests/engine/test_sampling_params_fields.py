"""SamplingParams' refusal names the field of each problem (`SamplingParamsError.problems`):
callers (the server's `param`) read the field, not the wording, which may hold "; " itself."""

from __future__ import annotations

import random

import pytest

import freetoken_agent
from freetoken_agent.engine.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
    SamplingParamsError,
)

# One wrong value of each field, as a draw from the kinds of wrong it can be.
BAD = {
    "max_tokens": lambda r: r.choice([0, -r.randint(1, 9), True, 2.5]),
    "temperature": lambda r: r.choice([-r.uniform(0.1, 3), float("inf"), float("nan"), "hot"]),
    "top_k": lambda r: r.choice([-r.randint(1, 9), 1.5, None]),
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
    "response_format": lambda r: r.choice([{"type": "xml"}, "json", {}]),
    "json_schema": lambda r: r.choice([{"type": "thing"}, {"properties": 3}]),
    "grammar": lambda r: r.choice(["", "   ", 5]),
}


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
    )
