"""The logits processors' fields on the wire: presence_penalty, frequency_penalty and
logit_bias (OpenAI's), repetition_penalty, min_p and min_tokens (vLLM's) reach SamplingParams
from chat and text completions and the WebSocket `send`; a bad value is a 400 naming the field
(min_tokens past max_tokens too); a logit_bias id outside the model's vocabulary is refused by
the engine, naming logit_bias too; min_tokens holds back a likely end through the server."""

from __future__ import annotations

import random

import pytest

from freetoken_agent import SamplingParams

ROUTES = ["/v1/chat/completions", "/v1/completions"]


def _body(route: str, rng: random.Random, **extra) -> dict:
    if route == "/v1/completions":
        return {"prompt": "ka lo mi", "max_tokens": 4, **extra}
    return {"messages": [{"role": "user", "content": "ka lo mi"}], "max_tokens": 4, **extra}


def _fields(rng: random.Random) -> dict:
    return {
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.choice([-2, 2, rng.uniform(-2, 2)]),
        "repetition_penalty": rng.uniform(0.05, 5),
        "min_p": rng.choice([0, 1, rng.random()]),
        "min_tokens": rng.randint(1, 3),  # the bodies' max_tokens is 3 or 4
        "logit_bias": {str(rng.randrange(300)): rng.uniform(-100, 100) for _ in range(3)},
    }


@pytest.mark.parametrize("route", ROUTES)
def test_the_fields_reach_sampling_params(scripted_client, rng_seed, route):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    fields = _fields(rng)
    fake.replies = [("ok", "stop"), ("ok", "stop")]
    r = client.post(route, json=_body(route, rng, **fields))
    assert r.status_code == 200, r.text
    sp = fake.samplings[-1]
    for key in (
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
    ):
        assert getattr(sp, key) == fields[key], (key, sp)
    assert sp.logit_bias == {int(k): v for k, v in fields["logit_bias"].items()}
    # Left out, or null, they ask for nothing.
    r = client.post(route, json=_body(route, rng, **{k: None for k in fields}))
    assert r.status_code == 200, r.text
    assert not fake.samplings[-1].processes_logits and fake.samplings[-1].min_p == 0


BAD = {
    "presence_penalty": [2.5, -3, "1", True],
    "frequency_penalty": [-2.01, 7, [1]],
    "repetition_penalty": [0, -1, "x", False],
    "min_p": [1.5, -0.1, "0.1"],
    "min_tokens": [-1, 1.5, "2", True, 5],  # 5: past the bodies' max_tokens
    "logit_bias": [{"x": 1}, {"-5": 1}, {"1.5": 2}, {"7": 101}, {"7": "5"}, {"7": None}, [1, 2],
                   "7:1", {"٣": 1}],
}  # fmt: skip


@pytest.mark.parametrize("route", ROUTES)
def test_bad_values_are_refused_naming_the_field(scripted_client, api_error, rng_seed, route):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    for field, values in BAD.items():
        value = rng.choice(values)
        error = api_error(client.post(route, json=_body(route, rng, **{field: value})), 400)
        assert error["param"] == field, (field, value, error)
    assert fake.submitted == 0


def test_the_websocket_send_takes_them(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    fields = _fields(rng)
    fake.replies = [("ok", "stop")]
    user = [{"role": "user", "content": "ka lo"}]
    with client.websocket_connect("/v1/sessions/pen/ws") as ws:
        ws.receive_json(), ws.receive_json()  # the session, the memory split
        ws.send_json({"type": "send", "messages": user, "sampling": {"max_tokens": 3, **fields}})
        while (event := ws.receive_json())["type"] != "done":
            assert event["type"] != "error", event
        sp = fake.samplings[-1]
        assert (sp.presence_penalty, sp.min_p) == (fields["presence_penalty"], fields["min_p"])
        assert sp.min_tokens == fields["min_tokens"]
        assert sp.logit_bias == {int(k): v for k, v in fields["logit_bias"].items()}
        bad = rng.choice(sorted(BAD))
        sampling = {"max_tokens": 3, bad: rng.choice(BAD[bad])}
        ws.send_json({"type": "send", "messages": user, "sampling": sampling})
        error = ws.receive_json()
        assert error["type"] == "error" and error["param"] == bad, error


@pytest.mark.parametrize("route", ROUTES)
def test_the_engine_refuses_an_id_outside_the_vocabulary(
    engine, make_client, api_error, rng_seed, route
):
    rng = random.Random(rng_seed)
    client = make_client()
    bad = engine.spec.vocab_size + rng.randrange(10**6)
    bias = {str(rng.randrange(engine.spec.vocab_size)): 1, str(bad): -1}
    error = api_error(client.post(route, json=_body(route, rng, logit_bias=bias)), 400)
    assert error["param"] == "logit_bias" and str(bad) in error["message"], error


def test_a_large_bias_forces_the_token_through_the_server(engine, make_client, rng_seed):
    rng = random.Random(rng_seed)
    forced = rng.choice(engine.tokenizer.encode(" ka lo mi ne"))
    prompt = [rng.randrange(3, 200) for _ in range(rng.randint(2, 9))]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={forced: 100})
    alone = engine.generate(prompt, sp)  # before the server owns the engine
    assert alone.token_ids == [forced] * 5, (alone.token_ids, rng_seed)
    client = make_client()
    body = {"prompt": prompt, "max_tokens": 5, "temperature": rng.choice([0, 1]),
            "ignore_eos": True, "logit_bias": {str(forced): 100}}  # fmt: skip
    r = client.post("/v1/completions", json=body).json()
    assert r["choices"][0]["text"] == alone.text and r["usage"]["completion_tokens"] == 5, r


@pytest.mark.parametrize("route", ROUTES)
def test_refusals_at_the_edges_are_400s_naming_the_field(scripted_client, api_error, rng_seed,
                                                        route):  # fmt: skip
    """A logit_bias key too long for int() (over 4,300 digits: a ValueError, a 500 once) and
    a repetition penalty so small or large that fp32 turns a logit into inf or NaN (which
    then failed the request as the model's fault)."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    key = str(rng.randint(1, 9)) + "".join(
        rng.choice("0123456789") for _ in range(rng.randint(19, 6000))
    )
    error = api_error(client.post(route, json=_body(route, rng, logit_bias={key: 1})), 400)
    assert error["param"] == "logit_bias", error
    for value in (rng.uniform(1e-45, 0.0099), rng.uniform(100.01, 1e38)):
        body = _body(route, rng, repetition_penalty=value)
        error = api_error(client.post(route, json=body), 400)
        assert error["param"] == "repetition_penalty", (value, error)
    assert fake.submitted == 0


@pytest.mark.parametrize("route", ROUTES)
def test_min_tokens_holds_back_a_likely_end(engine, make_client, rng_seed, route):
    """EOS made the likeliest token: without min_tokens the completion is that one token,
    with min_tokens m it is m + 1 tokens, the last EOS (not shown: its text is empty)."""
    rng = random.Random(rng_seed)
    eos = rng.choice(sorted(engine.eos_token_ids))
    client = make_client()
    m = rng.randint(1, 9)
    body = _body(route, rng, max_tokens=m + rng.randint(1, 5), logit_bias={str(eos): 100},
                 temperature=rng.choice([0, 1]))  # fmt: skip
    for min_tokens, want in ((None, 1), (m, m + 1)):
        r = client.post(route, json={**body, "min_tokens": min_tokens}).json()
        assert r["usage"]["completion_tokens"] == want, (min_tokens, r)
        assert r["choices"][0]["finish_reason"] == "stop", r
