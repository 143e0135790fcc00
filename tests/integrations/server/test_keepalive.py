"""Keep-alive comments on silent SSE streams (keepalive.py): a stream with nothing to send for
KEEPALIVE_S seconds sends `: keep-alive`, which SSE readers skip.

The wrapper alone: items pass in order, a long gap gets a comment and a short interval's
absence gets none; an error passes through; closing it early stops the item being made. Then
the routes: a slow engine's OpenAI, Anthropic and Responses streams carry comments between
their events, and their events are those of a stream without them. Gaps and texts are drawn
fresh each run."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from anthropic_stream import named_events
from starlette.responses import StreamingResponse

from freetoken_agent.integrations.server import keepalive
from freetoken_agent.integrations.server.keepalive import KEEPALIVE, with_keepalive

TICK = 0.02  # KEEPALIVE_S in these tests
LONG = 0.3  # a gap that must get a comment (15 ticks)


async def _items(gaps: list[float], log: list[str]):
    try:
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            yield f"item {i}"
    finally:
        log.append("closed")


def _run(agen) -> list[str]:
    async def collect():
        return [item async for item in agen]

    return asyncio.run(collect())


def test_items_in_order_with_a_comment_in_each_long_gap(monkeypatch, rng_seed):
    rng = random.Random(rng_seed)
    monkeypatch.setattr(keepalive, "KEEPALIVE_S", TICK)
    gaps = [rng.choice([0.0, LONG]) for _ in range(rng.randint(3, 6))]
    log: list[str] = []
    out = _run(with_keepalive(_items(gaps, log)))
    assert [x for x in out if x != KEEPALIVE] == [f"item {i}" for i in range(len(gaps))]
    # Before each item: the comments sent while it was being made.
    before, comments = [], 0
    for x in out:
        if x == KEEPALIVE:
            comments += 1
        else:
            before.append(comments)
            comments = 0
    assert all(n >= 1 for n, gap in zip(before, gaps, strict=True) if gap == LONG), (gaps, before)
    assert log == ["closed"]


def test_no_comment_while_items_keep_coming(monkeypatch, rng_seed):
    rng = random.Random(rng_seed)
    monkeypatch.setattr(keepalive, "KEEPALIVE_S", 30.0)
    gaps = [rng.uniform(0, 0.01) for _ in range(rng.randint(2, 8))]
    out = _run(with_keepalive(_items(gaps, [])))
    assert out == [f"item {i}" for i in range(len(gaps))]


def test_an_error_passes_through(monkeypatch, rng_seed):
    monkeypatch.setattr(keepalive, "KEEPALIVE_S", TICK)
    message = f"broken {random.Random(rng_seed).randint(0, 10**6)}"

    async def failing():
        yield "first"
        await asyncio.sleep(LONG / 3)
        raise ValueError(message)

    with pytest.raises(ValueError, match=message):
        _run(with_keepalive(failing()))


def test_closing_early_stops_the_item_being_made(monkeypatch):
    monkeypatch.setattr(keepalive, "KEEPALIVE_S", TICK)
    log: list[str] = []

    async def consume():
        stream = with_keepalive(_items([0.0, 3600.0], log))
        assert await stream.__anext__() == "item 0"
        assert await stream.__anext__() == KEEPALIVE  # item 1 is an hour away
        await stream.aclose()

    asyncio.run(asyncio.wait_for(consume(), 10))
    assert log == ["closed"]


@pytest.fixture
def slow(paced_client):
    """A client whose engine writes each token after a pause of several ticks."""
    paced_client[0].slow_after, paced_client[0].delay = 0, 6 * TICK
    return paced_client


def _raw(client, url: str, body: dict) -> str:
    with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        return r.read().decode()


@pytest.mark.parametrize("route", ["chat", "anthropic", "responses"])
def test_a_slow_stream_carries_comments_and_the_same_events(slow, monkeypatch, rng_seed, route):
    rng = random.Random(rng_seed)
    fake, client = slow
    reply = " ".join(rng.choice(["alpha", "beta", "ka", "lo", "mi"]) for _ in range(3))
    user = {"role": "user", "content": f"say {rng.randint(0, 999)}"}
    url, body = {
        "chat": ("/v1/chat/completions", {"messages": [user], "stream": True}),
        "anthropic": ("/v1/messages", {"messages": [user], "max_tokens": 64, "stream": True}),
        "responses": ("/v1/responses", {"input": user["content"], "stream": True}),
    }[route]
    body["model"] = client.app.state.server.model_id
    fake.replies = [(reply, "stop")] * 2
    plain = _raw(client, url, body)  # KEEPALIVE_S as shipped: far longer than this stream
    monkeypatch.setattr(keepalive, "KEEPALIVE_S", TICK)
    ticking = _raw(client, url, body)
    assert KEEPALIVE not in plain and ticking.count(KEEPALIVE) >= 2, ticking
    kept = ticking.replace(KEEPALIVE, "")
    if route == "chat":
        assert _chat_texts(kept) == _chat_texts(plain) and "".join(_chat_texts(kept)) == reply
    else:
        assert [n for n, _ in named_events(kept)] == [n for n, _ in named_events(plain)]


def _chat_texts(body: str) -> list[str]:
    texts = []
    for chunk in body.split("\n\n"):
        data = chunk.removeprefix("data: ")
        if chunk and data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                texts.append(choice["delta"].get("content") or "")
    return [t for t in texts if t]


def test_a_client_leaving_a_starlette_stream_lets_the_cleanup_finish(monkeypatch):
    """Starlette (ASGI spec 2.3, as uvicorn speaks it) ends a stream whose client left by
    cancelling its task group, whose cancel scope is delivered again at every await: the
    wrapper's cleanup (wait for the item being made, whose own cleanup awaits, then close the
    body) must still run to its end rather than stop at its first await."""
    monkeypatch.setattr(keepalive, "KEEPALIVE_S", TICK)
    log: list[str] = []

    async def body():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(TICK / 2)  # a cleanup that awaits (an abort handed to a thread)
            log.append("body cleaned up")
            raise

    async def watched():
        try:
            async for item in with_keepalive(body()):
                yield item
        finally:
            log.append("wrapper ended")

    async def main() -> None:
        response = StreamingResponse(watched(), media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "method": "GET", "path": "/", "headers": [], "query_string": b""}  # fmt: skip

        async def receive() -> dict:
            await asyncio.sleep(10 * TICK)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            pass

        await response(scope, receive, send)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert log == ["body cleaned up", "wrapper ended"], log
