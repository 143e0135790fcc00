"""RMSNorm, computed in fp32 (or wider) and cast back before the weight multiply, as
transformers does; optionally fused with the residual add that precedes it.

The decoder passes the residual stream along instead of adding it itself: `norm(x, residual)`
computes s = x + residual (rounded to the model dtype, like transformers' `residual + hidden`),
returns (norm(s), s). One kernel instead of the add and the norm's six small ops.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken_agent.kernels.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:  # per-head norms ([T, heads, D]) of the unfused attention path
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return rms_norm(x, self.weight, self.eps, residual)
