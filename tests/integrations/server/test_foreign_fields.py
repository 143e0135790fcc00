"""Other APIs' fields (foreign_fields.py): honoured, or refused by name, never dropped.

The legacy `functions` / `function_call`, vLLM's guided-decoding, beam-search and token-mask
extensions, a request's own chat template, and `reasoning_effort` on the text route are
refused with a 400 naming the field (their neutral values pass); `stop_token_ids` ends the
generation (repetition_penalty, min_p and min_tokens are honoured:
test_sampling_processors_server.py); `chat_template_kwargs.enable_thinking` renders the
prompt as ChatFreeToken's `reasoning` does, and `reasoning_effort` as the switch it names.
And /v1/completions without max_tokens writes 16 tokens, as at OpenAI and vLLM.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from scripted_engine import ScriptedEngine
from starlette.testclient import TestClient

from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.integrations.server import create_app
from freetoken_agent.service import EngineService

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "zo", "pe", "xi", "qu"]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def _chat(rng: random.Random, **extra) -> dict:
    text = " ".join(_word(rng) for _ in range(rng.randint(1, 5)))
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def _text(rng: random.Random, **extra) -> dict:
    return {"prompt": _word(rng), "max_tokens": 4, **extra}


def test_legacy_functions_are_refused_pointing_at_tools(scripted_client, api_error, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    fn = {"name": _word(rng), "parameters": {"type": "object", "properties": {}}}
    fake.replies = [("hi", "stop")]
    for extra, field, instead in [
        ({"functions": [fn]}, "functions", "tools"),
        ({"function_call": rng.choice(["auto", "none", {"name": fn["name"]}])}, "function_call",
         "tool_choice"),
        ({"functions": [fn], "function_call": {"name": fn["name"]}}, "functions", "tools"),
    ]:  # fmt: skip
        error = api_error(client.post("/v1/chat/completions", json=_chat(rng, **extra)), 400)
        assert error["param"] == field and instead in error["message"], error
    # The same request in the current form is served.
    body = _chat(rng, tools=[{"type": "function", "function": fn}])
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert fake.submitted == 1


# field: (values refused, neutral values served); None: no neutral value but null
REFUSED = {
    "guided_json": ([{"type": "object"}, '{"type": "string"}'], []),
    "guided_choice": ([["yes", "no"]], []),
    "guided_regex": (["[a-z]+"], []),
    "guided_grammar": (["root ::= 'a'"], []),
    "structured_outputs": ([{"choice": ["a", "b"]}, {"json": {"type": "object"}}], []),
    "use_beam_search": ([True, 1], [False]),
    "length_penalty": ([0.5, 2], [1, 1.0]),
    "allowed_token_ids": ([[1, 2]], [[]]),
    "bad_words": ([["ka"]], [[]]),
    "truncate_prompt_tokens": ([8, -1], []),
    "skip_special_tokens": ([False, 0], [True]),
    "spaces_between_special_tokens": ([False], [True]),
    "return_tokens_as_token_ids": ([True], [False]),
    "logits_processors": ([["my.module:Proc"]], [[]]),
}
CHAT_REFUSED = {  # the text route honours echo and refuses best_of > 1 itself
    "best_of": ([2, 4], [1]),
    "chat_template": (["{{ messages }}"], []),
    "echo": ([True], [False]),
}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_fields_the_engine_cannot_honour_are_refused_by_name(
    scripted_client, api_error, rng_seed, route
):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    build = _chat if route == "/v1/chat/completions" else _text
    if route == "/v1/chat/completions":
        fields = {**REFUSED, **CHAT_REFUSED, "reasoning_effort": (["max", 1], [])}  # bad values
    else:  # a text completion's prompt goes to the model as it is: no switch to turn
        fields = {**REFUSED, "reasoning_effort": (["none", "low", "high"], [])}
    for field, (refused, neutral) in fields.items():
        error = api_error(client.post(route, json=build(rng, **{field: rng.choice(refused)})))
        assert error["param"] == field, error
        for value in [None, *neutral]:
            fake.replies.append(("ok", "stop"))
            r = client.post(route, json=build(rng, **{field: value}))
            assert r.status_code == 200, (field, value, r.text)
    assert not fake.replies


def test_stop_token_ids_end_the_generation(engine, make_client, api_error, rng_seed):
    rng = random.Random(rng_seed)
    prompt = engine.tokenizer.encode(" ".join(_word(rng) for _ in range(rng.randint(1, 4))))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = engine.generate(prompt, greedy).token_ids  # before the server owns the engine
    k = rng.randrange(len(out))
    stop_at = out.index(out[k])  # the stop id's first appearance ends it
    client = make_client()
    for route, body in [
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": _word(rng)}]}),
    ]:
        bad = rng.choice([[-1], ["7"], 7, [True], [1.5]])
        error = api_error(client.post(route, json={**body, "stop_token_ids": bad}), 400)
        assert error["param"] == "stop_token_ids", error
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "stop_token_ids": [out[k]]}).json()
    assert r["choices"][0]["finish_reason"] == "stop", r
    assert r["usage"]["completion_tokens"] == stop_at + 1  # the stop id is generated, not shown
    plain = client.post("/v1/completions", json=body).json()
    assert plain["usage"]["completion_tokens"] == 12


def test_stop_token_ids_reach_the_engine_from_chat(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    ids = [rng.randrange(200) for _ in range(rng.randint(1, 4))]
    include, top_k = rng.choice([True, False]), rng.choice([-1, 0, rng.randint(1, 50)])
    fake.replies = [("ok", "stop")]
    body = _chat(rng, stop_token_ids=ids, include_stop_str_in_output=include, top_k=top_k)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert list(fake.samplings[-1].stop_token_ids) == ids
    assert fake.samplings[-1].include_stop_str_in_output is include
    assert fake.samplings[-1].top_k == max(top_k, 0)  # vLLM's -1: no top-k


@pytest.fixture
def scripted_service(engine) -> Iterator[tuple[ScriptedEngine, EngineService]]:
    fake = ScriptedEngine(engine)
    service = EngineService(fake)
    yield fake, service
    service.close()


def test_enable_thinking_renders_as_chatfreetoken_does(scripted_service, api_error, rng_seed):
    """The server's prompt for chat_template_kwargs {"enable_thinking": v} is the one
    ChatFreeToken(reasoning=v) sends for the same message."""
    rng = random.Random(rng_seed)
    fake, service = scripted_service
    with TestClient(create_app(service)) as client:
        prompts = {}
        for thinking in rng.sample([None, False, True], 3):
            body = _chat(rng)
            if thinking is not None or rng.random() < 0.5:
                body["chat_template_kwargs"] = {"enable_thinking": thinking}
            fake.replies = [("ok", "stop")] * 2
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            ChatFreeToken(engine=service, reasoning=thinking).invoke(body["messages"][0]["content"])
            assert fake.prompts[-2] == fake.prompts[-1], thinking
            prompts[thinking] = fake.prompts[-1]
        for kwargs in [{"enable_thinking": "no"}, {_word(rng): True}, ["enable_thinking"]]:
            r = client.post("/v1/chat/completions", json=_chat(rng, chat_template_kwargs=kwargs))
            assert api_error(r, 400)["param"] == "chat_template_kwargs"
        r = client.post("/v1/completions", json=_text(rng, chat_template_kwargs={}))
        assert api_error(r, 400)["param"] == "chat_template_kwargs"  # no template there
    # The demo template has the switch: the test would not tell the renderings apart otherwise.
    assert prompts[False] != prompts[None] or prompts[True] != prompts[None]


def test_reasoning_effort_switches_thinking(scripted_service, api_error, rng_seed):
    """reasoning_effort "none" renders the prompt of enable_thinking false, any other effort
    that of enable_thinking true; the two fields agreeing is served, contradicting refused
    naming reasoning_effort."""
    rng = random.Random(rng_seed)
    fake, service = scripted_service
    with TestClient(create_app(service)) as client:
        text = _chat(rng)["messages"]
        for effort in rng.sample(["none", "minimal", "low", "medium", "high"], 3):
            thinking = effort != "none"
            for extra in ({"chat_template_kwargs": {"enable_thinking": thinking}},
                          {"reasoning_effort": effort},
                          {"reasoning_effort": effort,
                           "chat_template_kwargs": {"enable_thinking": thinking}}):  # fmt: skip
                fake.replies = [("ok", "stop")]
                r = client.post("/v1/chat/completions", json={"messages": text, **extra})
                assert r.status_code == 200, r.text
            assert fake.prompts[-1] == fake.prompts[-2] == fake.prompts[-3], effort
            against = {"enable_thinking": not thinking}
            body = {"messages": text, "reasoning_effort": effort, "chat_template_kwargs": against}
            error = api_error(client.post("/v1/chat/completions", json=body), 400)
            assert error["param"] == "reasoning_effort", error
        prompts = set()
        for thinking in (True, False):  # the demo template tells the two apart
            fake.replies = [("ok", "stop")]
            body = {"messages": text, "reasoning_effort": "high" if thinking else "none"}
            client.post("/v1/chat/completions", json=body)
            prompts.add(tuple(fake.prompts[-1]))
        assert len(prompts) == 2


def test_text_completions_default_to_16_tokens(engine, scripted_service, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted_service
    with TestClient(create_app(service)) as client:
        fake.replies = [("ok", "stop")] * 3
        client.post("/v1/completions", json={"prompt": _word(rng)})
        assert fake.samplings[-1].max_tokens == 16
        n = rng.randint(1, 99)
        client.post("/v1/completions", json={"prompt": _word(rng), "max_tokens": n})
        assert fake.samplings[-1].max_tokens == n
        client.post("/v1/chat/completions", json={"messages": _chat(rng)["messages"]})
        assert fake.samplings[-1].max_tokens == engine.max_model_len  # chat: unchanged
    n = rng.randint(1, 99)  # a server given a default uses it for both endpoints
    with TestClient(create_app(service, default_max_tokens=n)) as client:
        fake.replies = [("ok", "stop")]
        client.post("/v1/completions", json={"prompt": _word(rng)})
        assert fake.samplings[-1].max_tokens == n
