"""The lent workspace switched inside one engine (bench offload --lend-ab): the same engine,
host and minute measure a policy with the workspace a decode step cannot need held as slots
(EngineConfig.lend_workspace, engine/memory_workspace.py) and kept whole. Two processes, one
each way, differed by the host's drift more than by the lending (the sixty-first session's
runs: the limit moved 174-208 tok/s between processes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from freetoken_agent.bench.ab_rows import ab_rows
from freetoken_agent.engine.memory_workspace import StepWorkspace


@contextmanager
def workspace_lending(engine, on: bool | None) -> Iterator[None]:
    """Inside: the engine's memory manager lends the workspace (`on`) or keeps it whole; None,
    or an engine without elastic memory: as loaded. The split follows at the next safe point
    (a forced move when the workspace comes back; a growth when it is lent). As loaded after."""
    memory = engine.memory
    if on is None or memory is None:
        yield
        return
    loaded = memory.workspace
    memory.workspace = (loaded or StepWorkspace(engine.spec, engine.config)) if on else None
    if not on:
        memory.lent, engine.scheduler.step_tokens = 0, None
    try:
        yield
    finally:
        memory.workspace = loaded
        if loaded is None:
            memory.lent, engine.scheduler.step_tokens = 0, None


def lend_rows(rows: list[tuple], ab: bool) -> list[tuple]:
    """The decode rows with their lending: as loaded (None) each; with `ab`, each twice in a
    row, NAME+lent then NAME+whole (a round's rotation keeps the pair together)."""
    return ab_rows(rows, ab, ("lent", "whole"))
