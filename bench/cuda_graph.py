"""Capturing a benchmark step in a CUDA graph, the way the engine's decode runs.

The step runs once on a side stream first (Triton compiles and autotunes outside the capture),
then is captured; the returned callable replays it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def captured(step: Callable[[], object]) -> Callable[[], None]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
