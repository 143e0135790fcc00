"""Skinny matmul dispatcher: y [M, N] = x [M, K] @ W [N, K]^T (+ b) for decode-sized M.

CUDA tensors of at most `MAX_M` rows take the Triton kernel (kernels/triton/gemv.py), anything
else torch's F.linear. The model's projections take it only with EngineConfig.skinny_gemv
(layers/linear.py), off until `bench gemv` has compared the two per shape on the device.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from freetoken_agent.kernels.dispatch import use_triton

MAX_M = 8  # rows a call takes; a larger batch belongs to a GEMM


def gemv(x: Tensor, w: Tensor, bias: Tensor | None = None, *, force_triton: bool = False,
         tiles: dict[str, int] | None = None) -> Tensor:  # fmt: skip
    if x.shape[0] > MAX_M or not use_triton(x, force_triton, "gemv"):
        return F.linear(x, w, bias)
    from freetoken_agent.kernels.triton.gemv import gemv as triton_gemv

    return triton_gemv(x.contiguous(), w, bias, tiles=tiles)
