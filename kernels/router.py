"""MoE router (softmax + top-k + renormalise + round) entry point: the Triton kernel on CUDA
tensors, the plain-torch twin otherwise.

Shapes (legend of `kernels/reference.py`): logits [T, E]; ids [T, K] int32; weights
[T, K] fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.dispatch import use_triton

ROUTE_MAX_TOKENS = 16  # `route` in one launch up to a decode step's tokens; more: a prefill GEMM


def softmax_topk(
    logits: Tensor,
    k: int,
    renormalize: bool,
    round_to: torch.dtype | None = None,
    *,
    force_triton: bool = False,
) -> tuple[Tensor, Tensor]:
    """(ids, weights) of the k most probable experts per token; see
    `reference.softmax_topk` for the contract.

    CUDA tensors run the Triton kernel (no host synchronisation, CUDA-graph safe); CPU tensors
    run the twin, or, with force_triton, the Triton kernel under TRITON_INTERPRET=1 (tests).
    """
    if not use_triton(logits, force_triton, "softmax_topk"):
        return reference.softmax_topk(logits, k, renormalize, round_to)
    # Imported here so the CPU fallback works on machines without triton.
    from freetoken_agent.kernels.triton.router import softmax_topk as triton_impl

    return triton_impl(logits, k, renormalize, round_to)


def route(
    x: Tensor,
    weight: Tensor,
    k: int,
    renormalize: bool,
    round_to: torch.dtype | None = None,
    *,
    scratch: tuple[Tensor, Tensor] | None = None,
    force_triton: bool = False,
) -> tuple[Tensor, Tensor]:
    """The router's linear layer and `softmax_topk` of its logits (in x's dtype, as F.linear
    returns them): x [T, H], weight [E, H] -> ids [T, K] int32, weights [T, K] fp32. Decode-
    sized CUDA inputs run both in one launch (kernels/triton/route.py, EngineConfig.
    fused_router; `scratch`: kernels/triton/route.py new_scratch's, the caller's own); anything
    else F.linear, then softmax_topk."""
    if x.shape[0] <= ROUTE_MAX_TOKENS and use_triton(x, force_triton, "route"):
        from freetoken_agent.kernels.triton.route import route as triton_route

        return triton_route(x, weight, k, renormalize, round_to, scratch=scratch)
    logits = torch.nn.functional.linear(x, weight)
    return softmax_topk(logits, k, renormalize, round_to, force_triton=force_triton)
