"""A measurement under other decode kernels than the engine was loaded with: FREETOKEN_PDL's
value (kernels/triton/pdl.py) and EngineConfig.l2_prefetch (engine/l2_prefetcher.py), the
decode graphs captured again under them (`bench offload --pdl ... --l2 ...`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from freetoken_agent.engine.l2_prefetcher import use_l2_prefetch
from freetoken_agent.kernels.triton import pdl


@contextmanager
def kernel_variant(engine, word: str | None, l2: bool | None) -> Iterator[None]:
    """Inside: FREETOKEN_PDL as `word` and l2_prefetch as `l2` (None: the environment's, and
    as loaded), the graphs captured again when either is given (a graph keeps the launches it
    was captured with). l2_prefetch stays as set here after the block."""
    if word is None and l2 is None:
        yield
        return
    with pdl.override(word if word is not None else os.environ.get("FREETOKEN_PDL", "off")):
        if l2 is not None:
            use_l2_prefetch(engine.loaded.model, engine.loaded.bank, l2)
        if engine.runner.graphs is not None:
            engine.capture_graphs()
        yield
