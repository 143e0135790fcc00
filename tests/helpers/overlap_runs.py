"""Overlap scheduling's tests (CPU and CUDA): drive an engine through a plan of submissions
call by call, and hold the plain and the overlapped loop to the same events."""

from __future__ import annotations

from collections.abc import Callable

from freetoken_agent import Engine

# request id -> its events as (index, token, text, finished, finish reason)
Events = dict[str, list[tuple]]
Plan = dict[int, list[tuple]]  # call -> [(prompt, sampling, submit options)]


def drive(engine: Engine, plan: Plan, max_calls: int = 400) -> Events:
    """Call `step` until every request is done; at call k submit plan[k]'s requests first.
    Checks the engine's integrity after every call (a step in flight included), and that each
    request's events are indexed in order and end exactly once."""
    seen: Events = {}
    last = max(plan)
    for call in range(max_calls):
        for prompt, sp, options in plan.get(call, []):
            seen[engine.submit(prompt, sp, **options)] = []
        for ev in engine.step():
            seen[ev.request_id].append(
                (ev.index, ev.token_id, ev.text, ev.finished, ev.finish_reason)
            )
        engine.check_integrity()
        if call >= last and not engine.has_unfinished():
            break
    else:
        raise AssertionError("the requests did not finish")
    for rid, events in seen.items():
        assert [e[0] for e in events] == list(range(len(events))), rid
        assert [e[3] for e in events] == [False] * (len(events) - 1) + [True], rid
    return seen


def both_loops(load: Callable[[bool], Engine], plan: Plan) -> tuple[Events, Engine]:
    """Drive `load(False)` and `load(True)` (overlap off, on) through `plan`; their events
    must agree. Returns them and the overlapped engine."""
    plain = drive(load(False), plan)
    engine = load(True)
    lagged = drive(engine, plan)
    assert lagged == plain
    return lagged, engine
