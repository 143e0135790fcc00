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
    """zero_centred (Qwen3-Next, Qwen3.5): the checkpoint stores w - 1 and the norm scales by
    (1 + w) in fp32, rounding once; the +1 is never folded into a bf16 weight (1 + w rounded to
    bf16 loses w's low bits)."""

    def __init__(self, size: int, eps: float, zero_centred: bool = False) -> None:
        super().__init__()
        init = torch.zeros(size) if zero_centred else torch.ones(size)  # the identity either way
        self.weight = nn.Parameter(init, requires_grad=False)
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:  # per-head norms ([T, heads, D]) of the unfused attention path
            y = rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, None, self.zero_centred)
            return y.view(x.shape)
        return rms_norm(x, self.weight, self.eps, residual, self.zero_centred)
