"""`parallel_tool_calls: false`: at most one call comes back, and the generation stops there.

The demo model never writes a tool call, so a scripted engine writes two good calls (perhaps
after a voided block, which does not count) and a long tail after them. The tail is written
slowly (`PacedEngine`), so a request stopped at its first call ends long before its reply
does: had the server only cut the reply, the engine would have finished it.
"""

from __future__ import annotations

import json
import random

import pytest
from scripted_engine import PacedEngine
from starlette.testclient import TestClient

WORDS = ["alpha", "beta", "café", "ka", "lo", "mi", "ru", "line\nbreak", "x,", "{a:"]
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "pe", "xi", "qu"]


@pytest.fixture
def paced(paced_client) -> tuple[PacedEngine, TestClient]:
    return paced_client


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _block(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>\n'


def two_calls(rng: random.Random) -> tuple[str, str, list[dict], list[tuple[str, dict]]]:
    """(the part up to the end of the first good call, the rest, tools, the two good calls)."""
    names = [f"t_{rng.choice(SYLLABLES)}{rng.choice(SYLLABLES)}_{i}" for i in range(3)]
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    calls = [(rng.choice(names), {f"k{i}": rng.randint(-99, 99)}) for i in range(2)]
    head = _words(rng, rng.randint(0, 3)) + "\n"
    if rng.random() < 0.5:  # a block the parser voids (bad JSON) is content, not the first call
        head += _block(rng.choice(names), '{"a": ' + rng.choice(SYLLABLES) + "}")
    first = head + _block(calls[0][0], json.dumps(calls[0][1]))
    tail = _block(calls[1][0], json.dumps(calls[1][1])) + "zo " * 150
    return first, tail, tools, calls


def _request(tools: list[dict], rng: random.Random, **extra) -> dict:
    return {"messages": [{"role": "user", "content": _words(rng, 3)}], "tools": tools, **extra}


def test_parallel_tool_calls_false_returns_the_first_call_and_stops(paced, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = paced
    first, tail, tools, calls = two_calls(rng)
    tokenizer = fake.tokenizer
    total = len(tokenizer.encode(first + tail))
    fake.replies = [(first + tail, "stop")] * 3

    # The control, unpaced: by default both calls come back (so the text does hold two).
    both = client.post("/v1/chat/completions", json=_request(tools, rng)).json()
    listed = both["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in listed] == (
        calls
    )
    done = fake.finished  # the control ran to its end
    # From now on slow from just before the first call's end (the boundary may tokenize
    # either way).
    fake.slow_after = len(tokenizer.encode(first)) - 2

    body = _request(tools, rng, parallel_tool_calls=False)
    reply = client.post("/v1/chat/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    listed = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in listed] == [
        calls[0]
    ]
    assert "zo zo" not in (choice["message"]["content"] or "")  # nothing after the call
    assert reply["usage"]["completion_tokens"] < total  # stopped, not cut after the fact

    body["stream"] = True
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = read_sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    pieces = [p for d in deltas for p in d.get("tool_calls") or []]
    assert {p["index"] for p in pieces} == {0}
    streamed = "".join(p["function"].get("arguments") or "" for p in pieces)
    assert json.loads(streamed) == calls[0][1]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == (choice["message"]["content"] or "")
    assert fake.finished == done  # neither request ran to the end of its reply
