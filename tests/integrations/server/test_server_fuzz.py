"""Fuzzing a real server (hypothesis): whatever a client sends, a 4xx with an error object.

One uvicorn server on a loopback port for the module. Every answer to bad input must be a 4xx
with an OpenAI error object (never a 5xx, never a hang: every request has a client timeout),
and after the runs the engine holds nothing (no unfinished request, integrity checks pass,
every KV page free once the prefix cache lets go).

Strategies, with modest example counts: arbitrary JSON values (`st.recursive`), objects keyed
mostly by the real field names, arbitrary bytes, valid requests cut short, and valid requests
with one field, anywhere in the body (top level, a message, a tool call, a tool), replaced by a
value of a wrong type, which must be a 400 naming that field. The same wrong-type requests go
through the WebSocket `send` message. Valid requests drawn by the same strategy are checked to
succeed, so the mutations start from requests that really are valid.
"""

from __future__ import annotations

import copy
import json
import string
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

MAX_BODY = 64 * 1024
URL = "/v1/chat/completions"
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    # default_max_tokens small: a fuzzed body that happens to be valid ends quickly.
    return start_server(model_dir, max_body_bytes=MAX_BODY, default_max_tokens=4)


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=30) as client:
        yield client


# --- strategies ------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stream", "stream_options", "tools", "tool_choice", "response_format", "n",
    "logprobs", "ignore_eos", "user", "metadata", "store", "parallel_tool_calls",
]  # fmt: skip
# Objects whose keys are mostly the real field names: random values then reach the checks of
# each field rather than stopping at "messages is missing".
field_objects = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=8), json_values, min_size=1, max_size=6
)

words = st.text(alphabet=string.ascii_letters + " .,!?'-é中", min_size=1, max_size=40)
names = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=10)


@st.composite
def valid_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A request the server must accept: a history (system, user, assistant with a tool call,
    the tool's result, user), optional tools and sampling fields, a small max_tokens."""
    tool_name = draw(names)
    tool = {
        "type": "function",
        "function": {
            "name": tool_name,
            "description": draw(words),
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string", "maxLength": 4}},
                "required": ["q"],
            },
        },
    }
    call = {
        "id": "call_" + draw(names),
        "type": "function",
        "function": {"name": tool_name, "arguments": json.dumps({"q": draw(words)})},
    }
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(words)})
    messages.append({"role": "user", "content": draw(words)})
    if draw(st.booleans()):
        messages += [
            {"role": "assistant", "content": draw(words | st.none()), "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": draw(words)},
            {"role": "user", "content": [{"type": "text", "text": draw(words)}]},
        ]
    body: dict[str, Any] = {
        "model": draw(st.sampled_from(["freetoken/qwen3_moe", None])),
        "messages": messages,
        draw(st.sampled_from(["max_tokens", "max_completion_tokens"])): draw(st.integers(1, 3)),
    }
    optional = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(0, 50),
        "seed": st.integers(0, 2**31),
        "stop": words | st.lists(words, min_size=1, max_size=2),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "ignore_eos": st.booleans(),
        "user": words,
        "parallel_tool_calls": st.booleans(),
        "n": st.integers(1, 2),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=5)):
        body[key] = draw(optional[key])
    if draw(st.booleans()) or len(messages) > 2:
        body["tools"] = [tool]
        body["tool_choice"] = draw(
            st.sampled_from(["auto", "none", {"type": "function", "function": {"name": tool_name}}])
        )
    return body


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Each field a request may carry, where it sits, and what types it takes (a predicate): a value
# failing it is a wrong type the server must refuse with 400 naming the top-level field.
OPTIONAL = {
    "model": lambda v: v is None or isinstance(v, str),
    "max_tokens": lambda v: v is None or _int(v),
    "max_completion_tokens": lambda v: v is None or _int(v),
    "temperature": lambda v: v is None or _number(v),
    "top_p": lambda v: v is None or _number(v),
    "top_k": lambda v: v is None or _int(v),
    "seed": lambda v: v is None or _int(v),
    "stop": lambda v: v is None or isinstance(v, (str, list)),
    "stream": lambda v: v is None or isinstance(v, bool),
    "stream_options": lambda v: v is None or isinstance(v, dict),
    "ignore_eos": lambda v: v is None or isinstance(v, bool),
    "user": lambda v: v is None or isinstance(v, str),
    "metadata": lambda v: v is None or isinstance(v, dict),
    "store": lambda v: v is None or isinstance(v, bool),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "tools": lambda v: v is None or isinstance(v, list),
    "tool_choice": lambda v: v is None or isinstance(v, (str, dict)),
    "response_format": lambda v: v is None or isinstance(v, dict),
}
REQUIRED_TEXT = lambda v: isinstance(v, str)  # noqa: E731
TEXT_OR_NONE = lambda v: v is None or isinstance(v, str)  # noqa: E731


def typed_paths(body: dict[str, Any]) -> list[tuple[tuple, Callable[[Any], bool]]]:
    """Every (path, accepts) of a valid request: its fields and those inside its messages,
    tool calls and tools."""
    paths: list[tuple[tuple, Callable[[Any], bool]]] = [((k,), ok) for k, ok in OPTIONAL.items()]
    paths.append((("messages",), lambda v: isinstance(v, list) and bool(v)))
    if isinstance(body.get("stream_options"), dict):
        include = lambda v: v is None or isinstance(v, bool)  # noqa: E731
        paths.append((("stream_options", "include_usage"), include))
    for i, msg in enumerate(body["messages"]):
        at = ("messages", i)
        paths += [(at, lambda v: isinstance(v, dict)), ((*at, "role"), REQUIRED_TEXT)]
        if msg["role"] == "user":
            paths.append(((*at, "content"), lambda v: isinstance(v, (str, list))))
        else:
            paths.append(((*at, "content"), lambda v: v is None or isinstance(v, (str, list))))
        paths += [((*at, "name"), TEXT_OR_NONE), ((*at, "reasoning_content"), TEXT_OR_NONE)]
        if msg["role"] == "tool":
            paths.append(((*at, "tool_call_id"), REQUIRED_TEXT))
        for j, _ in enumerate(msg.get("tool_calls") or []):
            call = (*at, "tool_calls", j)
            paths += [
                (call, lambda v: isinstance(v, dict)),
                ((*call, "id"), TEXT_OR_NONE),
                ((*call, "type"), lambda v: v == "function"),
                ((*call, "function"), lambda v: isinstance(v, dict)),
                ((*call, "function", "name"), REQUIRED_TEXT),
                ((*call, "function", "arguments"), lambda v: isinstance(v, (str, dict))),
            ]
        if isinstance(msg.get("content"), list):
            paths.append(((*at, "content", 0), lambda v: isinstance(v, dict)))
    for j, _ in enumerate(body.get("tools") or []):
        tool = ("tools", j)
        paths += [
            (tool, lambda v: isinstance(v, dict)),
            ((*tool, "type"), lambda v: v == "function"),
            ((*tool, "function"), lambda v: isinstance(v, dict)),
            ((*tool, "function", "name"), REQUIRED_TEXT),
            ((*tool, "function", "description"), TEXT_OR_NONE),
            ((*tool, "function", "parameters"), lambda v: v is None or isinstance(v, dict)),
            ((*tool, "function", "parameters", "type"), lambda v: v == "object"),
            ((*tool, "function", "parameters", "properties"), lambda v: isinstance(v, dict)),
        ]
    return paths


def _placeable(body: dict[str, Any], path: tuple) -> bool:
    node: Any = body
    for key in path[:-1]:
        inside = (isinstance(node, dict) and key in node) or (
            isinstance(node, list) and isinstance(key, int) and key < len(node)
        )
        if not inside:
            return False
        node = node[key]
    return isinstance(node, (dict, list))


def _put(body: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@st.composite
def wrongly_typed(draw: st.DrawFn) -> tuple[dict[str, Any], tuple]:
    """A valid request with one field, drawn from all of them, holding a value of a type it
    does not take (a string for a number, an object for a list, ...)."""
    body = draw(valid_requests())
    paths = [(p, ok) for p, ok in typed_paths(body) if _placeable(body, p)]
    path, accepts = draw(st.sampled_from(paths))
    value = draw(json_values.filter(lambda v: not accepts(v)))
    return _put(body, path, value), path


# --- fuzz: HTTP -----------------------------------------------------------------------------


@FUZZ
@given(body=json_values | field_objects)
def test_fuzz_arbitrary_json_bodies_get_a_4xx(server, http, body, api_error):
    error = api_error(http.post(URL, content=json.dumps(body).encode()))
    assert error["type"] == "invalid_request_error"


@FUZZ
@given(raw=st.binary(max_size=200))
def test_fuzz_arbitrary_bytes_get_a_4xx(server, http, raw, api_error):
    api_error(http.post(URL, content=raw, headers={"content-type": "application/json"}), 400)


@FUZZ
@given(body=valid_requests(), data=st.data())
def test_fuzz_valid_requests_cut_short_are_invalid_json(server, http, body, data, api_error):
    text = json.dumps(body, ensure_ascii=data.draw(st.booleans()))
    cut = data.draw(st.integers(0, len(text) - 1))
    error = api_error(http.post(URL, content=text[:cut].encode()), 400)
    assert error["code"] == "invalid_json"


@FUZZ
@given(case=wrongly_typed())
def test_fuzz_a_wrong_type_in_any_field_is_a_400_naming_it(server, http, case, api_error):
    body, path = case
    event("/".join("[i]" if isinstance(k, int) else k for k in path))  # coverage, in statistics
    error = api_error(http.post(URL, json=body), 400)
    assert error["param"] is not None, (path, error)
    root = error["param"].split("[")[0].split(".")[0]
    assert root == path[0], (path, error)


@settings(FUZZ, max_examples=15)
@given(body=valid_requests())
def test_fuzz_the_valid_requests_are_valid(server, http, body):
    """The base of the mutations above: what `valid_requests` draws, the server serves."""
    r = http.post(URL, json=body)
    assert r.status_code == 200, r.text[:400]
    if body.get("stream"):
        lines = [line for line in r.text.split("\n") if line]
        assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
        assert not any('"error"' in line for line in lines)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_after_the_http_fuzz_nothing_is_held(server, http, nothing_held):
    nothing_held(server.state.service)
    assert http.get("/health").json()["requests"]["running"] == 0


# --- fuzz: the WebSocket ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def socket_url(server) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/sessions/fuzz/ws"


SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
            "stop", "ignore_eos"}  # fmt: skip
SEND_FIELDS = {"messages", "tools", "tool_choice", "response_format", "model"}


def _ws_refused(ws, *, done: bool = True) -> dict[str, Any]:
    """The next events are an error (and the done that ends the refused turn)."""
    error = json.loads(ws.recv(timeout=30))
    assert error["type"] == "error" and isinstance(error["message"], str), error
    if done:
        assert json.loads(ws.recv(timeout=30)) == {
            "type": "done",
            "turn": None,
            "finish_reason": "error",
        }
    return error


@settings(FUZZ, max_examples=40)
@given(
    message=st.text(max_size=60)
    | json_values.map(json.dumps)
    | field_objects.map(lambda d: json.dumps({**d, "type": "send"})),
    case=wrongly_typed(),
)
def test_fuzz_websocket_messages_get_an_error_and_the_socket_stays(socket_url, message, case):
    body, path = case
    with connect(socket_url, open_timeout=30) as ws:
        ws.recv(timeout=30), ws.recv(timeout=30)  # session, memory
        ws.send(message)
        _ws_refused(ws)
        send = {"type": "send", "sampling": {k: v for k, v in body.items() if k in SAMPLING}}
        send.update({k: v for k, v in body.items() if k in SEND_FIELDS})
        if path[0] in SAMPLING | SEND_FIELDS:  # the socket takes that field: the same refusal
            ws.send(json.dumps(send))
            error = _ws_refused(ws)
            assert error["param"] is not None and error["param"].split("[")[0] == path[0]


def test_after_the_websocket_fuzz_the_session_still_works(server, socket_url, nothing_held):
    with connect(socket_url, open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["running"] is False
        ws.recv(timeout=30)
        ws.send(json.dumps({"type": "send", "messages": [{"role": "user", "content": "hi"}],
                            "sampling": {"max_tokens": 2}}))  # fmt: skip
        events = [json.loads(ws.recv(timeout=30))]
        while events[-1]["type"] != "done":
            events.append(json.loads(ws.recv(timeout=30)))
        assert events[-1]["finish_reason"] in ("stop", "length")
    nothing_held(server.state.service)
