"""ChatFreeToken's sampling options reach SamplingParams: the logits processors' fields
(presence_penalty, frequency_penalty and logit_bias as ChatOpenAI names them, vLLM's
repetition_penalty, min_p, min_tokens and thinking_token_budget) as the model's fields and per
call, the call's winning; a bad value is a ValueError naming the field before anything runs."""

from __future__ import annotations

import random

import pytest

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken

FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
          "logit_bias", "thinking_token_budget")  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def _values(rng: random.Random) -> dict:
    return {
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.uniform(-2, 2),
        "repetition_penalty": rng.uniform(0.1, 4),
        "min_p": rng.random(),
        "min_tokens": rng.randint(1, 4),  # the calls' max_tokens is 4
        "logit_bias": {rng.randrange(300): rng.uniform(-100, 100) for _ in range(3)},
        "thinking_token_budget": rng.randint(0, 64),
    }


def test_fields_and_call_options_reach_sampling_params(scripted, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted
    fields, calls = _values(rng), _values(rng)
    fake.replies = [("ok", "stop")] * 3
    llm = ChatFreeToken(engine=service, max_tokens=4, **fields)
    llm.invoke("ka lo")
    assert {f: getattr(fake.samplings[-1], f) for f in FIELDS} == fields
    overridden = rng.sample(FIELDS, rng.randint(1, len(FIELDS)))
    llm.invoke("ka lo", **{f: calls[f] for f in overridden})
    want = {f: calls[f] if f in overridden else fields[f] for f in FIELDS}
    assert {f: getattr(fake.samplings[-1], f) for f in FIELDS} == want, overridden
    ChatFreeToken(engine=service, max_tokens=4).invoke("ka lo")  # none given: nothing asked
    assert not fake.samplings[-1].processes_logits and fake.samplings[-1].min_p == 0


def test_a_bad_value_is_a_value_error_naming_it(scripted, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted
    bad = {"presence_penalty": 3.0, "frequency_penalty": -2.5, "repetition_penalty": 0.0,
           "min_p": 1.5, "min_tokens": rng.choice([-1, 5]), "logit_bias": {-1: 5.0},
           "thinking_token_budget": rng.choice([-1, 2.5])}  # fmt: skip
    field = rng.choice(FIELDS)
    with pytest.raises(ValueError, match=field):
        ChatFreeToken(engine=service, max_tokens=4).invoke("ka", **{field: bad[field]})
    assert fake.submitted == 0


def test_string_token_ids_in_logit_bias_work_per_call_as_in_the_field(scripted, rng_seed):
    """The OpenAI SDK types logit_bias keys as strings of digits: the model's field converts
    them (pydantic), and a call's option or a bind must take them alike."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    fake.replies = [("ok", "stop")] * 2
    bias = {str(rng.randrange(300)): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}
    want = {int(k): v for k, v in bias.items()}
    llm = ChatFreeToken(engine=service, max_tokens=4)
    llm.invoke("ka lo", logit_bias=bias)
    assert fake.samplings[-1].logit_bias == want, bias
    llm.bind(logit_bias=bias).invoke("ka lo")
    assert fake.samplings[-1].logit_bias == want, bias


def test_the_cache_key_tells_logprobs_stop_and_the_processors_apart(scripted, rng_seed):
    """LangChain caches by the model's identifying params (ChatFreeToken is not serialisable):
    two models differing only in one sampling field must not share a cached reply (one asked
    for logprobs would get the other's reply without them)."""
    rng = random.Random(rng_seed)
    _, service = scripted
    base = ChatFreeToken(engine=service, max_tokens=4)
    fields = [("logprobs", True), ("top_logprobs", rng.randint(1, 20)), ("stop", ["zz"]),
              ("logit_bias", {rng.randrange(300): 5.0}), ("min_p", rng.random()),
              ("min_tokens", rng.randint(1, 4))]  # fmt: skip
    for field, value in fields:
        other = ChatFreeToken(engine=service, max_tokens=4, **{field: value})
        assert base._get_llm_string() != other._get_llm_string(), field
