"""The WebSocket session stream: turns on a kept Session, watchers, cancel, errors."""

from __future__ import annotations

import json
import random
import string
import threading
import time

import pytest
import torch
from starlette.websockets import WebSocketDisconnect

URL = "/v1/sessions/{}/ws"


def _text(rng: random.Random) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6)))
        for _ in range(rng.randint(2, 8))
    )


def _until_done(ws) -> list[dict]:
    events = []
    while True:
        event = ws.receive_json()
        events.append(event)
        if event["type"] == "done":
            return events


def _join(ws) -> list[dict]:
    """What a socket gets when it joins: the session, then the memory split."""
    hello = [ws.receive_json(), ws.receive_json()]
    assert [e["type"] for e in hello] == ["session", "memory"]
    return hello


def _send(ws, rng: random.Random, max_tokens: int | None = None, **extra) -> None:
    sampling = {"max_tokens": max_tokens or rng.randint(3, 8), "temperature": 0}
    ws.send_json(
        {"type": "send", "append": True, "messages": [{"role": "user", "content": _text(rng)}],
         "sampling": sampling, **extra}
    )  # fmt: skip


def test_two_turns_the_second_reuses_and_a_watcher_sees_the_same(client, rng_seed):
    rng = random.Random(rng_seed)
    sid = f"s-{rng_seed}"
    with client.websocket_connect(URL.format(sid)) as watcher:
        _join(watcher)
        with client.websocket_connect(URL.format(sid)) as ws:
            session, memory = _join(ws)
            assert session == {"type": "session", "id": sid, "turns": 0, "running": False,
                               "history": []}  # fmt: skip
            assert memory["kv_pages"] > 0 and "experts" in memory

            _send(ws, rng)
            first = _until_done(ws)
            assert _until_done(watcher) == first
            kinds = [e["type"] for e in first]
            assert kinds[0] == "start" and kinds[-3:] == ["usage", "memory", "done"]
            assert set(kinds[1:-3]) <= {"reasoning", "content", "tool_call", "warning"}
            usage, done = first[-3], first[-1]
            assert usage["completion_tokens"] > 0 and usage["exact"]
            text = "".join(e["text"] for e in first if e["type"] == "content")
            assert done["message"]["content"] in (text, None)

            _send(ws, rng)
            second = _until_done(ws)
            assert _until_done(watcher) == second
            usage = second[-3]
            assert second[0]["turn"] == 1
            # The kept history (turn 1 and its reply) is a prefix of turn 2's prompt.
            assert usage["reused_tokens"] > 0
            assert usage["first_divergence"] >= usage["reused_tokens"]
            assert usage["anchor"]["offset"] <= usage["first_divergence"]
            assert usage["prompt_tokens"] > first[-3]["prompt_tokens"]

        with client.websocket_connect(URL.format(sid)) as late:
            session, _ = _join(late)
            assert session["turns"] == 2 and len(session["history"]) == 4
            assert [m["role"] for m in session["history"]] == ["user", "assistant"] * 2


def test_full_history_mode_and_tool_results_are_published(client, rng_seed):
    rng = random.Random(rng_seed)
    call_id = f"call_{rng.randrange(16**8):08x}"
    messages = [
        {"role": "user", "content": _text(rng)},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "lookup", "arguments": json.dumps({"q": _text(rng)})}}]},
        {"role": "tool", "tool_call_id": call_id, "name": "lookup", "content": _text(rng)},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
    with client.websocket_connect(URL.format("tools")) as ws:
        _join(ws)
        ws.send_json({"type": "send", "messages": messages, "tools": tools,
                      "sampling": {"max_tokens": 3}})  # fmt: skip
        events = _until_done(ws)
    results = [e for e in events if e["type"] == "tool_result"]
    assert results == [
        {"type": "tool_result", "tool_call_id": call_id, "name": "lookup",
         "content": messages[2]["content"], "is_error": False}
    ]  # fmt: skip


def test_forced_tool_call_streams_tool_call_events(client, rng_seed):
    rng = random.Random(rng_seed)
    name = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}}]
    with client.websocket_connect(URL.format("forced")) as ws:
        _join(ws)
        _send(ws, rng, max_tokens=60, tools=tools, tool_choice="required")
        events = _until_done(ws)
    calls = [e for e in events if e["type"] == "tool_call"]
    assert calls[0]["phase"] == "start" and calls[0]["name"] == name
    assert calls[-1]["phase"] == "end" and 0 <= calls[-1]["arguments"]["n"] <= 99
    args = "".join(e["text"] for e in calls if e["phase"] == "arguments")
    assert json.loads(args) == calls[-1]["arguments"]
    assert events[-1]["finish_reason"] == "tool_calls"
    assert events[-1]["message"]["tool_calls"][0]["function"]["name"] == name
    usage = [e for e in events if e["type"] == "usage"]  # the UI shows its reason
    assert [e["finish_reason"] for e in usage] == ["tool_calls"], usage


def test_cancel_and_a_closing_sender_abort_the_turn(client, engine, rng_seed):
    rng = random.Random(rng_seed)
    service = client.app.state.server.service
    long = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.8}
    with client.websocket_connect(URL.format("c")) as ws:
        _join(ws)
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": _text(rng)}],
                      "sampling": long})  # fmt: skip
        assert ws.receive_json()["type"] == "start"
        busy = {"type": "send", "messages": [{"role": "user", "content": "x"}]}
        ws.send_json(busy)  # a second turn while one runs is refused, the first goes on
        ws.send_json({"type": "cancel"})
        events = _until_done(ws)
        assert any(e["type"] == "error" and "already running" in e["message"] for e in events)
        events = [e for e in events if e["type"] != "error"]
        if events[-1]["turn"] is None:  # the refusal's own done came first
            events = _until_done(ws)
        usage = next(e for e in events if e["type"] == "usage")
        assert usage["finish_reason"] == "abort" and usage["completion_tokens"] < 900

        ws.send_json({"type": "send", "messages": [{"role": "user", "content": _text(rng)}],
                      "sampling": long})  # fmt: skip
        assert ws.receive_json()["type"] == "start"
    # The sender closed its socket mid-turn: the request is aborted.
    deadline = time.monotonic() + 10
    while service.stats()["requests"]["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    with service.lock:
        assert not engine.has_unfinished()
        engine.check_integrity()
        # Run to its end, the second turn would have generated all 900 tokens.
        assert engine.stats()["tokens"]["generated"] < usage["completion_tokens"] + 900
        engine.radix.reset()
        assert engine.kv.allocator.n_free == engine.kv.allocator.capacity


def _done_within(ws, seconds: float) -> list[dict]:
    """_until_done, failing (not hanging) when no done comes in time."""
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(events=_until_done(ws)), daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "no 'done' came"
    return out["events"]


def test_a_cancel_before_the_turn_starts_ends_it(client, rng_seed):
    """A cancel that comes before the turn's worker runs (both frames at once, or the turn
    waiting for the session's lock behind another): the turn ends with its done (abort).
    It ended with nothing, and the session stayed running, refusing every later send."""
    rng = random.Random(rng_seed)
    sid = f"early-{rng_seed}"
    with client.websocket_connect(URL.format(sid)) as ws:
        _join(ws)
        live = client.app.state.server.hub.get(sid)
        with live.turn_lock:  # the worker waits here, as behind another turn of the session
            _send(ws, rng)
            ws.send_json({"type": "cancel"})
            deadline = time.monotonic() + 10
            while live.running is None or not live.running.turn.cancelled:
                assert time.monotonic() < deadline, "the cancel never reached the turn"
                time.sleep(0.005)
        events = _done_within(ws, 30)
        assert events[-1] == {"type": "done", "turn": None, "finish_reason": "abort"}, events
        assert live.running is None and live.history == []  # nothing written: no trace
        _send(ws, rng)  # the session is free again
        events = _done_within(ws, 60)
        assert events[0]["type"] == "start" and events[-1]["finish_reason"] in ("stop", "length")


def test_an_interrupted_turn_stays_for_the_next_append(client, rng_seed):
    """A turn cancelled after writing something stays in the kept history, its question and
    what was written (no calls), as chat UIs keep a stopped answer: an `append` steering it
    is read with the question it interrupts, and reuses its KV. It was dropped whole."""
    rng = random.Random(rng_seed)
    sid = f"steer-{rng_seed}"
    question = _text(rng)
    with client.websocket_connect(URL.format(sid)) as ws:
        _join(ws)
        ws.send_json({"type": "send", "append": True,
                      "messages": [{"role": "user", "content": question}],
                      "sampling": {"max_tokens": 900, "ignore_eos": True}})  # fmt: skip
        written = 0
        while written < 3:  # some reasoning or content out, then the interrupt
            event = ws.receive_json()
            written += event["type"] in ("reasoning", "content")
        ws.send_json({"type": "cancel"})
        events = _until_done(ws)
        usage = next(e for e in events if e["type"] == "usage")
        assert events[-1]["finish_reason"] == "abort" and usage["completion_tokens"] < 900
        with client.websocket_connect(URL.format(sid)) as page:  # a page joining now
            history = _join(page)[0]["history"]
        assert [m["role"] for m in history] == ["user", "assistant"]
        assert history[0]["content"] == question and not history[1].get("tool_calls")
        partial = history[1]
        assert partial.get("content") or partial.get("reasoning_content")
        _send(ws, rng)  # steering: the question and the partial answer come first
        usage = next(e for e in _until_done(ws) if e["type"] == "usage")
        assert usage["reused_tokens"] > 0


@pytest.mark.parametrize("sender", ["socket", "openai_stream"])
def test_a_turn_whose_sender_leaves_still_ends_for_its_watchers(client, rng_seed, sender):
    """The sender's task read the turn's events; it is cancelled when the sender leaves, and
    the watchers must still get the aborted turn's usage and done (every turn ends with one)."""
    rng = random.Random(rng_seed)
    sid = f"left-{rng_seed}"
    service = client.app.state.server.service
    user = [{"role": "user", "content": _text(rng)}]
    with client.websocket_connect(URL.format(sid)) as watcher:
        _join(watcher)
        if sender == "socket":
            with client.websocket_connect(URL.format(sid)) as ws:
                _join(ws)
                long = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.8}
                ws.send_json({"type": "send", "messages": user, "sampling": long})
                assert ws.receive_json()["type"] == "start"
                for _ in range(rng.randint(0, 3)):
                    ws.receive_json()
        else:
            body = {"messages": user, "max_tokens": 900, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body,
                               headers={"X-Session-Id": sid}) as r:  # fmt: skip
                chunks, leave = 0, rng.randint(1, 4)
                for line in r.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == leave:
                        break
        deadline = time.monotonic() + 10
        while service.stats()["requests"]["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        # The left turn's done, then a turn of the watcher's own. (The left turn runs until
        # its done is published, a moment after its request ended: a send before that is
        # refused as busy, as any send during another's turn is.)
        events = []
        while not events or events[-1] != {**events[-1], "type": "done", "turn": 0}:
            events.append(watcher.receive_json())
        _send(watcher, rng, max_tokens=2)
        while events[-1] != {**events[-1], "type": "done", "turn": 1}:
            events.append(watcher.receive_json())
    assert events[0]["type"] == "start" and events[0]["turn"] == 0
    dones = [(e["turn"], e["finish_reason"]) for e in events if e["type"] == "done"]
    assert dones[0] == (0, "abort") and len(dones) == 2, dones
    usage = [e for e in events if e["type"] == "usage"]
    assert usage[0]["finish_reason"] == "abort" and usage[0]["completion_tokens"] < 900


def test_bad_messages_get_an_error_and_the_socket_stays(client, rng_seed):
    rng = random.Random(rng_seed)
    with client.websocket_connect(URL.format("bad")) as ws:
        _join(ws)
        ws.send_text('{"type": "send", "messages": [')
        error = ws.receive_json()
        assert error["type"] == "error" and "not valid JSON" in error["message"]
        assert ws.receive_json() == {"type": "done", "turn": None, "finish_reason": "error"}
        ws.send_json({"type": "send", "messages": [{"role": "wizard", "content": "x"}]})
        error = ws.receive_json()
        assert error["param"] == "messages[0]" and "unknown role 'wizard'" in error["message"]
        ws.receive_json()
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": "x"}],
                      "sampling": {"temprature": 1}})  # fmt: skip
        assert "temprature" in ws.receive_json()["message"]
        ws.receive_json()
        ws.send_json({"type": "dance"})
        assert "unknown message type" in ws.receive_json()["message"]
        ws.receive_json()
        ws.send_json({"type": "cancel"})
        assert "no turn is running" in ws.receive_json()["message"]
        # A binary frame is UTF-8 JSON, refused as the HTTP body is when it is not (it was
        # decoded with replacement characters and run).
        word = "caf\u00e9 " * rng.randint(1, 5)
        latin = {"type": "send", "messages": [{"role": "user", "content": word}]}
        ws.send_bytes(json.dumps(latin, ensure_ascii=False).encode("latin-1"))
        error = ws.receive_json()
        assert "not UTF-8" in error["message"] and error["code"] == "invalid_json", error
        ws.receive_json()
        # Past the context: the code clients trim a history on, as the chat route gives it.
        client_max = client.app.state.server.service.engine.max_model_len
        long = " ".join(_text(rng) for _ in range(client_max))
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": long}]})
        error = ws.receive_json()
        assert error["type"] == "error" and error["code"] == "context_length_exceeded", error
        assert ws.receive_json()["type"] == "done"
        ws.send_bytes(json.dumps({**latin, "sampling": {"max_tokens": 4}}).encode())
        assert _until_done(ws)[-1]["finish_reason"] in ("stop", "length", "tool_calls")
        _send(ws, rng)  # still works
        assert _until_done(ws)[-1]["finish_reason"] in ("stop", "length", "tool_calls")


def test_unknown_send_fields_are_refused_naming_them(client, rng_seed):
    """OpenAI's sampling fields at the top of a `send` (they go under "sampling") and unknown
    ones are refused like a misspelt sampling option, not ignored."""
    rng = random.Random(rng_seed)
    sampling = {"max_tokens": 3, "temperature": 0, "top_p": 0.5, "seed": 1, "ignore_eos": True}
    keys = rng.sample(sorted(sampling), rng.randint(1, 3))
    bogus = ["n", "logprobs", "".join(rng.choice(string.ascii_lowercase) for _ in range(7))]
    keys += rng.sample(bogus, rng.randint(0, 2))
    user = [{"role": "user", "content": _text(rng)}]
    with client.websocket_connect(URL.format("fields")) as ws:
        _join(ws)
        ws.send_json({"type": "send", "messages": user, **{k: sampling.get(k, 1) for k in keys}})
        error = ws.receive_json()
        assert error["type"] == "error" and error["param"] == min(keys), error
        assert all(repr(k) in error["message"] for k in keys) and '"sampling"' in error["message"]
        assert ws.receive_json() == {"type": "done", "turn": None, "finish_reason": "error"}
        _send(ws, rng)  # the socket goes on
        assert _until_done(ws)[-1]["finish_reason"] in ("stop", "length", "tool_calls")


def test_session_ids_are_checked(client):
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect(URL.format("a b")):
        pass
    assert closed.value.code == 1008


def test_an_openai_request_with_a_session_id_is_watched(client, rng_seed):
    rng = random.Random(rng_seed)
    sid = f"shared-{rng_seed}"
    with client.websocket_connect(URL.format(sid)) as watcher:
        _join(watcher)
        body = {"messages": [{"role": "user", "content": _text(rng)}], "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        r = client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
        events = _until_done(watcher)
    assert events[0]["type"] == "start"
    content = "".join(e["text"] for e in events if e["type"] == "content")
    assert content == (r.json()["choices"][0]["message"]["content"] or "")
    assert events[-3]["completion_tokens"] == r.json()["usage"]["completion_tokens"]


def test_logprob_events_come_one_a_token_when_asked(client, rng_seed):
    """`"logprobs": true` in a send's sampling: one `logprob` event per generated token (the
    chat API's entry and the token id), with the engine's values (the score path's
    log_softmax over the prompt and the reply); none when not asked."""
    rng = random.Random(rng_seed)
    sid = f"lp-{rng_seed}"
    k = rng.randint(0, 5)
    with client.websocket_connect(URL.format(sid)) as ws:
        _join(ws)
        n = rng.randint(2, 8)
        ws.send_json(
            {"type": "send", "messages": [{"role": "user", "content": _text(rng)}],
             "sampling": {"max_tokens": n, "temperature": 0, "ignore_eos": True,
                          "logprobs": True, "top_logprobs": k}}
        )  # fmt: skip
        events = _until_done(ws)
        entries = [e for e in events if e["type"] == "logprob"]
        usage = next(e for e in events if e["type"] == "usage")
        assert len(entries) == usage["completion_tokens"] == n, (len(entries), rng_seed)
        state = client.app.state.server
        session = state.hub.lookup(sid).session
        prompt = session.last_prompt.token_ids + session.last_suffix_ids
        out = session.last_output_ids
        assert [e["token_id"] for e in entries] == out, rng_seed
        engine = state.service.engine
        ref = torch.log_softmax(engine.score(prompt + out).double(), dim=-1)
        tokenizer = state.service.tokenizer
        for i, (e, token) in enumerate(zip(entries, out, strict=True)):
            row = ref[len(prompt) - 1 + i]
            assert abs(e["logprob"] - row[token].item()) <= 1e-4, (i, rng_seed)
            assert e["token"] == tokenizer.decode([token], skip_special_tokens=False)
            assert len(e["top_logprobs"]) == k, rng_seed
        _send(ws, rng)  # not asked: no logprob event
        assert not [e for e in _until_done(ws) if e["type"] == "logprob"]


def test_usage_counts_the_reasoning_tokens(client, rng_seed):
    """The usage event's reasoning_tokens, as the chat API's: the think block's tokens of the
    turn (tags included, up to and with `</think>`: a JSON answer follows the reasoning, its
    block opened by the prompt), with thinking off 0 unless the model opens a block with its
    first token (the budget's rule: a random model writes `<think>` now and then), which a
    send's chat_template_kwargs switches as on the chat route."""
    rng = random.Random(rng_seed)
    with client.websocket_connect(URL.format(f"r{rng.randrange(1 << 30)}")) as ws:
        _join(ws)
        for thinking in rng.sample([True, False], 2):
            sampling = {"max_tokens": 30, "temperature": 0.8, "seed": rng.randrange(1 << 30),
                        "logprobs": True, "thinking_token_budget": rng.randint(0, 6)}  # fmt: skip
            send = {"type": "send", "messages": [{"role": "user", "content": _text(rng)}],
                    "sampling": sampling,
                    "chat_template_kwargs": {"enable_thinking": thinking}}  # fmt: skip
            if thinking:  # a JSON answer after the reasoning: the prompt opens the block
                schema = {"type": "object", "properties": {"n": {"type": "integer"}},
                          "required": ["n"], "additionalProperties": False}  # fmt: skip
                asked = {"name": "n", "schema": schema}
                send["response_format"] = {"type": "json_schema", "json_schema": asked}
                sampling["max_tokens"] = 60
            ws.send_json(send)
            events = _until_done(ws)
            assert not [e for e in events if e["type"] == "error"], events
            tokens = [e["token"] for e in events if e["type"] == "logprob"]
            opened = thinking or tokens[:1] == ["<think>"]
            closed = "</think>" in tokens
            expected = (tokens.index("</think>") + 1 if closed else len(tokens)) if opened else 0
            usage = next(e for e in events if e["type"] == "usage")
            assert usage["reasoning_tokens"] == expected, (thinking, tokens, usage)


def test_stop_token_ids_and_the_stop_string_flag_reach_the_turn(client, rng_seed):
    """The chat route's stop_token_ids and include_stop_str_in_output work on the socket too
    (they were refused as unknown sampling options)."""
    rng = random.Random(rng_seed)
    messages = [{"role": "user", "content": _text(rng)}]
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def turn(sid: str, sampling: dict) -> list[dict]:
        with client.websocket_connect(URL.format(sid)) as ws:
            _join(ws)
            ws.send_json({"type": "send", "messages": messages, "sampling": sampling})
            events = _until_done(ws)
        assert not [e for e in events if e["type"] == "error"], events
        return events

    turn(f"free-{rng_seed}", greedy)
    out = client.app.state.server.hub.lookup(f"free-{rng_seed}").session.last_output_ids
    stop = out[rng.randrange(1, len(out))]
    events = turn(f"stop-{rng_seed}", {**greedy, "stop_token_ids": [stop]})
    usage = next(e for e in events if e["type"] == "usage")
    assert usage["completion_tokens"] == out.index(stop) + 1  # stopped at its first coming
    turn(f"flag-{rng_seed}", {**greedy, "include_stop_str_in_output": True})


def test_a_turn_cancelled_before_its_first_step_frees_its_session(client, rng_seed):
    """A socket that sends a turn and closes at once can cancel the turn's task before its
    first step (the close already queued), so the turn's own cleanup never runs. The session
    must still be freed: it refused every later turn, and the hub, which evicts idle
    sessions only, kept one more for each such socket. Driven directly: the test client's
    frames always let the task start first."""
    import asyncio

    from freetoken_agent.integrations.server import sessions_ws

    rng = random.Random(rng_seed)
    state = client.app.state.server
    sid = f"gone-{rng_seed}"
    live = state.hub.get(sid)
    watcher = live.watch()
    send = {"type": "send", "messages": [{"role": "user", "content": _text(rng)}],
            "sampling": {"max_tokens": rng.randint(2, 6)}}  # fmt: skip

    async def send_and_close() -> None:
        task = await sessions_ws._handle(json.dumps(send), live, watcher, state)
        assert task is not None and live.running is not None
        task.cancel()  # before its first step, as the socket's close does
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(send_and_close())
    live.unwatch(watcher)
    assert live.running is None
    with client.websocket_connect(URL.format(sid)) as ws:
        _join(ws)
        _send(ws, rng)
        events = _until_done(ws)
    assert events[0]["type"] == "start" and events[-1]["finish_reason"] in ("stop", "length")
