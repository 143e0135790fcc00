"""Capturing the decode graphs at load (and again after the expert bank object changes), with
a way out: a capture the driver invalidates is tried once more, and if that fails too, decode
runs without graphs.

On the device a capture failed on a machine just started and passed on the next run: the
first launch of a kernel may do work a capture forbids, and it is done by then. Decoding
without graphs is slower but correct, so the engine says why (`Engine.graph_error`, in its
stats) rather than failing to load. It lives apart from engine.py because it is the load's
fallback policy around `ModelRunner.enable_cuda_graphs`, not part of the loop.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from freetoken_agent.engine.cuda_graphs import collection_paused

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.offload import OffloadedExpertBank
    from freetoken_agent.engine.kv.recurrent_state import RecurrentStatePool
    from freetoken_agent.engine.runner import ModelRunner

log = logging.getLogger("freetoken.engine")
CAPTURE_ATTEMPTS = 2  # decode-graph captures tried before decoding without graphs


def capture_decode_graphs(
    runner: ModelRunner,
    max_batch: int,
    max_pages: int,
    offloaded: OffloadedExpertBank | None,
    states: RecurrentStatePool | None,
) -> str | None:
    """Capture `runner`'s decode graphs, up to CAPTURE_ATTEMPTS times. Returns None when a
    capture passed, else why decode runs without graphs (the last failure's first line; the
    runner is left without graphs, none half-built)."""
    error = None
    for attempt in range(1, CAPTURE_ATTEMPTS + 1):
        try:
            with collection_paused():
                runner.enable_cuda_graphs(max_batch, max_pages, offloaded, states)
            return None
        except RuntimeError as e:  # torch.AcceleratorError is one
            runner.graphs = None
            error = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("decode-graph capture failed (attempt %d of %d): %s", attempt,
                        CAPTURE_ATTEMPTS, error)  # fmt: skip
    log.warning("decoding without CUDA graphs (slower): %s", error)
    return error
