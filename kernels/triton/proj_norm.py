"""A decode step's attention output projection, the residual add and the next RMSNorm in one
launch: h, s = rms_norm(x @ W^T, weight, eps, residual).

Why: at decode the o projection is a cuBLAS GEMV with a split-K reduce (7.1 + 1.7 us on the
H200 at Qwen3-30B-A3B's 4096 -> 2048, ~1.9 TB/s) and the post-attention norm a third launch
(bench/results/NOTES.md, twelfth session): three launches and their gaps, 48 times a step.
Here the skinny matmul's programs (kernels/triton/gemv.py: BLOCK_N columns, one of SPLIT_K
slices of K each) write fp32 partials; the last program to finish (an acquire-release counter
at GPU scope, as kernels/triton/sampling.py draws) sums each row's slices in slice order,
rounds the sum to the model dtype (F.linear's output), and runs the norm kernel's row code on
it (kernels/triton/norm.py: s = round(y + residual), then the normalised row times the weight),
then puts the counter back to 0.

Numerics: y is an fp32 sum in another order than cuBLAS's, rounded to the model dtype, so an
element can land one ulp of that dtype away from F.linear's; from y on, every rounding is the
norm kernel's.

Shape legend: M tokens (<= kernels/gemv.py MAX_M), K input features, N output features (the
hidden size, <= MAX_N), S = SPLIT_K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.gemv import MAX_M
from freetoken_agent.kernels.proj_norm import MAX_N
from freetoken_agent.kernels.triton.gemv import _gemv_tile, _prefetch_tile, choose_tiles, splits
from freetoken_agent.kernels.triton.norm import _normalise_row, round_mode, round_to, warps_for
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch


@triton.jit
def _proj_norm_kernel(
    x_ptr, w_ptr, part_ptr, done_ptr, r_ptr, nw_ptr, h_ptr, s_ptr,
    N, K, k_per_split, stride_xm, stride_wn, stride_r, inv_n, eps,
    M: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, MODE: tl.constexpr, ZERO_CENTRED: tl.constexpr, ROW: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pid_n, s = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo = s * k_per_split
    _prefetch_tile(w_ptr, offs_n, n_ok, k_lo, tl.minimum(k_lo + k_per_split, K), stride_wn, PDL)
    enter(PDL)  # after the prefetch of the model's weights, before anything else: pdl.py
    offs_m = tl.arange(0, 16)
    acc = _gemv_tile(x_ptr, w_ptr, offs_n, n_ok, offs_m, k_lo, tl.minimum(k_lo + k_per_split, K),
                     stride_xm, stride_wn, M, BLOCK_N, BLOCK_K, PREC)  # fmt: skip
    part = part_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(part, acc, mask=(offs_m[:, None] < M) & n_ok[None, :])
    # The partials are ordered before the add (release); the last program's loads after it
    # (acquire, past L1) see every program's.
    n_programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == n_programs - 1:
        tl.store(done_ptr, 0)
        offs = tl.arange(0, ROW)
        ok = offs < N
        for m in range(M):
            y = tl.zeros([ROW], tl.float32)
            for j in tl.static_range(S):  # slice order: the same sum every launch
                y += tl.load(part_ptr + (j * M + m) * N + offs, mask=ok, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
            y = round_to(y, MODE)  # F.linear's output in the model dtype
            r = tl.load(r_ptr + m * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
            row = round_to(y + r, MODE)  # the residual stream s, as the norm kernel rounds it
            _normalise_row(row, offs, ok, nw_ptr, h_ptr + m * N, s_ptr + m * N, inv_n, eps,
                           True, MODE, ZERO_CENTRED)  # fmt: skip


def new_scratch(
    n: int, k: int, device: torch.device, tiles: dict[str, int] | None = None
) -> tuple[Tensor, Tensor]:
    """A call site's scratch for an [n, k] weight: fp32 partials [S * MAX_M * n] and the
    counter (0 between launches). Full size at once: a captured graph keeps their addresses.
    Each projection keeps its own (engine/layers/attention.py), as the router does its.
    `tiles`: the overrides the launches will pass (the bench's sweep)."""
    s = splits(k, choose_tiles(n, k, tiles))[0]
    part = torch.zeros(s * MAX_M * n, dtype=torch.float32, device=device)
    return part, torch.zeros(1, dtype=torch.int32, device=device)


def proj_add_norm(
    x: Tensor,
    w: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    zero_centred: bool = False,
    scratch: tuple[Tensor, Tensor] | None = None,
    tiles: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """(h, s): s = round(x @ w^T + residual), h = rms_norm(s) * norm_weight, as F.linear then
    kernels/norm.py's rms_norm(y, norm_weight, eps, residual) give them. x [M, K] (M <= MAX_M),
    w [N, K], residual [M, N], norm_weight [N]; rows contiguous. `scratch`: new_scratch's for
    this w's shape and `tiles` (a new one when None). `tiles` overrides the skinny matmul's
    (gemv.py choose_tiles; bench gemv's sweep)."""
    m, k = x.shape
    n = w.shape[0]
    assert 1 <= m <= MAX_M and n <= MAX_N and w.shape[1] == k, (tuple(x.shape), tuple(w.shape))
    assert residual.shape == (m, n) and norm_weight.shape == (n,), (residual.shape, n)
    assert x.stride(1) == 1 and w.stride(1) == 1 and residual.stride(1) == 1
    assert x.dtype == w.dtype == residual.dtype == norm_weight.dtype
    tiles = choose_tiles(n, k, tiles)
    s, k_per_split = splits(k, tiles)
    part, done = scratch if scratch is not None else new_scratch(n, k, x.device, tiles)
    assert part.numel() >= s * m * n, "the scratch was made for another shape"
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    out_s = torch.empty_like(h)
    row = triton.next_power_of_2(n)
    _proj_norm_kernel[(triton.cdiv(n, tiles["BLOCK_N"]), s)](
        x, w, part, done, residual, norm_weight, h, out_s, n, k, k_per_split, x.stride(0),
        w.stride(0), residual.stride(0), 1.0 / n, eps, M=m, S=s, BLOCK_N=tiles["BLOCK_N"],
        BLOCK_K=tiles["BLOCK_K"], PREC="ieee" if x.dtype == torch.float32 else "tf32",
        MODE=round_mode(x.dtype), ZERO_CENTRED=zero_centred, ROW=row,
        num_warps=max(tiles["WARPS"], warps_for(row)),
        **pdl_launch(x.device, heavy=True, prefetch=True),
    )  # fmt: skip
    return h, out_s
