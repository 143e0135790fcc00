"""Fused MoE expert computation over rows of weight banks: Triton kernels and launchers.

Shape legend (the twin is `kernels/reference_moe.py`):
  T tokens, H hidden, I expert intermediate width, K top-k, N rows in a weight bank,
  P = T * K (token, choice) pairs; pair p = t * K + k. S sorted positions (pairs grouped by row).
  hidden [T, H]; w13 [N, 2I, H] (gate rows 0..I-1, up rows I..2I-1); w2 [N, H, I];
  w13 / w2 rows may be strided (stride(0) any, each row's block dense: arena slots);
  topk_ids [T, K] int32/int64 (negative = skip); topk_weights [T, K] fp32; out [T, H].
  Expert: y = w2 @ (silu(w13[:I] @ x) * (w13[I:] @ x)).

Two paths, both free of host syncs (grids come from T, K, H, I, N only), so both can be captured
in a CUDA graph, and both end with `_sum_over_k_kernel` (y [P, H] fp32 -> out [T, H]):
- decode (few pairs, bandwidth-bound): pairs that picked the same row form a group led by its
  first pair; `_decode_gate_up_kernel` (act [P, I]) and `_decode_down_kernel` (y) run one
  program per (pair, output block), the leader computing its whole group with tl.dot, so a row's
  weights are read once per batch, and the other programs exit at once. No sort is needed.
- prefill (many pairs, compute-bound): pairs are sorted by row on the device, then grouped GEMMs
  with tl.dot over blocks of pairs of one row.
Why tl.dot even for one token: Triton software-pipelines (multi-buffers) only loads that feed a
dot, and the streamed weights need those loads in flight to reach HBM bandwidth.

Determinism: no atomics; every output element sums k = 0..K-1 in a fixed order, and a pair's
arithmetic does not depend on the other pairs of its tile (tl.dot rows are independent; masked
rows are zeros), so on either path a token's bits do not depend on the rest of the batch. Tiles
are keyed by (H, I), never by T, for the same reason.
"""

# The kernels live in one module per path, with what both share in moe_common; this module
# stays the import point for callers (and for tests that patch the launchers here).
from freetoken_agent.kernels.triton.moe_common import DECODE_MAX_PAIRS, DECODE_TILES, PREFILL_TILES
from freetoken_agent.kernels.triton.moe_decode import fused_moe_decode
from freetoken_agent.kernels.triton.moe_prefill import align_pairs_by_row, fused_moe_prefill

__all__ = [
    "DECODE_MAX_PAIRS",
    "DECODE_TILES",
    "PREFILL_TILES",
    "align_pairs_by_row",
    "fused_moe_decode",
    "fused_moe_prefill",
]
