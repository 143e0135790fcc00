"""Strict tools under tool_choice "auto" through the OpenAI API and ChatFreeToken: the turn
takes the strict tools' grammar (integrations/strict_tools.py) exactly when a tool is strict,
the choice is auto and nothing else constrains the output; and on the demo model a call the
model opens comes back valid against the strict tool's schema."""

from __future__ import annotations

import json
import random

import jsonschema
from langchain_core.messages import HumanMessage
from random_schemas import random_name, random_object_schema

from freetoken_agent.engine import runner as runner_module
from freetoken_agent.integrations.langchain import ChatFreeToken

URL = "/v1/chat/completions"


def _tools(rng: random.Random, strict: bool) -> list[dict]:
    names: list[str] = []
    while len(names) < rng.randint(1, 3):
        names.append(random_name(rng, names))
    tools = []
    for i, name in enumerate(names):
        fn = {"name": name, "parameters": random_object_schema(rng, ("name", "arguments"))}
        if strict and (i == 0 or rng.random() < 0.5):
            fn["strict"] = True
        tools.append({"type": "function", "function": fn})
    rng.shuffle(tools)
    return tools


def _body(rng: random.Random, tools: list[dict], **extra) -> dict:
    words = " ".join(random_name(rng) for _ in range(5))
    return {"messages": [{"role": "user", "content": words}], "tools": tools,
            "max_tokens": 64, **extra}  # fmt: skip


def test_the_grammar_is_taken_exactly_when_a_strict_tool_is_free_to_be_called(
    scripted_client, rng_seed
):
    fake, client = scripted_client
    rng = random.Random(rng_seed)
    cases = [
        (_tools(rng, True), {}, True),
        (_tools(rng, True), {"tool_choice": "auto"}, True),
        (_tools(rng, False), {}, False),
        (_tools(rng, True), {"tool_choice": "none"}, False),
        (_tools(rng, True), {"response_format": {"type": "json_object"}}, False),
    ]
    rng.shuffle(cases)
    for tools, extra, strict in cases:
        fake.replies = [("fine", "stop")]
        r = client.post(URL, json=_body(rng, tools, **extra))
        assert r.status_code == 200, r.text
        sampling = fake.samplings[-1]
        # (a response_format's grammar holds the JSON after the reasoning: not the tools')
        grammar = None if sampling.grammar_holds_answer else sampling.grammar
        assert (grammar is not None) == strict, (extra, tools)
        if strict:
            assert all(json.dumps(t["function"]["name"]) in grammar for t in tools)


def test_a_call_the_demo_model_opens_keeps_to_the_strict_schema(client, engine, rng_seed,
                                                                monkeypatch):  # fmt: skip
    """The random model is pushed to open a call at its first token (the opener's logit
    raised); what the grammar lets it write after is a call of a tool with valid arguments.
    The same push without strict tools gives no call: the random model breaks its JSON."""
    rng = random.Random(rng_seed)
    opener = engine.tokenizer.token_to_id("<tool_call>")
    real_sample = runner_module.sample
    first = {"step": True}  # the push: at each request's first token only

    def pushed(logits, params, generators, allowed=None):
        if first["step"] and all(p.max_tokens == 300 for p in params):
            logits[:, opener] += 1e4
            first["step"] = False
        return real_sample(logits, params, generators, allowed)

    monkeypatch.setattr(runner_module, "sample", pushed)
    tools = _tools(rng, True)
    for t in tools:
        t["function"]["strict"] = True
    body = {**_body(rng, tools), "max_tokens": 300, "temperature": 1.0, "seed": rng_seed}
    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # The call, then free text again (the random model rambles to max_tokens: "length").
    assert choice["message"].get("tool_calls"), choice
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in choice["message"]["tool_calls"]:
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
    for t in tools:
        del t["function"]["strict"]
    first["step"] = True
    free = client.post(URL, json=body).json()["choices"][0]
    assert not free["message"].get("tool_calls"), free


def test_chatfreetoken_bind_tools_strict_takes_the_grammar(engine, rng_seed):
    rng = random.Random(rng_seed)
    tools = _tools(rng, False)
    llm = ChatFreeToken(engine=engine)
    try:
        prompt = [HumanMessage(" ".join(random_name(rng) for _ in range(4)))]
        for strict in (True, False, None):  # the sampling invoke would run
            bound = llm.bind_tools(tools, strict=strict)
            sampling = llm._prepare(prompt, None, dict(bound.kwargs))[2]
            assert (sampling.grammar is not None) == (strict is True)
        forced = llm.bind_tools(tools, strict=True, tool_choice="required")
        sampling = llm._prepare(prompt, None, dict(forced.kwargs))[2]
        assert sampling.grammar is None and sampling.json_schema is not None
    finally:
        llm.service.close()


def test_a_strict_tool_the_grammar_cannot_take_is_named_in_one_line(client, rng_seed):
    """A keyword the grammar library does not implement, in one strict tool among others: the
    400 names that tool's parameters and the keyword, on one line (the whole grammar's listing,
    every tool's schema in it, came back before)."""
    rng = random.Random(rng_seed)
    tools = _tools(rng, strict=False)
    bad = rng.randrange(len(tools) + 1)
    keyword = rng.choice([{"not": {"type": "string"}}, {"if": {"type": "integer"}}])
    params = {"type": "object", "properties": {"a": keyword}, "required": ["a"]}
    fn = {"name": random_name(rng, [t["function"]["name"] for t in tools]), "strict": True,
          "parameters": params}  # fmt: skip
    tools.insert(bad, {"type": "function", "function": fn})
    r = client.post(URL, json=_body(rng, tools, tool_choice="auto"))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"tools[{bad}].function.parameters"
    assert "\n" not in error["message"] and next(iter(keyword)) in error["message"]
    assert "%json" not in error["message"] and "TEXT" not in error["message"]


def test_an_xml_format_model_holds_such_a_tool_as_not_strict_not_a_400(engine, rng_seed):
    """Qwen3-Coder / Qwen3.5 templates: the XML grammar holds each parameter, and a strict
    tool whose parameters it cannot hold so (a top-level `not`) is left unconstrained, as
    before the per-tool check (which judges the JSON call the Hermes grammar compiles)."""
    from pathlib import Path
    from types import SimpleNamespace

    from template_sources import TemplateSources

    from freetoken_agent.engine.sampling_params import SamplingParams
    from freetoken_agent.integrations.server.tool_choice import ToolChoice, turn_sampling

    rng = random.Random(rng_seed)
    source = Path(__file__).parents[2] / "freetoken_agent" / "qwen3_5_chat_template.jinja"
    model = SimpleNamespace(
        tokenizer=TemplateSources(engine.tokenizer, {"default": source.read_text()}),
        spec=SimpleNamespace(arch="qwen3_moe"),
    )
    a = random_name(rng)
    params = {"type": "object", "properties": {a: {"type": "string"}}, "required": [a],
              "additionalProperties": False,
              "not": {"properties": {a: {"const": "x"}}}}  # fmt: skip
    tools = [*_tools(rng, strict=True), {"type": "function", "function": {
        "name": random_name(rng), "strict": True, "parameters": params}}]  # fmt: skip
    sampling = turn_sampling(ToolChoice("auto"), tools, model, SamplingParams())
    assert sampling.grammar is not None
