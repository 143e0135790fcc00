"""Lent cache slots as contiguous scratch banks, so a streamed layer's host copies are plain DMA.

The elastic arena (engine/arena.py) lays each slot out as its w13 rows then its w2 rows, so its
banks are strided views: `w13 [n, 2I, H]` has stride U = 2I*H + H*I between slots, not 2I*H.
A host-to-device `copy_` into such a view cannot be one DMA: torch copies into a contiguous
temporary and then launches an elementwise kernel into the strided rows. Streaming a prefill
layer into lent slots did that for every run of absent experts (on the device: ~12k extra
kernels and 270 ms of SM time per 32k-token prefill, and each copy-stream kernel waited behind
the compute stream's kernels for SMs, stalling the next DMA: the elastic engine's time to first
token ran 20-30% above a fixed split's, whose staging is contiguous, on every long turn).

Lent slots hold no experts while lent (the cache evicted them), so their bytes may be viewed any
way: n consecutive slots are n*U contiguous elements, seen here as one w13 bank of n*2I*H
elements followed by one w2 bank of n*H*I.
"""

from __future__ import annotations

import torch

# n lent slots, H hidden, I expert width, U = 2I*H + H*I elements a slot


def contiguous_scratch(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of n consecutive slots ([n, 2I, H] and [n, H, I] views) as two contiguous banks
    of the same shapes. Banks that are contiguous already (a cache of its own tensors) come back
    as they are; the arena's interleaved layout is re-viewed; any other layout is an error."""
    if w13.is_contiguous() and w2.is_contiguous():
        return w13, w2
    n, e13, e2 = w13.shape[0], w13[0].numel(), w2[0].numel()
    unit = e13 + e2
    interleaved = (
        w13.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr()
        and w13.stride() == (unit, *w13[0].stride())
        and w2.stride() == (unit, *w2[0].stride())
        and w13[0].is_contiguous()
        and w2[0].is_contiguous()
        and w2.storage_offset() == w13.storage_offset() + e13
    )
    if not interleaved:
        raise ValueError(
            f"lent slots in an unknown layout: w13 strides {w13.stride()}, w2 strides {w2.stride()}"
        )
    flat = w13.as_strided((n * unit,), (1,), w13.storage_offset())  # the n slots' bytes
    return flat[: n * e13].view(w13.shape), flat[n * e13 :].view(w2.shape)
