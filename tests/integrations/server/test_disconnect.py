"""A client that goes away ends its generation: the request is aborted and its pages come back.

Every request here would run for hundreds of tokens (ignore_eos) if nobody stopped it, so a
test passes only if the disconnect really aborted it.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import threading
import time

import pytest
from asgi_disconnect import post_and_leave, raw_post
from scripted_engine import PacedEngine

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.integrations.server import create_app
from freetoken_agent.service import EngineService

MAX_TOKENS = 900


def _body(rng: random.Random, stream: bool) -> dict:
    text = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(rng.randint(10, 60)))
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": rng.randrange(2**31),
        "stream": stream,
    }


def assert_nothing_held(service, engine) -> None:
    """No request runs, the engine's managers are consistent, and once the radix tree lets go
    of what it caches every KV page is free: nothing is held by a request."""
    with service.lock:
        assert not engine.has_unfinished()
        engine.check_integrity()
        engine.radix.reset()
        assert engine.kv.allocator.n_free == engine.kv.allocator.capacity


def test_a_streaming_client_that_leaves_aborts_its_request(client, engine, rng_seed):
    rng = random.Random(rng_seed)
    service = client.app.state.server.service
    assert_nothing_held(service, engine)
    seen = 0
    with client.stream("POST", "/v1/chat/completions", json=_body(rng, True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen == 4:
                break  # leaving the block closes the connection mid-stream
    stats = service.stats()
    assert stats["requests"]["finished"] == 1  # ended (aborted), not running on
    assert 0 < stats["tokens"]["generated"] < MAX_TOKENS
    assert_nothing_held(service, engine)


def test_a_waiting_non_streaming_client_that_leaves_aborts_its_request(engine, rng_seed):
    """Driven as raw ASGI: the server sees the disconnect while it collects the reply."""
    rng = random.Random(rng_seed)
    app = create_app(engine)
    service = app.state.server.service
    body = json.dumps(_body(rng, False)).encode()
    try:
        sent = post_and_leave(app, "/v1/chat/completions", body)
        stats = service.stats()
        assert stats["requests"]["finished"] == 1
        assert 0 < stats["tokens"]["generated"] < MAX_TOKENS
        assert sent[0]["status"] == 499  # nobody reads it; the point is the abort
        assert_nothing_held(service, engine)
    finally:
        service.close()


def test_clients_that_leave_while_queued_behind_their_session_run_nothing(engine, rng_seed):
    """A long turn runs on session S; more clients post to S (streamed or not) and leave at
    once, while their turns wait for S's turn lock. Their handlers return at once, and none of
    their turns reaches the engine: once the long turn ends only it was ever submitted, and the
    waiting turn threads have ended."""
    rng = random.Random(rng_seed)
    fake = PacedEngine(engine)
    fake.slow_after, fake.delay = 0, 0.01
    fake.replies = [(" ".join(["word"] * 150), "stop")]  # the long turn's: ~1.5 s
    service = EngineService(fake)
    app = create_app(service)
    leaving = rng.randint(2, 6)

    quitter_texts: list[str] = []

    session = f"S{rng.randrange(10**9)}"  # its turn threads are named after it

    def threads() -> int:  # (other tests' turn threads may still be ending)
        return sum(t.name == f"freetoken-turn-{session}" for t in threading.enumerate())

    async def main() -> None:
        body = _body(rng, stream=False)
        long = asyncio.create_task(raw_post(app, "/v1/chat/completions", body, session=session))
        while not fake.running:
            await asyncio.sleep(0.01)
        bodies = [_body(rng, rng.random() < 0.5) for _ in range(leaving)]
        quitter_texts.extend(b["messages"][0]["content"] for b in bodies)
        url = "/v1/chat/completions"
        quitters = [raw_post(app, url, body, session=session, leave=True) for body in bodies]
        answers = await asyncio.wait_for(asyncio.gather(*quitters), timeout=1.0)
        assert fake.running, "the long turn ended before the clients left: the test is void"
        assert all(a[0]["status"] == 499 for a in answers), answers
        await asyncio.wait_for(long, timeout=60)

    renders: list[str] = []  # the texts of the messages rendered
    render = ChatFormat.render

    def counting(self, messages, *args, **kwargs):
        renders.extend(str(m["content"] if isinstance(m, dict) else m.content) for m in messages)
        return render(self, messages, *args, **kwargs)

    assert threads() == 0
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ChatFormat, "render", counting)
            asyncio.run(main())
            deadline = time.monotonic() + 10  # the quitters' threads take the lock in turn
            while threads() and time.monotonic() < deadline:
                time.sleep(0.02)
        assert threads() == 0, "turn threads left waiting"
        assert fake.submitted == 1, (fake.submitted, rng_seed)  # the long turn alone
        # Nor rendered once the lock freed (on a long agent history a render is not free).
        assert not set(renders) & set(quitter_texts), rng_seed
    finally:
        service.close()
