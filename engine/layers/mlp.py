"""Dense SwiGLU MLP: dense layers of partly-sparse models and Qwen2-MoE's shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken_agent.engine.layers.linear import Linear, ShardedLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = ShardedLinear(hidden, {"gate": intermediate, "up": intermediate})
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)
