"""A measurement under other decode kernels than the engine was loaded with: FREETOKEN_PDL's
value (kernels/pdl_switch.py) and EngineConfig.l2_prefetch (engine/l2_prefetcher.py), the
decode graphs captured again under them (`bench offload --pdl ... --l2 ...`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from freetoken_agent.engine.l2_prefetcher import use_l2_prefetch
from freetoken_agent.kernels import pdl_switch


@contextmanager
def kernel_variant(engine, word: str | None, l2: bool | None) -> Iterator[None]:
    """Inside: FREETOKEN_PDL as `word` and l2_prefetch as `l2` (None: the environment's, and
    as loaded), the graphs captured again when either is given (a graph keeps the launches it
    was captured with). l2_prefetch stays as set here after the block."""
    if word is None and l2 is None:
        yield
        return
    with pdl_switch.override(word):
        if l2 is not None:
            use_l2_prefetch(engine.loaded.model, engine.loaded.bank, engine.loaded.device, l2)
        if engine.runner.graphs is not None:
            engine.capture_graphs()
        yield


def measured_variants(
    policies: list[str], words: list[str] | None, l2: list[str] | None
) -> list[tuple[str, str, str | None, bool | None]]:
    """(row name, policy, FREETOKEN_PDL word or None, l2_prefetch or None) for every policy
    under every word and l2 setting given; a row is named by its policy, then `@word` when
    several words were given and `+l2` for l2 on when both settings were."""
    word_list = words or [None]
    l2_list = [x == "on" for x in l2] if l2 else [None]
    return [
        (p + (f"@{w}" if len(word_list) > 1 else "") + ("+l2" if on and len(l2_list) > 1 else ""),
         p, w, on)
        for p in policies
        for w in word_list
        for on in l2_list
    ]  # fmt: skip
