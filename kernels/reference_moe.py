"""Plain-torch twin of the fused MoE expert computation (test oracle and CPU fallback).

Shape legend (shared with `kernels/triton/fused_moe.py`):
  T tokens, H hidden, I expert intermediate width, K top-k, N rows in a weight bank,
  P = T * K (token, choice) pairs; pair p = t * K + k.
  hidden       [T, H]       fp32 / fp16 / bf16
  w13          [N, 2I, H]   rows 0..I-1 of a bank row: gate_proj.weight; rows I..2I-1: up_proj.weight
  w2           [N, H, I]    down_proj.weight
  topk_ids     [T, K]       int32 / int64 bank row ids; a negative id skips that (t, k)
  topk_weights [T, K]       float32 routing weights
  out          [T, H]       hidden.dtype

Bank rows are whatever the caller maps expert ids to (a logical id `layer * n_experts + expert`
today, a GPU cache slot later); this code only indexes rows.

Numerics: every product is computed in fp32 from upcast inputs, the SwiGLU activation stays in
fp32, the routing-weighted sum over k runs in fp32 in the fixed order k = 0..K-1, and the result is
cast to hidden.dtype once. The Triton kernels follow the same contract.

The reference groups pairs by bank row, so each row is upcast once per call. The matmuls go
through torch's CPU BLAS, whose blocking may depend on how many tokens share a row: results are
deterministic for a given batch but only float-close (not bitwise) across batch compositions.
"""

import torch
import torch.nn.functional as F


def check_moe_shapes(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """Assert the fused-MoE contract and return (T, H, I, K)."""
    assert hidden.dim() == 2, f"hidden must be [T, H], got {tuple(hidden.shape)}"
    t, h = hidden.shape
    assert w13.dim() == 3 and w13.shape[2] == h and w13.shape[1] % 2 == 0, (
        f"w13 must be [N, 2I, H={h}], got {tuple(w13.shape)}"
    )
    n, i = w13.shape[0], w13.shape[1] // 2
    assert tuple(w2.shape) == (n, h, i), f"w2 must be [N={n}, H={h}, I={i}], got {tuple(w2.shape)}"
    assert w13.dtype == hidden.dtype and w2.dtype == hidden.dtype, (
        f"dtypes differ: hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    )
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t, (
        f"topk_ids must be [T={t}, K], got {tuple(topk_ids.shape)}"
    )
    assert topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids dtype {topk_ids.dtype}"
    k = topk_ids.shape[1]
    assert tuple(topk_weights.shape) == (t, k), (
        f"topk_weights must be [T={t}, K={k}], got {tuple(topk_weights.shape)}"
    )
    assert topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}"
    if out is not None:
        assert tuple(out.shape) == (t, h) and out.dtype == hidden.dtype, (
            f"out must be [T={t}, H={h}] {hidden.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    return t, h, i, k


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden[t]); SwiGLU experts."""
    t, h, i, k = check_moe_shapes(hidden, w13, w2, topk_ids, topk_weights, out)
    if out is None:
        out = torch.empty_like(hidden)
    ids = topk_ids.reshape(-1).long()  # [P]
    y = torch.zeros(t * k, h, dtype=torch.float32, device=hidden.device)  # [P, H] per-pair outputs
    # A host sync (unique) is fine here: this is the oracle and the CPU path.
    for row in torch.unique(ids[ids >= 0]).tolist():
        pairs = (ids == row).nonzero().squeeze(1)  # [m] pairs that picked this bank row
        x = hidden[pairs // k].float()  # [m, H]
        gate_up = x @ w13[row].float().t()  # [m, 2I]
        act = F.silu(gate_up[:, :i]) * gate_up[:, i:]  # [m, I]
        y[pairs] = act @ w2[row].float().t()  # [m, H]
    y = y.view(t, k, h)
    weights = topk_weights.masked_fill(topk_ids < 0, 0.0)  # [T, K] a skipped pair adds nothing
    acc = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)  # [T, H]
    for j in range(k):  # fixed order over k
        acc += weights[:, j, None] * y[:, j]
    out.copy_(acc)
    return out
