"""The all-resident expert bank: every routed expert lives on the compute device.

Banks are flattened by logical id `lid = moe_layer * n_experts + expert`, one bank per
projection, each expert contiguous: `w13[lid]` holds gate (rows 0..I-1) and up (rows I..2I-1),
`w2[lid]` holds down. The offloading banks of the next issue keep this layout, so a slot fill is
one copy per bank.
"""

from __future__ import annotations

import torch

from freetoken_agent.engine.config import ModelSpec
from freetoken_agent.kernels.fused_moe import fused_moe

# L MoE layers, E experts per layer, H hidden, I expert width, T tokens, K top-k


class ResidentExpertBank:
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        n = spec.n_moe_layers * spec.n_experts
        h, i = spec.hidden_size, spec.moe_intermediate_size
        self.n_experts = spec.n_experts
        self.intermediate = i
        self.w13 = torch.empty(n, 2 * i, h, dtype=dtype, device=device)  # [L*E, 2I, H]
        self.w2 = torch.empty(n, h, i, dtype=dtype, device=device)  # [L*E, H, I]

    def lid(self, layer: int, expert: int) -> int:
        return layer * self.n_experts + expert

    def projection(self, layer: int, expert: int, proj: str) -> torch.Tensor:
        """The view of one expert's projection ("gate", "up", "down") that the loader fills."""
        row = self.lid(layer, expert)
        if proj == "gate":
            return self.w13[row, : self.intermediate]
        if proj == "up":
            return self.w13[row, self.intermediate :]
        if proj == "gate_up":
            return self.w13[row]
        if proj == "down":
            return self.w2[row]
        raise KeyError(f"unknown expert projection {proj!r}")

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int32
        topk_weights: torch.Tensor,  # [T, K] fp32
    ) -> torch.Tensor:
        # The layer's experts are rows [layer * E, (layer + 1) * E): pass that slice (a view) so
        # the kernels group pairs over E rows, not over every layer's.
        lo, hi = layer * self.n_experts, (layer + 1) * self.n_experts
        return fused_moe(hidden, self.w13[lo:hi], self.w2[lo:hi], topk_ids, topk_weights)
