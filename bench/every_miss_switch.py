"""The CPU's share allowed every miss of a layer, or held to all but one, inside one engine
(bench offload --every-miss-ab): where fills do not pay, adaptive's shared path lets the CPU
take a layer's every miss (engine/experts/device_path.py `_set_share`), where before each
layer that missed kept one fill. Two processes differ by the host's drift more than by such a
change (bench/lend_switch.py), so each row is measured both ways in the same engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from freetoken_agent.bench.ab_rows import ab_rows


@contextmanager
def every_miss(engine, on: bool | None) -> Iterator[None]:
    """Inside: adaptive's shared path may give the CPU every miss of a layer where fills do
    not pay (`on`), or keeps a fill in each layer that misses; None: as loaded. As loaded
    after. The bank's policy object is read again at the end: a measurement replaces it
    (`reset_decisions`, which keeps the setting)."""
    bank = engine.loaded.bank
    loaded = bank.adaptive.cpu_all_misses
    if on is not None:
        bank.adaptive.cpu_all_misses = on
    try:
        yield
    finally:
        bank.adaptive.cpu_all_misses = loaded


def every_miss_rows(rows: list[tuple], ab: bool) -> list[tuple]:
    """The decode rows with the switch: as loaded (None) each; with `ab`, each adaptive row
    twice in a row, NAME+every then NAME+kept (a round's rotation keeps the pair together)."""
    return ab_rows(rows, ab, ("every", "kept"), applies=lambda row: row[1] == "adaptive")
