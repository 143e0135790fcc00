"""MoE router (softmax + top-k + renormalise + round) entry point: the Triton kernel on CUDA
tensors, the plain-torch twin otherwise.

Shapes (legend of `kernels/reference.py`): logits [T, E]; ids [T, K] int32; weights
[T, K] fp32.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from freetoken_agent.kernels import reference


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
    if not (logits.is_cuda or force_triton):
        return reference.softmax_topk(logits, k, renormalize, round_to)
    if not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "softmax_topk(force_triton=True) on CPU tensors needs TRITON_INTERPRET=1 set before "
            "triton is imported"
        )
    # Imported here so the CPU fallback works on machines without triton.
    from freetoken_agent.kernels.triton.router import softmax_topk as triton_impl

    return triton_impl(logits, k, renormalize, round_to)
