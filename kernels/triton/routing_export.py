"""A MoE layer's routing and activations written to pinned host memory in one launch.

Captured offloaded decode ends a graph segment after each MoE layer's router: the host must
read the layer's choices (ids, weights) and its activations to place the misses
(engine/segmented_graphs.py). Three copies were three memcpy nodes in every segment of every
step, hit or miss; here one kernel's programs store all three through the mapping of pinned
memory (the device writes host memory directly; the event the host waits on orders the writes
before its reads).

Shapes: T tokens, K top-k, H hidden. ids [T, K] int32, weights [T, K] fp32, hidden [T, H];
each destination is a contiguous tensor of the same shape and dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024  # hidden elements per program
BLOCK_K = 16  # top-k entries per token (K <= BLOCK_K)


@triton.jit
def _export_kernel(ids, weights, hidden, dst_ids, dst_weights, dst_hidden, K, H,
                   BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    row = t.to(tl.int64) * H
    tl.store(dst_hidden + row + offs, tl.load(hidden + row + offs, mask=mask), mask=mask)
    if b == 0:  # one program a token also carries its choices
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        at = t * K + offs_k
        tl.store(dst_ids + at, tl.load(ids + at, mask=mask_k), mask=mask_k)
        tl.store(dst_weights + at, tl.load(weights + at, mask=mask_k), mask=mask_k)


def export_routing(ids, weights, hidden, dst_ids, dst_weights, dst_hidden) -> None:
    """dst_ids[:] = ids, dst_weights[:] = weights, dst_hidden[:] = hidden, in one launch."""
    t, h = hidden.shape
    k = ids.shape[1]
    assert k <= BLOCK_K, f"top-k {k} above the kernel's {BLOCK_K}"
    if t == 0:
        return
    _export_kernel[(t, triton.cdiv(h, BLOCK))](
        ids, weights, hidden, dst_ids, dst_weights, dst_hidden, k, h,
        BLOCK=BLOCK, BLOCK_K=BLOCK_K,
    )  # fmt: skip
