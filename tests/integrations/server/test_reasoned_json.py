"""A JSON answer after the reasoning: where the chat template opens a think block (Qwen3's
thinking mode), a response_format json_schema lets the model reason first and holds only the
answer to the schema (integrations/reasoned_json.py); the thinking budget caps the reasoning.
On the demo model with a template that opens the block; with thinking off the template closes
it, and the schema holds from the first token as before."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient
from thinking_model import check_close, thinking_demo

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.thinking_budget import MAX_WAIT
from freetoken_agent.integrations.server import create_app


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def thinking_dir(demo_dir, tmp_path_factory: pytest.TempPathFactory):
    return thinking_demo(demo_dir, tmp_path_factory.mktemp("thinking") / "model")


@pytest.fixture
def thinking_client(thinking_dir):
    engine = Engine.load(thinking_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=1024)  # fmt: skip
    with TestClient(create_app(engine)) as client:
        yield client


@pytest.fixture
def hybrid_client(demo_dir):
    """The demo model as made: its template is a hybrid one (Qwen3's), whose prompt opens no
    block in thinking mode, and whose model writes `<think>\\n` itself."""
    engine = Engine.load(demo_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=1024)  # fmt: skip
    with TestClient(create_app(engine)) as client:
        yield client


def _schema(rng: random.Random) -> dict:
    props = {f"k{i}": rng.choice([{"type": "integer", "minimum": 0, "maximum": 99},
                                  {"type": "boolean"}, {"enum": ["ka", "lo", "mi"]}])
             for i in range(rng.randint(1, 3))}  # fmt: skip
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}  # fmt: skip


def _body(rng: random.Random, schema: dict, budget: int, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "ka lo mi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "thinking_token_budget": budget, "max_tokens": budget + 80, "temperature": 0.8,
        "seed": rng.randrange(1 << 30), "logprobs": True, **extra,
    }  # fmt: skip


def test_the_model_reasons_then_answers_the_schema(thinking_client, rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(3):
        schema, budget = _schema(rng), rng.randint(0, 6)
        r = thinking_client.post("/v1/chat/completions", json=_body(rng, schema, budget))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        tokens = [e["token"] for e in choice["logprobs"]["content"]]
        # The block's `budget` tokens, then its forced end, then the answer.
        if check_close(tokens, budget, MAX_WAIT) > 1:
            assert choice["message"].get("reasoning_content"), choice["message"]


def test_under_a_hybrid_template_the_prompt_opens_the_block_its_model_would(
    hybrid_client, rng_seed
):
    """Qwen3's hybrid template in thinking mode: the prompt is given the `<think>\\n` the
    model would write first, then the model reasons and answers the schema as under a template
    that opens the block; with thinking off the template closes it and the JSON comes from
    the first token."""
    rng = random.Random(rng_seed)
    messages = [{"role": "user", "content": "ka lo mi"}]
    plain = hybrid_client.post("/tokenize", json={"messages": messages}).json()["count"]
    opener = hybrid_client.post(
        "/tokenize", json={"prompt": "<think>\n", "add_special_tokens": False}
    ).json()["count"]
    for thinking in (True, True, False):
        schema, budget = _schema(rng), rng.randint(0, 6)
        extra = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
        r = hybrid_client.post("/v1/chat/completions", json=_body(rng, schema, budget, **extra))
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        tokens = [e["token"] for e in choice["logprobs"]["content"]]
        if not thinking:
            assert "</think>" not in tokens and not choice["message"].get("reasoning_content")
            continue
        assert usage["prompt_tokens"] == plain + opener, (usage, plain, opener)
        assert "<think>" not in tokens  # the prompt wrote it
        if check_close(tokens, budget, MAX_WAIT) > 1:
            assert choice["message"].get("reasoning_content"), choice["message"]


def test_thinking_off_answers_from_the_first_token(thinking_client, rng_seed):
    rng = random.Random(rng_seed)
    schema = _schema(rng)
    body = _body(rng, schema, 4, chat_template_kwargs={"enable_thinking": False})
    r = thinking_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert "</think>" not in [e["token"] for e in choice["logprobs"]["content"]]
    assert not choice["message"].get("reasoning_content")


def test_streamed_the_reasoning_comes_before_the_answer(thinking_client, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    schema, budget = _schema(rng), rng.randint(2, 6)
    body = _body(rng, schema, budget, stream=True)
    r = thinking_client.post("/v1/chat/completions", json=body)
    chunks = [c for c in read_sse(r.text.splitlines()) if isinstance(c, dict) and c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds and kinds[0] == "reasoning_content" and kinds[-1] == "content", kinds
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")
    answer = "".join(d.get("content") or "" for d in deltas)
    jsonschema.validate(json.loads(answer), schema)


def test_refusals_and_stops_under_reasoning(thinking_client, api_error, rng_seed):
    """A $ref that resolves nowhere is a 400 naming response_format (not a server error);
    stop strings and stop ids do not cut the answer, as under the bare schema."""
    rng = random.Random(rng_seed)
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    error = api_error(thinking_client.post("/v1/chat/completions", json=_body(rng, bad, 2)), 400)
    message = error["message"]  # the pointer named, as for a bare schema
    assert error["param"] == "response_format" and "/$defs/missing" in message, error
    assert message.startswith("json_schema cannot be used") and "start:" not in message, error
    schema = _schema(rng)
    ids = [thinking_client.post("/tokenize", json={"prompt": s, "add_special_tokens": False})
           .json()["tokens"] for s in ('"', ":")]  # fmt: skip
    quote, colon = ids
    body = _body(rng, schema, rng.randint(0, 4), stop=[": ", '"', "{"],
                 stop_token_ids=quote + colon)  # fmt: skip
    choice = thinking_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_usage_counts_the_reasoning_tokens(thinking_client, rng_seed):
    """completion_tokens_details.reasoning_tokens: the think block's tokens, its tags included
    (up to and with `</think>`), summed over choices; 0 where no block opened: thinking off,
    unless the model opens one with its first token (a random model writes `<think>` now and
    then; the budget's rule counts it)."""
    rng = random.Random(rng_seed)
    for thinking in (True, False):
        n = rng.randint(1, 3)
        body = {"messages": [{"role": "user", "content": "ka lo mi"}], "n": n, "logprobs": True,
                "thinking_token_budget": rng.randint(0, 6), "max_tokens": 40,
                "temperature": 0.8, "seed": rng.randrange(1 << 30)}  # fmt: skip
        if not thinking:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        r = thinking_client.post("/v1/chat/completions", json=body).json()
        expected = 0
        for choice in r["choices"]:
            tokens = [e["token"] for e in choice["logprobs"]["content"]]
            if thinking or tokens[:1] == ["<think>"]:
                expected += tokens.index("</think>") + 1 if "</think>" in tokens else len(tokens)
        details = r["usage"]["completion_tokens_details"]
        assert details == {"reasoning_tokens": expected}, (thinking, r["usage"])


def _forced_body(rng: random.Random, tools: list[dict], choice: Any, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "ka lo mi"}], "tools": tools,
            "tool_choice": choice, "max_tokens": 120, "temperature": 0.8,
            "seed": rng.randrange(1 << 30), "logprobs": True, **extra}  # fmt: skip


def _call_tools(rng: random.Random) -> list[dict]:
    return [{"type": "function", "function": {"name": f"t{i}", "parameters": _schema(rng)}}
            for i in range(rng.randint(1, 3))]  # fmt: skip


def test_a_forced_call_follows_a_bounded_reasoning(hybrid_client, read_sse, rng_seed):
    """A forced call (required or named) where the model thinks first and a thinking budget
    bounds the reasoning: the model reasons, then the grammar writes the call in its Hermes
    block; streamed the same. Without a budget, or with thinking off, the call comes from the
    first token as before (the call must come: unbounded reasoning could reach max_tokens)."""
    rng = random.Random(rng_seed)
    tools = _call_tools(rng)
    for budget, thinking in rng.sample([(rng.randint(0, 6), True), (None, True),
                                        (rng.randint(0, 6), False)], 3):  # fmt: skip
        name = rng.choice(tools)["function"]["name"]
        choice = rng.choice(["required", {"type": "function", "function": {"name": name}}])
        extra = {} if budget is None else {"thinking_token_budget": budget}
        if not thinking:
            extra["chat_template_kwargs"] = {"enable_thinking": False}
        body = _forced_body(rng, tools, choice, **extra)
        r = hybrid_client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        (call,) = out["message"]["tool_calls"]
        schema = next(t["function"]["parameters"] for t in tools
                      if t["function"]["name"] == call["function"]["name"])  # fmt: skip
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        if choice != "required":
            assert call["function"]["name"] == name
        tokens = [e["token"] for e in out["logprobs"]["content"]]
        reasoned = budget is not None and thinking
        assert ("</think>" in tokens) == reasoned, (budget, thinking, tokens)
        if reasoned:  # the reasoning, its close, then the call block the grammar wrote
            close = check_close(tokens, budget, MAX_WAIT)
            assert tokens[-1] == "</tool_call>" and "<tool_call>" in tokens[close:], tokens
            assert bool(out["message"].get("reasoning_content")) == (close > 1), out
        streamed = read_sse(
            hybrid_client.post(
                "/v1/chat/completions", json={**body, "stream": True}
            ).text.splitlines()
        )
        deltas = [c["choices"][0]["delta"] for c in streamed
                  if isinstance(c, dict) and c["choices"]]  # fmt: skip
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
        assert [c["function"]["arguments"] for c in calls] == [call["function"]["arguments"]]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        assert reasoning == (out["message"].get("reasoning_content") or "")


def test_the_engine_default_budget_bounds_a_forced_call(demo_dir, rng_seed):
    """EngineConfig.thinking_budget (`--thinking-budget`) bounds every request's reasoning:
    a forced call then follows the reasoning without a budget of its own."""
    rng = random.Random(rng_seed)
    budget = rng.randint(1, 6)
    engine = Engine.load(demo_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=1024, thinking_budget=budget)  # fmt: skip
    tools = _call_tools(rng)
    with TestClient(create_app(engine)) as client:
        body = _forced_body(rng, tools, "required")
        out = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls", out
    tokens = [e["token"] for e in out["logprobs"]["content"]]
    close = check_close(tokens, budget, MAX_WAIT)
    assert "<tool_call>" in tokens[close:] and tokens[-1] == "</tool_call>", tokens


def test_a_forced_call_cut_by_max_tokens_keeps_what_it_wrote(hybrid_client, rng_seed):
    """The reasoned forced call's block is the grammar's (a Hermes model's `<tool_call>`
    markup): cut after the JSON the call still comes; cut inside it, the content is the JSON
    written so far, without the markup (as where the prompt opened the block)."""
    rng = random.Random(rng_seed)
    tools = _call_tools(rng)
    body = _forced_body(rng, tools, "required", thinking_token_budget=rng.randint(0, 4),
                        temperature=0)  # fmt: skip
    whole = hybrid_client.post("/v1/chat/completions", json=body).json()
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    tokens = [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    closer, opener = tokens.index("</tool_call>"), tokens.index("<tool_call>")
    # Greedy: the same tokens up to the cut. All but the closer, then a few of the JSON's
    # (its first tokens are `{"name": "`: more than five).
    for cut in (closer, rng.randint(opener + 3, opener + 5)):
        out = hybrid_client.post("/v1/chat/completions", json={**body, "max_tokens": cut})
        choice = out.json()["choices"][0]
        assert choice["finish_reason"] == "length", choice
        if cut == closer:  # the JSON is whole
            (again,) = choice["message"]["tool_calls"]
            assert again["function"] == call["function"], choice
            continue
        assert not choice["message"].get("tool_calls"), choice
        content = choice["message"]["content"]
        written = json.dumps({"name": call["function"]["name"],
                              "arguments": json.loads(call["function"]["arguments"])})  # fmt: skip
        assert content and "<tool_call>" not in content and written.startswith(content), content
