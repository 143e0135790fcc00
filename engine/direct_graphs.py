"""Decode graphs of the offload policies that need no host decision within a step: one graph
a step (`WHOLE_STEP_POLICIES`).

- `direct` (engine/experts/direct.py): the captured path reads each layer's missing experts
  from the pinned pool on the device and records the routing into the GraphIO buffers; the
  runner hands it to `bank.after_step` once the step is sampled, and the cache learns and
  fills from it before the next step.
- `gpu-fill` (engine/experts/device_fills.py): each layer plans and copies its own fills on
  the device; before each replay the bank owns the cache and learns the real pair count.

Unlike the segmented graphs (engine/segmented_graphs.py) a step never stops for the host: it
replays whole, as a resident model's does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken_agent.engine.cuda_graphs import OffloadedDecodeGraphs
from freetoken_agent.engine.runner import StepInputs

# B real sequences, Bp padded batch size, H hidden


class DirectDecodeGraphs(OffloadedDecodeGraphs):
    def __init__(self, model, bank, page_size: int, max_batch: int, max_pages: int,
                 device: torch.device, cpu_share: bool = False,
                 split: bool = False) -> None:  # fmt: skip
        """`cpu_share`: the layers post the CPU worker its share of their misses and add its
        answer (adaptive's `shared` path; path_graphs.py); else none of that is captured.
        `split` (with `cpu_share`): the layers cut their fills (adaptive's `split` path)."""
        self.cpu_share, self.split = cpu_share, split
        super().__init__(model, bank, page_size, max_batch, max_pages, device)

    def _capture(self) -> None:
        try:
            self.io.active = True  # the bank records the routing and reads misses from the pool
            self.bank.whole_step_capture = True  # gpu-fill's layers (adaptive's device path)
            self.bank.device_path.capture_share = self.cpu_share
            self.bank.device_path.capture_split = self.split
            self.bank.before_whole_step(None)  # gpu-fill: owned, and the warm-up fills nothing
            super()._capture()
        finally:
            self.io.active = False
            self.bank.whole_step_capture = False
            self.bank.device_path.capture_share = False
            self.bank.device_path.capture_split = False

    def replay(self, inputs: StepInputs, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one decode step; returns hidden states [B, H] (valid until the next replay).
        `between`: called once the graph is launched."""
        b, bs = self._load(inputs)
        self._before_replay(b, bs)
        self.bank.before_whole_step(b)
        self.graphs[bs].replay()
        if between is not None:
            between()
        return self.outputs[bs][:b]
