"""A forced call that comes first renders the template with thinking off, on the routes as in
ChatFreeToken (turn_run.turn_format): the template writes its own closed think block, then
the call opener, and the same request gives the same prompt both ways.

Before, the routes kept the template's thinking mode: under the demo's hybrid template (its
model opens the block itself) the call came right after `assistant\\n`, with no block, and
under a template that opens `<think>\\n` the server closed it as `<think>\\n</think>\\n\\n`,
neither the form the template writes for an answer without thinking; ChatFreeToken rendered
thinking off, so its prompt differed. Tools, names and questions are drawn fresh.
"""

from __future__ import annotations

import json
import random
import string

import pytest
from prompt_tap import tap_prompts
from starlette.testclient import TestClient
from thinking_model import thinking_demo

from freetoken_agent import Engine
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.integrations.server import create_app
from freetoken_agent.service import EngineService

TAIL = "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))


@pytest.mark.parametrize("template", ["hybrid", "opens"])
def test_a_forced_call_renders_thinking_off_on_both_ways_in(
    model_dir, tmp_path, monkeypatch, rng_seed, template
):
    rng = random.Random(rng_seed)
    folder = model_dir if template == "hybrid" else thinking_demo(model_dir, tmp_path / "m")
    engine = Engine.load(folder, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=1024)  # fmt: skip
    service = EngineService(engine)
    prompts = tap_prompts(service, monkeypatch)
    names = [f"{_word(rng)}_{i}" for i in range(rng.randint(1, 3))]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": schema}} for n in names]
    named = rng.random() < 0.5
    name = rng.choice(names)
    choice = {"type": "function", "function": {"name": name}} if named else "required"
    question = " ".join(_word(rng) for _ in range(rng.randint(1, 5)))
    thinking = rng.choice([None, True])  # asked or the template's default: a call comes first
    body = {"messages": [{"role": "user", "content": question}], "tools": tools,
            "tool_choice": choice, "temperature": 0, "max_tokens": 40}  # fmt: skip
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    try:
        with TestClient(create_app(service)) as client:
            r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["message"]["tool_calls"]
        llm = ChatFreeToken(engine=service, temperature=0, max_tokens=40, reasoning=thinking)
        got = llm.bind_tools(tools, tool_choice=name if named else "any").invoke(question)
    finally:
        service.close()
    assert len(prompts) == 2, len(prompts)
    tail = engine.tokenizer.decode(prompts[0][-24:], skip_special_tokens=False)
    assert tail.endswith(TAIL), (rng_seed, tail)
    assert prompts[1] == prompts[0], (rng_seed, template, thinking)
    assert [(c["name"], c["args"]) for c in got.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in served
    ], rng_seed
