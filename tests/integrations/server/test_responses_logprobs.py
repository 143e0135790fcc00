"""Log-probabilities on POST /v1/responses (responses_format.py): `include:
["message.output_text.logprobs"]` and `top_logprobs`.

The message's entries are the chat route's: the same greedy request on /v1/chat/completions,
streamed, sends each token's entry with the chunk that carries its text; the Responses message
holds exactly the entries of the chunks that carried message text (not the reasoning's, not
an EOS's), in order and with the same values. A stream's output_text deltas add up to the
whole response's list, each delta the entries of its own text, and the .done event and the
part hold it all. Each entry is checked by the SDK's own models. Prompts are drawn fresh.
"""

from __future__ import annotations

import json
import random
import string

import pytest
from anthropic_stream import named_events
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from freetoken_agent.engine.sampling_params import MAX_LOGPROBS

URL, CHAT = "/v1/responses", "/v1/chat/completions"
EVENT = TypeAdapter(ResponseStreamEvent)
TOL = 1e-4  # the same model, run twice: the KV cache reused or not


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(n)
    )


def _chat_content_entries(client, body: dict, read_sse) -> list[dict]:
    """The entries the chat route streams with its content chunks (in order)."""
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = read_sse(list(r.iter_lines()))
    entries = []
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            if choice["delta"].get("content") and choice["logprobs"] is not None:
                entries += choice["logprobs"]["content"]
    return entries


def _message_entries(response: dict) -> list[dict]:
    messages = [item for item in response["output"] if item["type"] == "message"]
    return [e for m in messages for part in m["content"] for e in part["logprobs"]]


def _same_entries(got: list[dict], expected: list[dict], seed: int) -> None:
    assert [e["token"] for e in got] == [e["token"] for e in expected], seed
    for a, b in zip(got, expected, strict=True):
        assert a["bytes"] == b["bytes"], seed
        assert bytes(a["bytes"]).decode("utf-8", "replace") == a["token"], seed
        assert abs(a["logprob"] - b["logprob"]) <= TOL, seed
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert abs(x["logprob"] - y["logprob"]) <= TOL, seed


@pytest.mark.parametrize("asked_by", ["include", "top_logprobs"])
def test_message_logprobs_are_the_chat_routes_whole_and_streamed(
    client, read_sse, rng_seed, asked_by
):
    rng = random.Random(rng_seed)
    k = rng.randint(1, MAX_LOGPROBS) if asked_by == "top_logprobs" else rng.choice([0, 3, 20])
    text = _words(rng, rng.randint(1, 8))
    max_tokens = rng.randint(3, 16)
    body = {"input": text, "max_output_tokens": max_tokens, "temperature": 0,
            "top_logprobs": k}  # fmt: skip
    if asked_by == "include":
        body["include"] = ["message.output_text.logprobs"]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "logprobs": True, "top_logprobs": k}  # fmt: skip
    expected = _chat_content_entries(client, chat, read_sse)

    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    Response.model_validate(whole, strict=True)
    entries = _message_entries(whole)
    assert all(len(e["top_logprobs"]) == k for e in entries), rng_seed
    _same_entries(entries, expected, rng_seed)
    texts = [p["text"] for i in whole["output"] if i["type"] == "message" for p in i["content"]]
    assert bool(entries) == any(texts), rng_seed  # a message's text came with its tokens

    with client.stream("POST", URL, json={**body, "stream": True}) as s:
        assert s.status_code == 200, s.read()
        events = named_events(s.read().decode())
    for _, data in events:
        EVENT.validate_python(data, strict=True)
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    streamed = [e for d in deltas for e in d["logprobs"]]
    _same_entries(streamed, expected, rng_seed)
    done = [data for name, data in events if name == "response.output_text.done"]
    assert [e for d in done for e in d["logprobs"]] == streamed, rng_seed
    final = events[-1][1]["response"]
    assert _message_entries(final) == streamed, rng_seed


def test_without_asking_the_message_has_no_logprobs(client, rng_seed):
    rng = random.Random(rng_seed)
    body = {"input": _words(rng, 4), "max_output_tokens": rng.randint(2, 8), "temperature": 0}
    body |= rng.choice([{}, {"top_logprobs": 0}, {"include": ["reasoning.encrypted_content"]}])
    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    assert _message_entries(r.json()) == [], (rng_seed, body)


@pytest.mark.parametrize("bad", [MAX_LOGPROBS + 1, -1, "3", 2.5, True])
def test_a_bad_top_logprobs_is_refused_by_name(client, rng_seed, bad):
    rng = random.Random(rng_seed)
    body = {"input": _words(rng, 3), "top_logprobs": bad}
    if rng.random() < 0.5:
        body["include"] = ["message.output_text.logprobs"]
    r = client.post(URL, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "top_logprobs" and "top_logprobs" in error["message"], error


def test_reasoning_and_call_tokens_stay_out_of_the_message(scripted_client, read_sse, rng_seed):
    """A scripted reply: reasoning, text, a call, more text, maybe another call. The scripted
    engine's made-up logprob of a token is -0.5 * (its position + 1), so each entry names its
    token's position: none may fall in the reasoning or a call."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    tool = {"type": "function", "name": "look",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}  # fmt: skip
    thought = _words(rng, rng.randint(1, 6))
    reply = f"<think>\n{thought}\n</think>\n\n{_words(rng, rng.randint(1, 6))}"
    for _ in range(rng.randint(1, 2)):
        call = {"name": "look", "arguments": {"q": _words(rng, 2)}}
        reply += f"\n<tool_call>\n{json.dumps(call)}\n</tool_call>\n{_words(rng, 3)}"
    fake.replies = [(reply, "stop")] * 3
    user = _words(rng, 3)
    chat_tool = {"type": "function", "function": {k: tool[k] for k in ("name", "parameters")}}
    chat = {"messages": [{"role": "user", "content": user}], "max_tokens": 500,
            "logprobs": True, "top_logprobs": 1, "tools": [chat_tool]}  # fmt: skip
    expected = _chat_content_entries(client, chat, read_sse)
    body = {"input": user, "tools": [tool], "max_output_tokens": 500, "top_logprobs": 1,
            "include": ["message.output_text.logprobs"]}  # fmt: skip
    whole = client.post(URL, json=body)
    assert whole.status_code == 200, whole.text
    kinds = [item["type"] for item in whole.json()["output"]]
    assert kinds.count("message") >= 2 and "function_call" in kinds, kinds
    entries = _message_entries(whole.json())
    _same_entries(entries, expected, rng_seed)
    positions = [round(-e["logprob"] / 0.5) - 1 for e in entries]
    assert positions == sorted(positions) and positions, rng_seed
    ids = fake.tokenizer.encode(reply)
    ends = [len(fake.tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]  # text so far

    def span(opening: str, closing: str, at: int) -> range:
        """The positions of the tokens from `opening`'s first character to `closing`'s last."""
        start = reply.index(opening, at)
        stop = reply.index(closing, start) + len(closing)
        return range(next(i for i, n in enumerate(ends) if n > start),
                     next(i for i, n in enumerate(ends) if n >= stop) + 1)  # fmt: skip

    # The reasoning's own tokens; its closing marker goes with the first text, as the chat
    # route sends it with its first content chunk (the parser reports no event for it).
    blocks = [span("<think>", thought, 0)]
    at = 0
    while "<tool_call>" in reply[at:]:
        blocks.append(span("<tool_call>", "</tool_call>", at))
        at = reply.index("</tool_call>", at) + 1
    assert not any(p in block for p in positions for block in blocks), (rng_seed, positions)
    r = client.post(URL, json={**body, "stream": True})
    events = named_events(r.text)
    streamed = [e for n, d in events if n == "response.output_text.delta" for e in d["logprobs"]]
    assert streamed == entries, rng_seed
