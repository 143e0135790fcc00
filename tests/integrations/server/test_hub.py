"""SessionHub: ids are checked, idle sessions leave least recently used first, busy ones stay;
the ChatFormat all sessions share renders correctly from many threads at once."""

from __future__ import annotations

import random
import string
import sys
import threading
import time
from collections import OrderedDict

import pytest

from freetoken_agent import anchor_locator as anchor_locator_module
from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.server.hub import SessionHub


@pytest.fixture
def hub(client) -> SessionHub:
    state = client.app.state.server
    return SessionHub(state.service, state.hub.chat_format, max_sessions=3)


def test_least_recently_used_idle_sessions_leave_first(hub, rng_seed):
    rng = random.Random(rng_seed)
    ids = [f"s{i}-{rng.randrange(1000)}" for i in range(3)]
    first = [hub.get(i) for i in ids]
    assert [hub.get(i) for i in ids] == first  # kept: the same Session each time
    hub.get(ids[0])  # now the most recent
    watched = hub.get(ids[1])
    watched.watch()  # a watched session is never evicted
    hub.get("newcomer")
    assert len(hub) == 3
    assert hub.get(ids[0]) is first[0] and hub.get(ids[1]) is first[1]
    assert hub.get(ids[2]) is not first[2]  # it was the idle least recently used one


def test_session_ids_are_checked(hub):
    for bad in ("", "a b", "x" * 129, "../etc", None):
        with pytest.raises(InvalidRequestError, match="session id"):
            hub.get(bad)
    assert hub.lookup(None).id is None and len(hub) == 0  # anonymous sessions are not kept


def _history(rng: random.Random, base: list[dict]) -> list[dict]:
    """`base` (shared between threads, so their renders meet in the cache) plus a random tail
    of user turns, replies with reasoning, tool calls and results."""

    def words(n: int) -> str:
        return " ".join(
            "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 6)))
            for _ in range(n)
        )

    messages = list(base)
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": words(rng.randint(1, 6))})
        reply: dict = {"role": "assistant", "content": words(rng.randint(0, 5))}
        if rng.random() < 0.5:
            reply["reasoning_content"] = words(rng.randint(1, 5))
        if rng.random() < 0.4:
            call_id = f"call_{rng.randrange(10**6)}"
            reply["tool_calls"] = [
                {"id": call_id, "type": "function",
                 "function": {"name": "look", "arguments": f'{{"q": "{words(1)}"}}'}}
            ]  # fmt: skip
            messages += [reply, {"role": "tool", "tool_call_id": call_id, "content": words(3)}]
        else:
            messages.append(reply)
    messages.append({"role": "user", "content": words(2)})
    return messages


class YieldingDict(OrderedDict):
    """An OrderedDict (as ChatFormat's cache is) that hands the GIL to other threads around
    each access."""

    def get(self, key, default=None):
        time.sleep(0)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        found = super().__contains__(key)
        time.sleep(0)
        return found

    def __getitem__(self, key):
        time.sleep(0)
        return super().__getitem__(key)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        time.sleep(0)

    def move_to_end(self, key, last=True) -> None:
        time.sleep(0)
        super().move_to_end(key, last)
        time.sleep(0)

    def popitem(self, last=True):
        time.sleep(0)
        item = super().popitem(last)
        time.sleep(0)
        return item


def test_the_shared_chat_format_renders_right_from_many_threads(client, monkeypatch, rng_seed):
    """The server's one ChatFormat, used by four threads at once with a render cache so small
    that it evicts every few steps, gives exactly what a fresh one gives alone."""
    shared = client.app.state.server.hub.chat_format
    assert isinstance(shared, ChatFormat)  # no lock around it: this test is why that is fine
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    rng = random.Random(rng_seed)
    base = _history(rng, [{"role": "system", "content": "be brief"}])[:-1]
    work = [
        [_history(random.Random(rng_seed + t * 100 + i), base) for i in range(6)] for t in range(4)
    ]
    expected = [
        [ChatFormat(shared.tokenizer).render(h, tools=tools if i % 2 else None)
         for i, h in enumerate(histories)]
        for histories in work
    ]  # fmt: skip
    monkeypatch.setattr(anchor_locator_module, "_CACHE_ENTRIES", 3)  # evicting all the time
    # Under the GIL a dict access is one step, so a check-then-read race almost never shows;
    # this cache lets other threads run inside every access, as a free-threaded build would.
    monkeypatch.setattr(shared, "_cache", YieldingDict())
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads interleave every few bytecodes
    got: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(work))

    def render(t: int) -> None:
        try:
            start.wait()
            got[t] = [
                shared.render(h, tools=tools if i % 2 else None) for i, h in enumerate(work[t])
            ] + [shared.render(h, tools=tools if i % 2 else None) for i, h in enumerate(work[t])]
        except BaseException as e:  # noqa: BLE001 - reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=render, args=(t,)) for t in range(len(work))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors
    for t, prompts in got.items():
        for prompt, want in zip(prompts, expected[t] * 2, strict=True):
            assert prompt.token_ids == want.token_ids and prompt.text == want.text
            assert prompt.anchors == want.anchors
