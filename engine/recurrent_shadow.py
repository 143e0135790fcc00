"""Step-start copies of a hybrid batch's recurrent state, so segmented decode may run ahead.

Segmented decode (segmented_graphs.py) queues segments past the layer whose misses it has not
placed yet, betting that layer hits; when it missed, the segments after it run again. That is
exact for attention, whose segments write the same KV afresh, but a recurrent layer updates its
state in place: run twice, it would apply the step's token twice. So hybrid models did not run
ahead, and each of their MoE layers was a full host round trip with the device idle.

With a shadow, the step first copies its rows of every recurrent layer's state (two indexed
copies: the pool keeps one [L, N, ...] tensor per kind), and a re-run first puts back the rows
of the recurrent layers in the segments it replays. Segment s holds the mixer of every decoder
layer with s MoE layers before it (its router ends the segment); a recurrent layer's ordinal
follows decoder order, so the layers of segments [a, b) are a contiguous range of ordinals.

Cost: the copies of one step's rows of every recurrent layer (about 60 MB a sequence at the
Qwen3.6-35B-A3B shape: 30 layers of a 2 MB fp32 delta state) each step, in HBM, plus the same
again for each re-run's layers; the copies live in torch's allocator beside the workspace.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from freetoken_agent.engine.config import ModelSpec

# L recurrent layers, N state slots, Bp padded batch of a graph


class RecurrentShadow:
    def __init__(self, spec: ModelSpec, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """`conv` [L, N, C, K - 1] and `ssm` [L, N, Hv, Dk, Dv]: the state pool's tensors."""
        assert conv.shape[0] == ssm.shape[0] == len(spec.recurrent_layers)
        self.conv, self.ssm = conv, ssm
        # The segment of each recurrent layer (by ordinal): the MoE layers before it.
        self.segment_of = [bisect_left(spec.moe_layers, d) for d in spec.recurrent_layers]
        self._saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def save(self, slots: torch.Tensor) -> None:
        """At the step's start: the rows of `slots` [Bp] (int64, padding rows the scratch
        slot) of every recurrent layer."""
        self._saved = (self.conv.index_select(1, slots), self.ssm.index_select(1, slots), slots)

    def layers_of(self, first_segment: int, end_segment: int) -> range:
        """Ordinals of the recurrent layers in segments [first_segment, end_segment)."""
        lo = bisect_left(self.segment_of, first_segment)
        return range(lo, bisect_left(self.segment_of, end_segment, lo))

    def restore(self, first_segment: int, end_segment: int) -> None:
        """Before segments [first_segment, end_segment) run again: their recurrent layers'
        rows back to the step's start (queued on the current stream, after what ran ahead)."""
        layers = self.layers_of(first_segment, end_segment)
        if not layers:
            return
        assert self._saved is not None, "restore before save"
        conv, ssm, slots = self._saved
        lo, hi = layers.start, layers.stop
        self.conv[lo:hi].index_copy_(1, slots, conv[lo:hi])
        self.ssm[lo:hi].index_copy_(1, slots, ssm[lo:hi])
