"""RMSNorm (optionally fused with the residual add) entry point: the Triton kernel on CUDA
tensors, the plain-torch twin otherwise.

Shapes (legend of `kernels/reference.py`): x, residual, y, s [T, H]; weight [H].
"""

from __future__ import annotations

import os

from torch import Tensor

from freetoken_agent.kernels import reference


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    *,
    force_triton: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """y = weight * to_dtype(x32 * rsqrt(mean(x32^2) + eps)); with residual, s = x + residual
    first and (y, s) is returned. See `reference.rms_norm` for the contract.

    CUDA tensors run the Triton kernel (no host synchronisation, CUDA-graph safe); CPU tensors
    run the twin, or, with force_triton, the Triton kernel under TRITON_INTERPRET=1 (tests).
    """
    if not (x.is_cuda or force_triton):
        return reference.rms_norm(x, weight, eps, residual)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "rms_norm(force_triton=True) on CPU tensors needs TRITON_INTERPRET=1 set before "
            "triton is imported"
        )
    # Imported here so the CPU fallback works on machines without triton.
    from freetoken_agent.kernels.triton.norm import rms_norm as triton_impl

    return triton_impl(x, weight, eps, residual)
