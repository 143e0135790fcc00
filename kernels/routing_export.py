"""Export a MoE layer's routing and activations to the host (kernels/triton/routing_export.py on
CUDA: one launch into pinned memory; three copies elsewhere, the same values).

Shapes: ids [T, K] int32, weights [T, K] fp32, hidden [T, H]; destinations alike, contiguous.
"""

from __future__ import annotations

import logging

from torch import Tensor

from freetoken_agent.kernels.dispatch import use_triton

log = logging.getLogger("freetoken.kernels")

_kernel_works: bool | None = None  # whether the kernel's first launch went (None: not yet)


def export_routing(ids: Tensor, weights: Tensor, hidden: Tensor, dst_ids: Tensor,
                   dst_weights: Tensor, dst_hidden: Tensor, *,
                   force_triton: bool = False) -> None:  # fmt: skip
    """dst_* = the layer's ids, weights and hidden. On CUDA the destinations are pinned host
    tensors (or device ones) the kernel writes directly; callers order their reads after it
    (an event)."""
    pairs = ((ids, dst_ids), (weights, dst_weights), (hidden, dst_hidden))
    for src, dst in pairs:
        if dst.shape != src.shape or not dst.is_contiguous():
            raise ValueError(
                f"export destination {tuple(dst.shape)} does not fit {tuple(src.shape)} "
                "(or is not contiguous)"
            )
    global _kernel_works
    same = all(src.dtype == dst.dtype for src, dst in pairs)  # the kernel converts nothing
    if not (same and _kernel_works is not False and use_triton(hidden, force_triton, "export")):
        _copy(pairs)
        return
    from freetoken_agent.kernels.triton import routing_export as triton_impl

    try:
        triton_impl.export_routing(ids.contiguous(), weights.contiguous(), hidden.contiguous(),
                                   dst_ids, dst_weights, dst_hidden)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - only the first launch, which proves the path
        if _kernel_works:
            raise
        # A driver that will not let kernels store to pinned host memory: copies from now on
        # (the first call is a warm-up before any graph capture).
        _kernel_works = False
        log.warning("routing export kernel unavailable (%s); exporting with copies", e)
        _copy(pairs)
        return
    _kernel_works = True


def _copy(pairs) -> None:
    for src, dst in pairs:
        dst.copy_(src, non_blocking=True)
