"""A linear layer, the residual add after it and the RMSNorm after that (h, s = rms_norm(x @
W^T, weight, eps, residual)): one launch for decode-sized CUDA inputs (kernels/triton/
proj_norm.py, EngineConfig.fused_proj_norm), F.linear then kernels/norm.py's rms_norm otherwise.

Shapes: x [M, K], W [N, K], residual, h, s [M, N]; weight [N].
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from freetoken_agent.kernels.dispatch import use_triton
from freetoken_agent.kernels.gemv import MAX_M
from freetoken_agent.kernels.norm import rms_norm

MAX_N = 8192  # outputs the one launch takes: its last program holds a row in registers


def proj_add_norm(
    x: Tensor,
    w: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    zero_centred: bool = False,
    *,
    scratch: tuple[Tensor, Tensor] | None = None,
    force_triton: bool = False,
) -> tuple[Tensor, Tensor]:
    """(h, s) with s = round(x @ w^T + residual), h = rms_norm(s) * norm_weight (zero_centred:
    * (1 + norm_weight)). `scratch`: kernels/triton/proj_norm.py new_scratch's for w's shape."""
    if 0 < x.shape[0] <= MAX_M and w.shape[0] <= MAX_N and use_triton(x, force_triton, "proj_norm"):
        from freetoken_agent.kernels.triton.proj_norm import proj_add_norm as triton_impl

        return triton_impl(x, w, residual, norm_weight, eps, zero_centred, scratch)
    y = F.linear(x, w)
    return rms_norm(y, norm_weight, eps, residual, zero_centred, force_triton=force_triton)
