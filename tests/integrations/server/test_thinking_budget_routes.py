"""The thinking budget on the wire: vLLM's `thinking_token_budget` on chat and text completions
and the WebSocket `send`, Anthropic's `thinking.budget_tokens` (an "enabled" block only); bad
values are a 400 naming the field; and through the chat route on the real demo model, the
forced close comes right after the budget's tokens."""

from __future__ import annotations

import random

import pytest

ROUTES = ["/v1/chat/completions", "/v1/completions"]


def _body(route: str, **extra) -> dict:
    if route == "/v1/completions":
        return {"prompt": "ka lo mi", "max_tokens": 4, **extra}
    return {"messages": [{"role": "user", "content": "ka lo mi"}], "max_tokens": 4, **extra}


@pytest.mark.parametrize("route", ROUTES)
def test_the_budget_reaches_sampling_params(scripted_client, api_error, rng_seed, route):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    budget = rng.randint(0, 4096)
    fake.replies = [("ok", "stop")] * 2
    assert client.post(route, json=_body(route, thinking_token_budget=budget)).status_code == 200
    assert fake.samplings[-1].thinking_token_budget == budget
    assert client.post(route, json=_body(route, thinking_token_budget=None)).status_code == 200
    assert fake.samplings[-1].thinking_token_budget is None
    for bad in (-1, 2.5, "8", True):
        error = api_error(client.post(route, json=_body(route, thinking_token_budget=bad)), 400)
        assert error["param"] == "thinking_token_budget", (bad, error)
    assert fake.submitted == 2


def test_the_websocket_takes_it(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    budget = rng.randint(0, 4096)
    fake.replies = [("ok", "stop")]
    with client.websocket_connect("/v1/sessions/b/ws") as ws:
        ws.receive_json(), ws.receive_json()  # the session, the memory split
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": "ka"}],
                      "sampling": {"thinking_token_budget": budget}})  # fmt: skip
        while ws.receive_json()["type"] != "done":
            pass
    assert fake.samplings[-1].thinking_token_budget == budget


def test_anthropic_budget_tokens(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    budget = rng.randint(1, 4096)
    cases = [({"type": "enabled", "budget_tokens": budget}, budget),
             ({"type": "adaptive"}, None), ({"type": "disabled"}, None), (None, None)]  # fmt: skip
    fake.replies = [("ok", "stop")] * len(cases)
    for thinking, want in cases:
        body = {"model": "freetoken/qwen3_moe", "max_tokens": 8,
                "messages": [{"role": "user", "content": "ka"}]}  # fmt: skip
        if thinking is not None:
            body["thinking"] = thinking
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        assert fake.samplings[-1].thinking_token_budget == want, thinking
    # A model without think tokens: the budget Anthropic clients always send is dropped (the
    # engine would refuse it), not a failure of every thinking request.
    fake.thinking = None
    fake.replies = [("ok", "stop")]
    body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    assert client.post("/v1/messages", json=body).status_code == 200
    assert fake.samplings[-1].thinking_token_budget is None


def test_the_close_is_forced_after_the_budget(client, engine, rng_seed):
    """The demo's template does not open a think block: a +100 bias on `<think>` has the model
    open one with its first token (and write `<think>` ever after); the budget's close comes
    after `budget` tokens of the block, then the bias has its way again."""
    rng = random.Random(rng_seed)
    m = engine.thinking
    budget = rng.randint(0, 8)
    body = {"messages": [{"role": "user", "content": "ka lo mi"}], "temperature": 0,
            "max_tokens": 1 + budget + len(m.forced) + 2, "logprobs": True,
            "logit_bias": {str(m.open_id): 100}, "thinking_token_budget": budget}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    assert tokens == ["<think>"] * (1 + budget) + ["\n", "</think>", "\n", "\n"] + ["<think>"] * 2
    assert choice["message"]["content"] == "<think>" * 2  # after the block: content
