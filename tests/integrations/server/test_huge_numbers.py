"""Numbers too large to be read as a float or as an int, and compressed bodies: a 400 (or 415)
in the route's own error shape that names the problem, never a 500 or a dropped socket.

JSON has no size limit on numbers. Python reads an integer of up to 4300 digits (more raises
ValueError inside json.loads) and fails to turn one past ~1e308 into a float (OverflowError in
math.isfinite, or in a message's float formatting)."""

from __future__ import annotations

import gzip
import json
import random

import pytest

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]

# Every route with a numeric sampling field, the fields and a body each reads them from.
FIELDS = {
    CHAT: (["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
            "min_tokens"], {"messages": USER}),
    TEXT: (["max_tokens", "temperature", "top_p", "seed", "min_tokens"], {"prompt": "hi"}),
    MESSAGES: (["max_tokens", "temperature", "top_p", "top_k"],
               {"messages": USER, "max_tokens": 4}),
    RESPONSES: (["max_output_tokens", "temperature", "top_p"], {"input": "hi"}),
}  # fmt: skip
# Every route that reads a JSON body.
JSON_ROUTES = [CHAT, TEXT, MESSAGES, RESPONSES, "/v1/messages/count_tokens",
               "/v1/responses/input_tokens", "/tokenize", "/detokenize"]  # fmt: skip


def _huge(rng: random.Random, digits: int) -> str:
    """A random integer of exactly `digits` digits, either sign, as JSON text (Python itself
    cannot print one of more than 4300)."""
    text = str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(digits - 1))
    return text if rng.random() < 0.5 else "-" + text


def _message(r) -> str:
    body = r.json()
    return body["error"]["message"]


@pytest.mark.parametrize("route", list(FIELDS))
def test_an_integer_past_the_float_range_is_a_400_naming_its_field(client, rng_seed, route):
    rng = random.Random(rng_seed)
    fields, body = FIELDS[route]
    for field in rng.sample(fields, min(4, len(fields))):
        raw = json.dumps({**body, field: 0}).replace(
            f'"{field}": 0', f'"{field}": ' + _huge(rng, rng.randint(310, 4000))
        )
        r = client.post(route, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (field, r.text[:300])
        message = _message(r)
        assert field in message or field in json.dumps(r.json()), (field, message)
        assert "digits" in message or "must be" in message, message
        assert len(message) < 400, "the number itself must not be echoed whole"
    assert client.post(CHAT, json={"messages": USER, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("route", JSON_ROUTES)
def test_an_integer_longer_than_python_reads_is_a_400(client, rng_seed, route):
    rng = random.Random(rng_seed)
    digits = rng.randint(4301, 6000)
    key = rng.choice(["max_tokens", "temperature", "anything_else", "seed"])
    raw = '{"messages": [], "prompt": "x", "input": "x", "' + key + '": ' + _huge(rng, digits) + "}"
    r = client.post(route, content=raw.encode())
    assert r.status_code == 400, r.text[:300]
    message = _message(r)
    assert "integer of more than" in message and "digits" in message, message


def test_a_websocket_frame_with_a_huge_integer_is_refused_on_an_open_socket(client, rng_seed):
    rng = random.Random(rng_seed)
    with client.websocket_connect(f"/v1/sessions/huge-{rng_seed}/ws") as ws:
        ws.receive_json(), ws.receive_json()  # session, memory
        for digits in (rng.randint(310, 4000), rng.randint(4301, 6000)):
            raw = json.dumps({"type": "send", "messages": USER,
                              "sampling": {"max_tokens": 4, "temperature": 0}})  # fmt: skip
            raw = raw.replace('"temperature": 0', f'"temperature": {_huge(rng, digits)}')
            ws.send_text(raw)
            error = ws.receive_json()
            assert error["type"] == "error" and "digits" in error["message"], error
            assert ws.receive_json()["type"] == "done"
        ws.send_json({"type": "send", "messages": USER, "sampling": {"max_tokens": 2}})
        assert ws.receive_json()["type"] == "start"  # the socket still serves


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP"])
def test_a_compressed_body_is_a_415_naming_the_encoding(client, rng_seed, encoding):
    rng = random.Random(rng_seed)
    route = rng.choice([CHAT, TEXT, RESPONSES])
    body = json.dumps({"messages": USER, "prompt": "hi", "input": "hi", "max_tokens": 2})
    headers = {"content-encoding": encoding, "content-type": "application/json"}
    r = client.post(route, content=gzip.compress(body.encode()), headers=headers)
    assert r.status_code == 415, r.text
    assert encoding in _message(r) and "uncompressed" in _message(r)
    r = client.post(MESSAGES, content=b"{}", headers={"content-encoding": encoding})
    assert r.status_code == 415 and r.json()["type"] == "error", r.text  # Anthropic's shape
    # identity, or no header, is a plain body
    plain = client.post(route, content=body.encode(), headers={"content-encoding": "identity"})
    assert plain.status_code == 200, plain.text


def test_a_lone_surrogate_escape_is_refused_as_one(client, rng_seed):
    """The body's other refusal raised inside the JSON reading (a lone UTF-16 surrogate) keeps
    its own message: it is a ValueError too, and must not read as a too-long integer."""
    rng = random.Random(rng_seed)
    lone = rng.choice(["\\ud800", "\\udfff", "\\udbff"])
    raw = '{"messages": [{"role": "user", "content": "a' + lone + 'b"}], "max_tokens": 2}'
    r = client.post(CHAT, content=raw.encode())
    assert r.status_code == 400, r.text
    assert "surrogate" in _message(r) and "digits" not in _message(r)


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES, TEXT])
def test_a_float_literal_past_the_float_range_is_a_400_wherever_it_sits(client, rng_seed, route):
    """JSON reads 1e400 as inf, which a range check compares like any number and a response
    that echoes the field (Responses' metadata and tools) could not render: a plain-text 500
    after the whole generation. Refused while the body is read, whatever field holds it."""
    rng = random.Random(rng_seed)
    literal = f"{rng.choice(['', '-'])}{rng.randint(1, 9)}e{rng.randint(309, 5000)}"
    body = {"messages": USER, "max_tokens": 2, "prompt": "hi", "input": "hi"}
    schema = {"type": "object", "properties": {"x": {"type": "number", "maximum": 0}}}
    placed = rng.choice(["metadata", "tools", "temperature"])
    if placed == "metadata":
        body["metadata"] = {"a": 0}
    elif placed == "tools" and route == RESPONSES:
        body["tools"] = [{"type": "function", "name": "f", "parameters": schema}]
    elif placed == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    else:
        body["temperature"] = 0
    raw = json.dumps(body)
    for zero in ('"a": 0', '"maximum": 0', '"temperature": 0'):
        raw = raw.replace(zero, zero[:-1] + literal)
    assert literal in raw
    r = client.post(route, content=raw.encode())
    assert r.status_code == 400, r.text[:300]
    assert "beyond a 64-bit float's range" in _message(r)
    assert client.post(CHAT, json={"messages": USER, "max_tokens": 2}).status_code == 200


def test_long_token_ids_and_budgets_are_not_echoed_whole(client, rng_seed):
    rng = random.Random(rng_seed)
    huge = _huge(rng, rng.randint(300, 4000)).lstrip("-")
    for route, raw in [
        (TEXT, '{"prompt": [' + huge + '], "max_tokens": 2}'),
        (TEXT, '{"prompt": [[1, ' + huge + ']], "max_tokens": 2}'),
        ("/v1/memory/budget", '{"bytes": ' + huge + "}"),
    ]:
        r = client.post(route, content=raw.encode())
        assert 400 <= r.status_code < 500, r.text[:300]
        assert len(_message(r)) < 400 and "digits" in _message(r), _message(r)[:300]
