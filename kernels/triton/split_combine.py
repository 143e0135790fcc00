"""Combining split-KV partials of paged attention (kernels/triton/paged_attention.py).

A split program leaves, per query row, its unnormalised sum acc [D], running max m and running
sum l (fp32, log2 domain). The output row is sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
with M = max_s m_s. One piece of code (`_combine_rows`, BLOCK_M rows at once), run two ways:

- `_combine_splits_kernel`, a launch of its own over (T, Hq) after the split programs, a row
  each;
- inside the attention kernel, by the last split program of a (q block, kv head) to finish (an
  acquire-release counter at GPU scope, as kernels/triton/proj_norm.py sums its slices): no
  second launch. On the H200 at Qwen3-30B-A3B's decode step the combine launch took 5.2 us of
  the layer's 11.5 us of attention, 48 times a step (bench step-kernels, twenty-first session).
  The last program reads only the splits that hold tiles of its block (a short context in a
  graph sized for a long one leaves most of them empty).
"""

# Shape legend: T query tokens, Hq query heads, NS splits, D head dim (D_PAD: padded to a power of
# two >= 16); partials acc [T, Hq, NS, D], m and l [T, Hq, NS], all fp32.

from __future__ import annotations

import triton
import triton.language as tl

from freetoken_agent.kernels.triton.pdl import enter

SPLIT_CHUNK = 16  # splits combined per step in the reduce kernel (bounds its registers)
COMBINE_CHUNK = 4  # splits a row's combine reads a step in `_combine_rows` (BLOCK_M rows at once)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, num_splits, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # first: pdl.py
    # grid: (T, Hq): one row a program, all its splits (`_combine_rows` with one row).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    one = tl.arange(0, 1)  # [1]: the program's row
    base = (t * num_q_heads + h) * num_splits + one
    offs_d = tl.arange(0, D_PAD)
    o_ptrs = out_ptr + t * stride_ot + h * stride_oh + offs_d[None, :] + one[:, None]
    _combine_rows(
        part_acc_ptr, part_m_ptr, part_l_ptr, base, one == 0, num_splits, o_ptrs,
        (offs_d < HEAD_DIM)[None, :] & (one == 0)[:, None], 1, HEAD_DIM, D_PAD, SPLITS_PAD, CHUNK,
    )  # fmt: skip


@triton.jit
def _combine_rows(
    part_acc_ptr, part_m_ptr, part_l_ptr, base, row_ok, n_used, o_ptrs, io_mask,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """The output of BLOCK_M rows from their first n_used splits' partials (the others hold no
    tile of these rows). base [BLOCK_M]: each row's first partial, (t * Hq + head) * NS. Loads
    bypass L1 (.cg): other programs wrote the partials, ordered by the caller's counter."""
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = row_ok[:, None] & (offs_s < n_used)[None, :]  # [BLOCK_M, SPLITS_PAD]
    at = base[:, None] + offs_s[None, :]
    m_all = tl.load(part_m_ptr + at, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    l_all = tl.load(part_l_ptr + at, mask=s_ok, other=0.0, cache_modifier=".cg")
    m_max = tl.where(row_ok, tl.max(m_all, 1), 0.0)  # [BLOCK_M]; padding rows: no -inf - -inf
    denom = tl.sum(tl.exp2(m_all - m_max[:, None]) * l_all, 1)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D_PAD)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for c in range(0, n_used, CHUNK):
        s = c + offs_c
        ok = row_ok[:, None] & (s < n_used)[None, :]  # [BLOCK_M, CHUNK]
        m = tl.load(part_m_ptr + base[:, None] + s[None, :], mask=ok, other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
        w = tl.exp2(m - m_max[:, None])  # [BLOCK_M, CHUNK]
        a_ptrs = part_acc_ptr + (base[:, None, None] + s[None, :, None]) * HEAD_DIM
        a = tl.load(
            a_ptrs + offs_d[None, None, :],
            mask=ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip  [BLOCK_M, CHUNK, D_PAD]
        acc += tl.sum(a * w[:, :, None], 1)
    o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=io_mask)
