"""SessionHub: ids are checked, idle sessions leave least recently used first, busy ones stay."""

from __future__ import annotations

import random

import pytest

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
