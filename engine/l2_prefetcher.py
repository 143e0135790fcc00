"""A model's L2 prefetches on a side stream of its own (EngineConfig.l2_prefetch; why and what:
kernels/l2_prefetch.py).

`start` forks: the side stream waits for everything launched so far on the current stream (so
what the prefetch reads, the fill plan's rows for one, is complete), then runs the prefetch
kernel beside the kernels launched after it. `join` makes the current stream wait for it,
before the kernel whose weights it asked for. Under CUDA-graph capture the pair records a
branch of the graph. Each model keeps its own side stream: a stream two engines shared would
join one engine's capture to the other's eager work. On the CPU `start` runs the dispatcher
(which does nothing there), so tests see what would be asked for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PREFETCH_ROWS = 8  # steps of at most this many tokens prefetch (decode; a prefill chunk's
# matmuls are compute-bound, and its weights pass through L2 once anyway)
MOE_ROW_FRACTION = 0.5  # of each MoE row's w13 (gate, then up): ~25 MB a layer at 8 pairs of
# the 30B shape, half of L2, streamed during the fill copy


class L2Prefetcher:
    def __init__(self, device: torch.device) -> None:
        # Made here, not at the first fork: that may come inside a graph capture, where
        # creating a stream is not allowed.
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._open = False  # a fork not yet joined

    def start(self, prefetch: Callable[..., None], tensor: torch.Tensor, *args) -> None:
        """Fork and run `prefetch(tensor, *args)` on the side stream (inline on the CPU)."""
        if not tensor.is_cuda:
            prefetch(tensor, *args)
            return
        assert self._side is not None, "an L2Prefetcher made for the CPU got CUDA tensors"
        self._side.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._side):
            prefetch(tensor, *args)
        self._open = True

    def join(self, device: torch.device) -> None:
        """The current stream waits for the side stream's prefetches (none open: nothing)."""
        if self._open:
            torch.cuda.current_stream(device).wait_stream(self._side)
            self._open = False


def use_l2_prefetch(
    model: torch.nn.Module, bank: object, device: torch.device, on: bool = True
) -> None:
    """EngineConfig.l2_prefetch: every attention layer prefetches its o_proj weight, and an
    offloaded bank's device path its MoE rows, through one prefetcher of the model on `device`
    (`on` False: none; captured graphs keep what they were captured with). The device is
    given, not read off the model's first parameter: an offloaded model's embedding table
    may live in host memory."""
    from freetoken_agent.engine.layers.attention import SelfAttention

    prefetcher = L2Prefetcher(device) if on else None
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.l2 = prefetcher
    if hasattr(bank, "l2"):
        bank.l2 = prefetcher
