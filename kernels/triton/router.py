"""The MoE router after its linear layer, in one Triton kernel: softmax, top-k, renormalise,
round. Twin: `kernels/reference.py` `softmax_topk` (transformers' TopKRouter).

One program per token row: the E logits sit in registers, the softmax is computed in fp32, and
the top k are found by k rounds of argmax (each pick is masked out before the next round), so ids
come out in descending probability order, ties to the lowest index (tl.max's left tie-break).
This replaces torch's softmax, topk (a sort-based kernel of about 9 us), sum, div and casts.

Numerics: probs differ from torch's by a few fp32 ulps (exp and the sum's order), so ids are the
same whenever the top k+1 probabilities are not within that of each other, and fp32 weights agree
to about 1e-7; with round_to, a weight that sits on a rounding boundary of the target dtype may
land one ulp of that dtype away from the twin.
"""

# Shape legend: T tokens, E experts (E_PAD: padded to a power of two), K top-k (K_PAD likewise).

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.triton.norm import round_mode
from freetoken_agent.kernels.triton.norm import round_to as _round  # the name is a parameter below
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch

MAX_EXPERTS = 512
MAX_TOP_K = 16
# Warps per program by padded expert count (first bound >= E_PAD): the k argmax rounds are
# reductions, and one warp reduces with shuffles alone (no shared memory, no barriers).
_WARPS_BY_EXPERTS = ((256, 1), (MAX_EXPERTS, 2))


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, ids_ptr, w_ptr, E, stride_l, stride_i, stride_w,
    K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
    MODE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # first: pdl.py
    t = tl.program_id(0).to(tl.int64)
    _topk_row(logits_ptr + t * stride_l, ids_ptr + t * stride_i, w_ptr + t * stride_w, E,
              K, E_PAD, K_PAD, RENORM, MODE)  # fmt: skip


@triton.jit
def _topk_row(row_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, E_PAD: tl.constexpr,
              K_PAD: tl.constexpr, RENORM: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """One token: its E logits at row_ptr -> K ids and weights at ids_ptr, w_ptr."""
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < E
    # .cg: past L1, which is not coherent with the other programs' stores (fused route).
    x = tl.load(row_ptr + offs_e, mask=e_ok, other=float("-inf"), cache_modifier=".cg")
    x = x.to(tl.float32)  # [E_PAD]
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    # Padding lanes sit below every real probability (>= 0) and every taken one (-1).
    p = tl.where(e_ok, p, -2.0)
    offs_k = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], tl.int32)
    w = tl.zeros([K_PAD], tl.float32)
    for j in tl.static_range(K):
        best, idx = tl.max(p, 0, return_indices=True, return_indices_tie_break_left=True)
        ids = tl.where(offs_k == j, idx, ids)
        w = tl.where(offs_k == j, best, w)
        p = tl.where(offs_e == idx, -1.0, p)
    if RENORM:
        w = w / tl.sum(w, 0)  # padding lanes of w are 0
    w = _round(w, MODE)
    k_ok = offs_k < K
    tl.store(ids_ptr + offs_k, ids, mask=k_ok)
    tl.store(w_ptr + offs_k, w, mask=k_ok)


def softmax_topk(
    logits: Tensor, k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Triton twin of `reference.softmax_topk` (same contract); no host synchronisation.

    logits: [T, E] fp32 / fp16 / bf16, E <= 512, last dim contiguous; k <= 16. Returns new
    ids [T, K] int32 and weights [T, K] fp32.
    """
    assert logits.dim() == 2, f"logits must be [T, E], got {tuple(logits.shape)}"
    T, E = logits.shape
    assert 0 < k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS, (E, k)
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    round_mode(logits.dtype)  # rejects unsupported logits dtypes
    mode = 0 if round_to is None else round_mode(round_to)
    ids = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    if T > 0:
        e_pad = triton.next_power_of_2(E)
        warps = next(w for bound, w in _WARPS_BY_EXPERTS if e_pad <= bound)
        _softmax_topk_kernel[(T,)](
            logits, ids, weights, E, logits.stride(0), ids.stride(0), weights.stride(0),
            K=k, E_PAD=e_pad, K_PAD=triton.next_power_of_2(k), RENORM=renormalize, MODE=mode,
            num_warps=warps,
            **pdl_launch(logits.device),
        )  # fmt: skip
    return ids, weights
