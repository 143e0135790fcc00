"""Decode graphs of policy `adaptive`: its step paths captured, one replayed a step.

`adaptive` chooses per decode step between the segmented graphs (the `stops` path: the host
places each layer's misses; engine/segmented_graphs.py) and one graph a step whose layers fill
their own misses (the `device` and `shared` paths: policy gpu-fill's kernels, the second with
the CPU worker's share; engine/direct_graphs.py), by measured step time
(engine/experts/step_paths.py). The whole-step paths are sets of their own: the `shared` one holds
every layer's post to the CPU worker and the MoE sum's wait for its answer and add of it, which
cost the `device` path 2.5% of its tok/s when one set held both (peer slice, native routing b=1,
adaptive held on `device` 914.9 against gpu-fill's 937.4; twenty-sixth session); the `split` one
also cuts its fills (its plans, copies and MoE kernels read the cut). The sets share the bank's
GraphIO buffers. A step on the stops path first gives the cache back to the host (a no-op when
it has it); the device path's `before_whole_step` hands it to the device. Other attributes (the
segmented graphs' counters: `reruns`, `missed_layers`, `wait_s`, ...) are the segmented set's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken_agent.engine.direct_graphs import DirectDecodeGraphs
from freetoken_agent.engine.experts.step_paths import DEVICE_PATHS
from freetoken_agent.engine.runner import StepInputs
from freetoken_agent.engine.segmented_graphs import SegmentedDecodeGraphs

# B real sequences, H hidden


class PathDecodeGraphs:
    def __init__(self, stops: SegmentedDecodeGraphs, device: DirectDecodeGraphs,
                 shared: DirectDecodeGraphs | None,
                 split: DirectDecodeGraphs | None = None) -> None:  # fmt: skip
        """`shared`, `split`: None where no CPU worker runs (adaptive then never holds
        them)."""
        self.stops, self.device, self.shared, self.split = stops, device, shared, split
        self.bank = stops.bank
        self.device_steps = 0  # steps replayed on a whole-step path (device, shared or split)

    def __getattr__(self, name: str):
        return getattr(self.stops, name)  # only for names this class does not define

    def fits(self, inputs: StepInputs) -> bool:
        return self.stops.fits(inputs)  # the device set holds the smaller batches only

    def replay(self, inputs: StepInputs, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one decode step on the path adaptive holds for its batch size; returns hidden
        states [B, H] (valid until the next replay)."""
        b = inputs.cu_q_lens.shape[0] - 1
        # (a benchmark may switch the bank's policy without a new capture: others stop)
        path = self.bank.adaptive.path(b) if self.bank.policy == "adaptive" else "stops"
        # `shared` or `split` without its set (graphs captured before the CPU worker started;
        # a test holding the path with no worker): the device set, exact, its share unused.
        whole = {"shared": self.shared, "split": self.split}.get(path)
        whole = self.device if whole is None else whole
        if path in DEVICE_PATHS and whole.fits(inputs):
            self.device_steps += 1
            return whole.replay(inputs, between)
        self.bank.cache.on_device.release()
        return self.stops.replay(inputs, between)
