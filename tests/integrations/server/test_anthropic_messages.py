"""POST /v1/messages: what the reply is made of, whole and streamed.

The demo model never writes reasoning or a tool call of its own, so a scripted engine writes
them (`<think>` blocks, Hermes `<tool_call>` blocks); the OpenAI route, given the same reply,
is the oracle for what the parser made of it. Streamed events are folded back into a message
as Anthropic's SDKs fold them (anthropic_stream.py, which also checks their order), and must
give the whole reply. Stop sequences need the real engine (its text state finds them): its
greedy output is written once, then a piece of it is asked for as the stop sequence.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import jsonschema
from anthropic_stream import named_events, reassemble
from asgi_disconnect import post_and_leave
from random_schemas import random_instance, random_name, random_object_schema
from scripted_engine import PacedEngine
from starlette.testclient import TestClient

from freetoken_agent.integrations.server import create_app
from freetoken_agent.service import EngineService

URL = "/v1/messages"
WORDS = ["alpha", "beta", "café", "ka", "lo", "mi", "ru", "line\nbreak", "x,", "{a:", "日本"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def _streamed(client, body: dict) -> list[tuple[str, dict]]:
    r = client.post(URL, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return named_events(r.text)


def _expected_blocks(openai_message: dict) -> list[dict[str, Any]]:
    """The content blocks of the OpenAI route's message: thinking, text, then each call."""
    blocks: list[dict[str, Any]] = []
    if openai_message.get("reasoning_content"):
        blocks.append(
            {"type": "thinking", "thinking": openai_message["reasoning_content"], "signature": ""}
        )
    if openai_message.get("content"):
        blocks.append({"type": "text", "text": openai_message["content"]})
    for call in openai_message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append(
            {"type": "tool_use", "name": fn["name"], "input": json.loads(fn["arguments"])}
        )
    return blocks


def _without_ids(blocks: list[dict]) -> list[dict]:
    """Tool-call ids are drawn per reply: checked apart."""
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def test_reasoning_text_and_calls_whole_and_streamed(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    tools = [
        {"name": random_name(rng), "input_schema": random_object_schema(rng)} for _ in range(2)
    ]
    calls = []
    for _ in range(rng.randint(0, 3)):
        tool = rng.choice(tools)
        calls.append((tool["name"], random_instance(rng, tool["input_schema"])))
    reply = f"<think>\n{_words(rng, rng.randint(1, 6))}\n</think>\n\n"
    if not calls or rng.random() < 0.5:  # at least two blocks: their order is checked
        reply += _words(rng, rng.randint(1, 6)) + "\n"
    reply += "\n".join(_call(name, arguments) for name, arguments in calls)
    fake.replies = [(reply, "stop")] * 3
    user = [{"role": "user", "content": _words(rng, 3)}]
    openai_tools = [
        {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
        for t in tools
    ]
    chat = client.post("/v1/chat/completions", json={"messages": user, "tools": openai_tools})
    expected = _expected_blocks(chat.json()["choices"][0]["message"])
    assert [b["type"] for b in expected][:1] == ["thinking"]  # the oracle did see reasoning

    body = {"model": "freetoken/qwen3_moe", "max_tokens": 500, "messages": user, "tools": tools}
    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert set(whole) == {"id", "type", "role", "model", "content", "stop_reason",
                          "stop_sequence", "usage"}  # fmt: skip
    assert whole["id"].startswith("msg_") and whole["type"] == "message"
    assert whole["role"] == "assistant" and whole["model"] == "freetoken/qwen3_moe"
    assert _without_ids(whole["content"]) == expected, rng_seed
    uses = [b for b in whole["content"] if b["type"] == "tool_use"]
    assert all(isinstance(b["id"], str) and b["id"] for b in uses)
    assert len({b["id"] for b in uses}) == len(uses)
    assert whole["stop_reason"] == ("tool_use" if calls else "end_turn")
    assert whole["stop_sequence"] is None
    tokens = len(fake.tokenizer.encode(reply))
    assert whole["usage"]["output_tokens"] == tokens

    events = _streamed(client, body)
    streamed = reassemble(events)
    assert _without_ids(streamed["content"]) == expected, rng_seed
    assert {k: v for k, v in streamed.items() if k not in ("id", "content")} == {
        k: v for k, v in whole.items() if k not in ("id", "content")
    }
    starts = [d["content_block"] for name, d in events if name == "content_block_start"]
    for block in starts:  # each block starts empty; its deltas fill it
        assert block in (
            {"type": "thinking", "thinking": "", "signature": ""},
            {"type": "text", "text": ""},
        ) or (block["type"] == "tool_use" and block["input"] == {}), block
    json_deltas = [d for name, d in events if d.get("delta", {}).get("type") == "input_json_delta"]
    assert len(json_deltas) == len(calls)  # a call goes out whole: one delta each


def test_stop_reasons_end_turn_and_max_tokens(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    text = _words(rng, rng.randint(2, 8))
    # The reply ends at max_tokens: as many tokens as the scripted text has.
    n = len(fake.tokenizer.encode(text))
    body = {"max_tokens": n, "messages": [{"role": "user", "content": _words(rng, 2)}]}
    for reason, expected in (("stop", "end_turn"), ("length", "max_tokens")):
        fake.replies = [(text, reason)] * 2
        whole = client.post(URL, json=body).json()
        assert (whole["stop_reason"], whole["stop_sequence"]) == (expected, None)
        assert whole["content"] == [{"type": "text", "text": text}]
        delta = _streamed(client, body)[-2][1]
        assert delta["delta"] == {"stop_reason": expected, "stop_sequence": None}


def test_a_reply_cut_short_of_max_tokens_is_model_context_window_exceeded(
    scripted_client, rng_seed
):
    """A reply that ends by length short of max_tokens ended at the context's end (the engine
    stops there), and says so as Anthropic does: Claude Code asks for 32k tokens and would
    otherwise advise raising its cap, which cannot help."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    text = _words(rng, rng.randint(2, 8))
    n = len(fake.tokenizer.encode(text))
    body = {"max_tokens": n + rng.randint(1, 32000),
            "messages": [{"role": "user", "content": _words(rng, 2)}]}  # fmt: skip
    fake.replies = [(text, "length")] * 2
    whole = client.post(URL, json=body).json()
    assert whole["stop_reason"] == "model_context_window_exceeded", whole
    assert whole["usage"]["output_tokens"] == n
    delta = _streamed(client, body)[-2][1]
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded"


def test_stop_sequence_names_the_string_that_ended_it(client, rng_seed):
    rng = random.Random(rng_seed)
    body = {"max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    for _ in range(20):  # a prompt whose greedy output has a piece of plain text in it
        body["messages"][0]["content"] = random_name(rng) + " " + random_name(rng)
        text = client.post(URL, json=body).json()["content"][0]["text"]
        starts = [
            i
            for i in range(1, len(text) - 3)
            if text[i : i + 3].isascii() and text[i : i + 3].isalpha()
            and text.find(text[i : i + 3]) == i
        ]  # fmt: skip
        if starts:
            break
    else:
        raise AssertionError(f"no usable output in 20 prompts (seed {rng_seed})")
    cut = rng.choice(starts)
    stop = text[cut : cut + 3]
    others = [random_name(rng) + "#", "@@@"]  # never written: only the one that came counts
    asked = {**body, "stop_sequences": rng.sample([*others, stop], 3)}
    whole = client.post(URL, json=asked).json()
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", stop), text
    assert whole["content"] == [{"type": "text", "text": text[:cut]}]
    events = _streamed(client, asked)
    assert reassemble(events)["content"] == whole["content"]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    unstopped = client.post(URL, json={**body, "stop_sequences": others}).json()
    assert unstopped["stop_reason"] == "max_tokens"  # 24 tokens, no EOS: what it wrote first


def test_tool_choice_tool_and_any_force_a_valid_call(client, rng_seed):
    rng = random.Random(rng_seed)
    names: set[str] = set()
    while len(names) < 3:
        names.add(random_name(rng))
    tools = [{"name": n, "input_schema": random_object_schema(rng)} for n in sorted(names)]
    schemas = {t["name"]: t["input_schema"] for t in tools}
    chosen = rng.choice(tools)["name"]
    user = [{"role": "user", "content": random_name(rng)}]
    for choice in ({"type": "tool", "name": chosen}, {"type": "any"}):
        body = {"max_tokens": 160, "messages": user, "tools": tools, "tool_choice": choice}
        whole = client.post(URL, json=body).json()
        assert whole["stop_reason"] == "tool_use", whole
        uses = [b for b in whole["content"] if b["type"] == "tool_use"]
        assert len(uses) == 1, whole
        if choice["type"] == "tool":
            assert uses[0]["name"] == chosen
        jsonschema.validate(uses[0]["input"], schemas[uses[0]["name"]])


def test_tool_choice_none_leaves_a_written_call_as_text(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    name = random_name(rng)
    reply = _words(rng, 2) + "\n" + _call(name, {"k": rng.randint(0, 9)})
    fake.replies = [(reply, "stop")] * 2
    tools = [{"name": name, "description": _words(rng, 3), "input_schema": {"type": "object"}}]
    user = [{"role": "user", "content": _words(rng, 3)}]
    body = {"max_tokens": 200, "messages": user, "tools": tools, "tool_choice": {"type": "none"}}
    whole = client.post(URL, json=body).json()
    assert whole["content"] == [{"type": "text", "text": reply}]
    assert whole["stop_reason"] == "end_turn"
    auto = client.post(URL, json={**body, "tool_choice": {"type": "auto"}}).json()
    assert auto["stop_reason"] == "tool_use"  # the control: the same text is a call
    # tool_choice none keeps the tools in the prompt, as the chat route's "none" does
    assert fake.prompts[0] == fake.prompts[1]


def test_disable_parallel_tool_use_returns_the_first_call(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    names = [random_name(rng) + str(i) for i in range(2)]
    calls = [(rng.choice(names), {"k": rng.randint(-9, 9)}) for _ in range(2)]
    fake.replies = [("\n".join(_call(n, a) for n, a in calls), "stop")] * 2
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in names]
    body = {"max_tokens": 200, "messages": [{"role": "user", "content": "go"}], "tools": tools}
    both = client.post(URL, json=body).json()
    assert [(b["name"], b["input"]) for b in both["content"]] == calls
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    one = client.post(URL, json={**body, "tool_choice": choice}).json()
    assert [(b["name"], b["input"]) for b in one["content"]] == calls[:1]
    assert one["stop_reason"] == "tool_use"


def test_an_engine_error_is_an_error_object_or_event(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    message = "boom " + random_name(rng)
    fake.replies = [(_words(rng, 3), "error", message)] * 2
    body = {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    r = client.post(URL, json=body)
    assert r.status_code == 500
    assert r.json() == {"type": "error", "error": {"type": "api_error", "message": message}}
    events = _streamed(client, body)
    assert events[0][0] == "message_start"
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                               "message": message}})  # fmt: skip
    assert "message_stop" not in [name for name, _ in events]


def test_usage_counts_reused_prompt_tokens_as_cache_reads(client, rng_seed):
    rng = random.Random(rng_seed)
    system = " ".join(random_name(rng) for _ in range(rng.randint(20, 40)))
    body = {"max_tokens": 2, "system": system,
            "messages": [{"role": "user", "content": random_name(rng)}]}  # fmt: skip
    counted = client.post(URL + "/count_tokens", json=body).json()["input_tokens"]
    first = client.post(URL, json=body).json()["usage"]
    assert first == {"input_tokens": counted, "output_tokens": 2,
                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip
    events = _streamed(client, body)
    start = events[0][1]["message"]["usage"]
    assert start["input_tokens"] == counted and start["output_tokens"] == 0
    again = reassemble(events)["usage"]
    # The second time most of the prompt is in the prefix cache; the sum is still the prompt.
    assert again["cache_read_input_tokens"] > 0
    assert again["input_tokens"] + again["cache_read_input_tokens"] == counted
    assert again["output_tokens"] == 2


def test_count_tokens_counts_what_the_turn_appends(client, rng_seed):
    """A forced call's opener, or the `<think>\\n` of a call after a bounded reasoning, is
    prompt the turn submits: count_tokens counts it, so its figure is the turn's input."""
    rng = random.Random(rng_seed)
    schema = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["q"]}  # fmt: skip
    tools = [{"name": random_name(rng), "description": "d", "input_schema": schema}]
    cases = [({"type": "any"}, {"type": "enabled", "budget_tokens": rng.randint(1, 4)}),
             ({"type": "any"}, {"type": "disabled"}), ({"type": "auto"}, None),
             ({"type": "tool", "name": tools[0]["name"]}, None)]  # fmt: skip
    for choice, thinking in rng.sample(cases, len(cases)):
        body = {"max_tokens": 60, "tools": tools, "tool_choice": choice,
                "messages": [{"role": "user", "content": _words(rng, 4)}]}  # fmt: skip
        if thinking is not None:
            body["thinking"] = thinking
        counted = client.post(URL + "/count_tokens", json=body).json()["input_tokens"]
        usage = client.post(URL, json=body).json()["usage"]
        used = usage["input_tokens"] + usage["cache_read_input_tokens"]
        assert counted == used + usage["cache_creation_input_tokens"], (choice, thinking, usage)


class _Running(PacedEngine):
    """A paced scripted engine that reports its running requests, as post_and_leave waits
    for one to run before it leaves."""

    slow_after = 0

    def stats(self) -> dict:
        figures = super().stats()
        figures["requests"]["running"] = len(self.running)
        return figures


def test_a_client_that_leaves_cancels_its_message(engine, rng_seed):
    """Streamed (the client closes mid-stream) and whole (it leaves while the reply is
    collected): the run is cancelled, so the long reply is never finished."""
    rng = random.Random(rng_seed)
    fake = _Running(engine)
    service = EngineService(fake)
    app = create_app(service)
    reply = _words(rng, 400)
    fake.replies = [(reply, "stop")] * 2
    body = {"max_tokens": 2000, "messages": [{"role": "user", "content": "go"}]}
    try:
        with (
            TestClient(app) as client,
            client.stream("POST", URL, json={**body, "stream": True}) as r,
        ):
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("event: content_block_delta")
                if deltas == 3:
                    break
        sent = post_and_leave(app, URL, json.dumps(body).encode())
        assert sent[0]["status"] == 499
        for _ in range(500):  # the aborts land at the engine's next step
            if not fake.has_unfinished():
                break
            time.sleep(0.01)
        assert fake.submitted == 2 and fake.finished == 0 and not fake.has_unfinished()
    finally:
        service.close()
