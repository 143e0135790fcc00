"""Copy whole rows between two banks by index, in one launch: dst[dst_rows[r]] = src[src_rows[r]].

A row is one expert's block of a bank ([2I, H] of w13, or [H, I] of w2), contiguous inside, rows
`row_stride` elements apart (the elastic arena's slot views are strided: slot units hold both
banks). The prefill streamer stages a layer's resident experts this way: one launch for the
~90 experts of a layer instead of a cudaMemcpyAsync each, whose host cost doubled on the
arena's virtual memory (bench/results/NOTES.md, eighth session).

Shapes: src [R_src, n] and dst [R_dst, n] as (pointer, row stride) with n elements a row;
src_rows, dst_rows [R] int64 on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements a program copies (8 KB of bf16): rows of millions split over many


@triton.jit
def _row_copy_kernel(src, dst, src_rows, dst_rows, n, src_stride, dst_stride,
                     BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # int64: slot 4,000 of a 6.3 MB unit is ~1.3e10 elements in
    s = tl.load(src_rows + r).to(tl.int64) * src_stride
    d = tl.load(dst_rows + r).to(tl.int64) * dst_stride
    tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)


def row_copy(dst: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor,
             src_rows: torch.Tensor) -> None:  # fmt: skip
    """dst[dst_rows[r]] = src[src_rows[r]] for every r (see the module docstring)."""
    n = src[0].numel()
    grid = (src_rows.numel(), triton.cdiv(n, BLOCK))
    if grid[0] == 0:
        return
    _row_copy_kernel[grid](src, dst, src_rows, dst_rows, n, src.stride(0), dst.stride(0),
                           BLOCK=BLOCK)  # fmt: skip
