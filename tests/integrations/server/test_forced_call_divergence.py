"""A forced call's opener is prompt the server adds (tool_choice.py): the Session counts it as
sent, so the next turn's reported divergence and reuse are measured against what the engine
saw, never behind what it reused."""

from __future__ import annotations

import random

from random_schemas import random_name, random_object_schema
from scripted_engine import record_requests

from freetoken_agent.chat_format import common_prefix

URL = "/v1/sessions/{}/ws"


def _until_done(ws) -> list[dict]:
    events = []
    while True:
        events.append(ws.receive_json())
        if events[-1]["type"] == "done":
            return events


def test_the_turn_after_a_forced_call_diverges_where_the_engine_did(client, engine, rng_seed):
    rng = random.Random(rng_seed)
    requests = record_requests(engine)
    name = random_name(rng)
    tools = [
        {"type": "function", "function": {"name": name, "parameters": random_object_schema(rng)}}
    ]
    words = lambda n: " ".join(random_name(rng) for _ in range(n))  # noqa: E731
    choice = rng.choice(["required", {"type": "function", "function": {"name": name}}])
    with client.websocket_connect(URL.format(random_name(rng))) as ws:
        ws.receive_json()
        ws.receive_json()
        ws.send_json({"type": "send", "append": True, "tools": tools,
                      "tool_choice": choice,
                      "messages": [{"role": "system", "content": words(12)},
                                   {"role": "user", "content": words(8)}],
                      "sampling": {"max_tokens": 300, "temperature": 0}})  # fmt: skip
        first = _until_done(ws)
        call = first[-1]["message"]["tool_calls"][0]
        ws.send_json({"type": "send", "append": True, "tools": tools,
                      "messages": [{"role": "tool", "tool_call_id": call["id"],
                                    "content": words(10)}],
                      "sampling": {"max_tokens": 4, "temperature": 0}})  # fmt: skip
        second = _until_done(ws)
    usage = [e for e in second if e["type"] == "usage"][-1]
    r1, r2 = requests[-2], requests[-1]
    sent = list(r1.prompt_ids) + list(r1.output_ids)
    shared = common_prefix(sent, list(r2.prompt_ids))
    assert usage["first_divergence"] == shared, (usage, shared)
    assert usage["reused_tokens"] <= usage["first_divergence"]
