"""RMSNorm (optionally fused with the residual add) entry point: the Triton kernel on CUDA
tensors, the plain-torch twin otherwise.

Shapes (legend of `kernels/reference.py`): x, residual, y, s [T, H]; weight [H].
"""

from __future__ import annotations

from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.dispatch import use_triton


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    zero_centred: bool = False,
    *,
    force_triton: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """y = weight * to_dtype(x32 * rsqrt(mean(x32^2) + eps)) (zero_centred: to_dtype(x32 *
    rsqrt(...) * (1 + weight32))); with residual, s = x + residual first and (y, s) is
    returned. See `reference.rms_norm` for the contract.

    CUDA tensors run the Triton kernel (no host synchronisation, CUDA-graph safe); CPU tensors
    run the twin, or, with force_triton, the Triton kernel under TRITON_INTERPRET=1 (tests).
    """
    if not use_triton(x, force_triton, "rms_norm"):
        return reference.rms_norm(x, weight, eps, residual, zero_centred)
    # Imported here so the CPU fallback works on machines without triton.
    from freetoken_agent.kernels.triton.norm import rms_norm as triton_impl

    return triton_impl(x, weight, eps, residual, zero_centred)
