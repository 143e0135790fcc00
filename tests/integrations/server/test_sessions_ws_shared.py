"""A WebSocket session shared with the other routes, and the socket's own protocol edges:
an OpenAI request on the session (X-Session-Id) runs as the session's turn, which a joining
socket sees running, any socket may cancel, and an `append` send meanwhile is refused as
busy; an `append` send's refusals name its own messages (`messages[i]`) and the kept ones
(`history[i]`); a message over the size limit gets its `done` too; `sampling` and `append`
take only their own types; a socket joining mid-turn gets its hello whole, first, and one
joining after the engine closed an error."""

from __future__ import annotations

import dataclasses
import random
import string
import threading

import pytest
from starlette.websockets import WebSocketDisconnect

from freetoken_agent.integrations.server.sessions_ws import turn_request
from freetoken_agent.integrations.server.turn_run import TurnRun
from freetoken_agent.messages import messages_from_openai

URL = "/v1/sessions/{}/ws"


def _text(rng: random.Random) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6)))
        for _ in range(rng.randint(2, 6))
    )


def _until(ws, kind: str) -> list[dict]:
    events = []
    while True:
        events.append(ws.receive_json())
        if events[-1]["type"] == kind:
            return events


def _hello(ws) -> tuple[dict, dict]:
    session, memory = ws.receive_json(), ws.receive_json()
    assert (session["type"], memory["type"]) == ("session", "memory"), (session, memory)
    return session, memory


def _long_chat(client, sid: str, rng: random.Random, out: dict) -> threading.Thread:
    """A chat request on session `sid` that would write to the context's end, in a thread."""
    body = {"messages": [{"role": "user", "content": _text(rng)}], "max_tokens": 900,
            "ignore_eos": True, "temperature": 0.8, "seed": rng.randrange(1 << 30)}  # fmt: skip

    def post() -> None:
        out["response"] = client.post("/v1/chat/completions", json=body,
                                      headers={"X-Session-Id": sid})  # fmt: skip

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_an_openai_turn_on_the_session_is_its_running_turn(client, rng_seed):
    rng = random.Random(rng_seed)
    sid = f"shared-{rng.randrange(1 << 30)}"
    out: dict = {}
    with client.websocket_connect(URL.format(sid)) as ws:
        _hello(ws)
        thread = _long_chat(client, sid, rng, out)
        start = _until(ws, "start")[-1]
        with client.websocket_connect(URL.format(sid)) as late:  # joins mid-turn
            session, _ = _hello(late)
            assert session["running"] is True, session
            ws.send_json({"type": "send", "append": True,
                          "messages": [{"role": "user", "content": _text(rng)}]})  # fmt: skip
            refused = _until(ws, "error")[-1]
            assert refused["param"] == "type" and "already running" in refused["message"]
            late.send_json({"type": "cancel"})  # any watcher may
            done = _until(late, "done")[-1]
            assert done["turn"] == start["turn"] and done["finish_reason"] == "abort", done
    thread.join(60)
    assert not thread.is_alive()
    r = out["response"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] < 900  # cut short by the cancel


def test_append_refusals_name_the_sent_messages(client, rng_seed):
    rng = random.Random(rng_seed)
    with client.websocket_connect(URL.format(f"a-{rng.randrange(1 << 30)}")) as ws:
        _hello(ws)
        for _ in range(rng.randint(1, 2)):  # a kept history of 2 messages a turn
            ws.send_json({"type": "send", "append": True, "sampling": {"max_tokens": 3},
                          "messages": [{"role": "user", "content": _text(rng)}]})  # fmt: skip
            assert _until(ws, "done")[-1]["finish_reason"] in ("stop", "length")
        good = [{"role": "user", "content": _text(rng)} for _ in range(rng.randint(0, 3))]
        bad = {"role": rng.choice(["robot", "wizard"]), "content": _text(rng)}
        messages = [*good, bad]
        ws.send_json({"type": "send", "append": True, "messages": messages})
        events = _until(ws, "done")
        error = next(e for e in events if e["type"] == "error")
        assert error["param"] == f"messages[{len(good)}]", error
        assert f"messages[{len(good)}]" in error["message"], error


def test_an_oversized_message_gets_its_done(make_client, rng_seed):
    rng = random.Random(rng_seed)
    limit = rng.randint(2000, 4000)
    client = make_client(max_body_bytes=limit)
    with client.websocket_connect(URL.format(f"big-{rng.randrange(1 << 30)}")) as ws:
        _hello(ws)
        # Fewer characters than the limit, more bytes: three bytes a character.
        text = "€" * (limit // 3 + rng.randint(10, 200))
        assert len(text) < limit < len(text.encode())
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": text}]})
        events = _until(ws, "done")
        assert [e["type"] for e in events] == ["error", "done"], events
        assert events[0]["code"] == "message_too_large" and events[1]["turn"] is None


@pytest.mark.parametrize("field", ["sampling", "append"])
def test_sampling_and_append_take_only_their_types(client, rng_seed, field):
    rng = random.Random(rng_seed)
    wrong = rng.choice([False, 0, ""] if field == "sampling" else ["false", 1, "yes", []])
    with client.websocket_connect(URL.format(f"t-{rng.randrange(1 << 30)}")) as ws:
        _hello(ws)
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": _text(rng)}],
                      field: wrong})  # fmt: skip
        events = _until(ws, "done")
        assert [e["type"] for e in events] == ["error", "done"], events
        assert events[0]["param"] == field, events[0]


def test_a_join_after_the_engine_closed_gets_an_error(client, rng_seed):
    rng = random.Random(rng_seed)
    client.app.state.server.service.engine.close()
    with client.websocket_connect(URL.format(f"c-{rng.randrange(1 << 30)}")) as ws:
        event = ws.receive_json()
        assert event["type"] == "error" and "not serving" in event["message"], event
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1011


def test_an_append_goes_after_the_history_kept_when_it_runs(client, rng_seed):
    """A send built on one kept history, run after another turn ended: its new messages go
    after the history kept then (the other turn's), not the one it was built on."""
    rng = random.Random(rng_seed)
    hub = client.app.state.server.hub
    live = hub.get(f"r-{rng.randrange(1 << 30)}")
    old = messages_from_openai([{"role": "user", "content": _text(rng)},
                                {"role": "assistant", "content": _text(rng)}])  # fmt: skip
    live.history = old
    new = {"role": "user", "content": _text(rng)}
    request = turn_request({"type": "send", "append": True, "messages": [new]}, live,
                           client.app.state.server)  # fmt: skip
    assert request.based_on is old and len(request.messages) == 3
    other = [{"role": "user", "content": _text(rng)}] * 2
    live.history = messages_from_openai([*other, {"role": "assistant", "content": _text(rng)}])
    rebased = TurnRun(live, request)._rebased()
    assert rebased.messages == [*live.history, request.messages[-1]]
    assert rebased.based_on is live.history
    live.history = rebased.messages  # unchanged since: as built
    same = dataclasses.replace(request, based_on=live.history)
    assert TurnRun(live, same)._rebased() is same


def test_a_turn_the_engines_close_ends_still_reports_its_usage(client, rng_seed):
    rng = random.Random(rng_seed)
    with client.websocket_connect(URL.format(f"e-{rng.randrange(1 << 30)}")) as ws:
        _hello(ws)
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": _text(rng)}],
                      "sampling": {"max_tokens": 900, "ignore_eos": True}})  # fmt: skip
        _until(ws, "start")
        client.app.state.server.service.engine.close()  # as at a shutdown, mid-turn
        events = _until(ws, "done")
        usage = [e for e in events if e["type"] == "usage"]
        assert len(usage) == 1 and usage[0]["completion_tokens"] < 900, events
        assert events[-1]["finish_reason"] in ("abort", "error"), events[-1]


def test_an_append_without_tools_keeps_the_sessions_tools(client, rng_seed):
    rng = random.Random(rng_seed)
    name = "t_" + "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    live_id = f"k-{rng.randrange(1 << 30)}"
    with client.websocket_connect(URL.format(live_id)) as ws:
        _hello(ws)
        prompts = []
        for extra in ({"tools": tools}, {}, {"tools": []}):
            said = [{"role": "user", "content": _text(rng)}]
            ws.send_json({"type": "send", "append": True, "sampling": {"max_tokens": 2},
                          "messages": said, **extra})  # fmt: skip
            assert _until(ws, "done")[-1]["finish_reason"] in ("stop", "length")
            prompts.append(client.app.state.server.hub.get(live_id).session.last_prompt.text)
    assert name in prompts[0] and name in prompts[1]  # kept by the send that named none
    assert name not in prompts[2]  # "tools": [] offers none


def test_a_queued_append_reads_the_history_the_turn_before_it_kept(client, rng_seed, monkeypatch):
    """Turn A runs; an append B, built on the history before A, waits for the turn lock. A's
    worker holds the lock until the loop has kept A's history, so B starts from it: B's prompt
    holds A's exchange, and the history after B holds both. (The loop is made slow to keep
    it here: a worker that let go of the lock first let B read the history without A.)"""
    import asyncio
    import time as clock

    rng = random.Random(rng_seed)
    state = client.app.state.server
    live = state.hub.get(f"q-{rng.randrange(1 << 30)}")
    first, second = _text(rng), _text(rng)
    sampling = {"max_tokens": 3}
    said_a, said_b = [{"role": "user", "content": first}], [{"role": "user", "content": second}]
    request_a = turn_request({"type": "send", "messages": said_a, "sampling": sampling}, live,
                             state)  # fmt: skip
    request_b = turn_request({"type": "send", "append": True, "messages": said_b,
                              "sampling": sampling}, live, state)  # fmt: skip
    assert request_b.based_on == [] and len(request_b.messages) == 1
    done = TurnRun._done

    def slow_done(self):  # the loop busy elsewhere when A's end comes
        clock.sleep(0.3)
        done(self)

    monkeypatch.setattr(TurnRun, "_done", slow_done)

    async def both():
        a, b = TurnRun(live, request_a), TurnRun(live, request_b)
        await a.start()
        b_started = asyncio.ensure_future(b.start())  # its worker waits for the lock
        async for _ in a.events():
            pass
        await b_started
        async for _ in b.events():
            pass
        return b

    b = asyncio.run(both())
    texts = [m.content for m in live.history if hasattr(m, "content")]
    assert first in texts and second in texts, texts
    assert first in live.session.last_prompt.text and b.request.based_on is not None
