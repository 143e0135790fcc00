"""POST /tokenize and /detokenize: the counts are the ones the generation endpoints use (a
client trims its history by them), and bad bodies are refused naming the field."""

from __future__ import annotations

import json
import random

import pytest
from mistral_tokenizer import CONFIG, mistral_v3_backend
from starlette.testclient import TestClient
from tiny_models import make_tiny

from freetoken_agent import Engine
from freetoken_agent.integrations.server import create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _history(rng: random.Random) -> list[dict]:
    words = ["alpha", "bravo", "kilo", "zulu", "echo", "delta", "émigré", "数据", "tool", "{x}"]
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))  # noqa: E731
    messages = [{"role": "system", "content": say()}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
    return [*messages, {"role": "user", "content": say()}]


@pytest.mark.parametrize("with_tools", [False, True])
def test_a_histories_count_is_the_chat_completions_prompt(client, rng_seed, with_tools):
    rng = random.Random(rng_seed)
    messages = _history(rng)
    extra = {"tools": [WEATHER]} if with_tools else {}
    counted = client.post("/tokenize", json={"messages": messages, **extra})
    assert counted.status_code == 200, counted.text
    body = counted.json()
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == client.app.state.server.max_model_len
    reply = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra}
    ).json()
    assert reply["usage"]["prompt_tokens"] == body["count"]
    # Without the assistant's opening the count is a prefix of it, shorter.
    bare = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                          **extra}).json()  # fmt: skip
    assert bare["count"] < body["count"] and body["tokens"][: bare["count"]] == bare["tokens"]
    if with_tools:  # the tools are in the count
        plain = client.post("/tokenize", json={"messages": messages}).json()
        assert plain["count"] < body["count"]


def test_a_prompts_count_is_the_text_completions_prompt(client, rng_seed):
    rng = random.Random(rng_seed)
    prompt = " ".join(rng.choice(["one", "two", "trois", "vier", "\n", "🙂"]) for _ in range(30))
    body = client.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == body["count"]
    tokenizer = client.app.state.server.service.tokenizer
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    back = client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert back.endswith(prompt)  # after the BOS the template has, if any
    raw = client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert client.post("/detokenize", json={"tokens": raw["tokens"]}).json()["prompt"] == prompt


def test_a_count_past_the_context_is_answered(client, rng_seed):
    rng = random.Random(rng_seed)
    limit = client.app.state.server.max_model_len
    long = " ".join(str(rng.randrange(10**6)) for _ in range(limit))
    body = client.post("/tokenize", json={"messages": [{"role": "user", "content": long}]})
    assert body.status_code == 200 and body.json()["count"] > limit


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0]"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
         "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": [{"x": 1}]},
         "tools[0]"),
        ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)  # fmt: skip
def test_bad_bodies_are_refused_naming_the_field(client, api_error, path, body, param):
    reply = client.post(path, json=body)
    error = api_error(reply, 400, 404)
    assert error["param"] == param


def test_a_body_that_is_not_json_is_refused(client, api_error):
    reply = client.post("/tokenize", content=b"{nope", headers={"content-type": "application/json"})
    api_error(reply, 400)


def test_a_bos_models_prompt_count_has_its_bos(tmp_path, rng_seed):
    """As /v1/completions encodes a string: the model's BOS first, unless asked without."""
    tok = mistral_v3_backend()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"
    config = {**CONFIG, "add_bos_token": True, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    make_tiny("mixtral", tmp_path, rng_seed, vocab_size=tok.get_vocab_size())
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=1024)
    rng = random.Random(rng_seed)
    prompt = " ".join(rng.choice(["the", "answer", "café", "x"]) for _ in range(rng.randint(2, 9)))
    with TestClient(create_app(engine)) as client:
        body = client.post("/tokenize", json={"prompt": prompt}).json()
        raw = client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert body["tokens"] == [tok.token_to_id("<s>"), *raw.json()["tokens"]]
    assert reply["usage"]["prompt_tokens"] == body["count"]
