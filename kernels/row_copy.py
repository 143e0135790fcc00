"""Copy rows between banks by index (kernels/triton/row_copy.py on CUDA; a loop of copies
elsewhere, the same bytes).

Shapes: dst [R_dst, ...], src [R_src, ...] with the same row shape, each row contiguous inside;
dst_rows, src_rows [R] int64 (on dst's device for the Triton kernel).
"""

from __future__ import annotations

from torch import Tensor

from freetoken_agent.kernels.dispatch import use_triton


def row_copy(dst: Tensor, src: Tensor, dst_rows: Tensor, src_rows: Tensor, *,
             force_triton: bool = False) -> None:  # fmt: skip
    """dst[dst_rows[r]] = src[src_rows[r]] for every r; rows must not overlap between reads
    and writes (the launch copies them in any order)."""
    if dst.shape[1:] != src.shape[1:]:
        d, s = tuple(dst.shape[1:]), tuple(src.shape[1:])
        raise ValueError(f"row shapes differ: dst {d}, src {s}")
    if not (dst[0].is_contiguous() and src[0].is_contiguous()):
        raise ValueError("row_copy needs rows contiguous inside")
    if not use_triton(dst, force_triton, "row_copy"):
        for d, s in zip(dst_rows.tolist(), src_rows.tolist(), strict=True):
            dst[d].copy_(src[s])
        return
    from freetoken_agent.kernels.triton.row_copy import row_copy as triton_impl

    triton_impl(dst, src, dst_rows, src_rows)
