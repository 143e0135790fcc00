"""One MoE layer computed in parts: launches over disjoint sets of its experts, each from a bank
of its own, summed in fp32 and rounded once by the last.

The prefill streamer's (engine/experts/streaming.py): the experts resident in cache slots form
one part, the absent ones stream through a staging ring in groups, a part each. `MoeParts`
sorts the pairs by expert once for all the parts (on the Triton path: kernels/triton/
moe_parts.py); `add` runs one part, whose `rows` map each expert to its row in the part's bank.
The plain-torch twin runs `fused_moe`'s reference on ids rows[topk_ids], the same sum.

Shapes: hidden [T, H], topk_ids [T, K] expert ids in [0, E), topk_weights [T, K] fp32,
rows [E] int32 (-1: an expert of another part), out [T, H] in hidden's dtype.
"""

from __future__ import annotations

import torch

from freetoken_agent.kernels.dispatch import use_triton
from freetoken_agent.kernels.reference import fused_moe as fused_moe_reference


class MoeParts:
    def __init__(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_experts: int,
        width: int,
        max_pairs: int,
    ) -> None:
        """`width`: the experts' I (the tiles are chosen per H and I); `max_pairs`: (token,
        expert) pairs a launch takes at most (its buffers' size, as `fused_moe`'s), the token
        chunks every part runs in."""
        self.hidden, self.topk_weights = hidden, topk_weights
        self.topk_ids = topk_ids.long()  # [T, K]: every part indexes its rows by it, once cast
        self.out = torch.empty_like(hidden)
        # The parts' sum so far, fp32 (float64 for float64), in two buffers taken in turn: a
        # part reads the sum from one and writes the new sum into the other. One buffer as both
        # `add` and `out` read right on the CPU, and wrong on CUDA (the summing kernel zeroes
        # `add` before it stores `out`: the H100 run of session 59 lost parts of the sum).
        self._sums: list[torch.Tensor] = []
        self._parts = 0  # parts run so far
        self._plan = None
        if use_triton(hidden, False, "fused_moe"):
            from freetoken_agent.kernels.triton.moe_parts import plan_parts

            self._plan = plan_parts(topk_ids, n_experts, hidden.shape[1], width, max_pairs)

    def add(self, w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor, last: bool) -> None:
        """Run one part (banks w13 [N, 2I, H], w2 [N, H, I]; rows [E] int32 into them); the
        last one leaves the layer's result in `out`."""
        n = self._parts
        self._parts += 1
        if not last and len(self._sums) < 2:
            wide = torch.promote_types(self.hidden.dtype, torch.float32)
            self._sums.append(torch.empty(self.hidden.shape, dtype=wide, device=self.hidden.device))
        dest = self.out if last else self._sums[n % 2]
        add = None if n == 0 else self._sums[(n - 1) % 2]
        if self._plan is None:
            ids = rows[self.topk_ids]  # [T, K]
            fused_moe_reference(self.hidden, w13, w2, ids, self.topk_weights, dest, add=add)
            return
        from freetoken_agent.kernels.triton.moe_parts import fused_moe_part

        plans, tiles = self._plan
        fused_moe_part(self.hidden, w13, w2, rows, self.topk_ids, self.topk_weights, plans, tiles,
                       dest, add)  # fmt: skip
