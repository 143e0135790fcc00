"""The prefill path of the Triton fused MoE, its pairs sorted once for launches over parts of
the experts (`kernels/moe_parts.py`).

`fused_moe_prefill` sorts a chunk's pairs by bank row at every call: a dozen small kernels and
their host dispatch, which a layer streamed in eight groups paid eight times a token chunk (on
the H100 host, a 16k-token chunk's MoE enqueued slower than its experts crossed the link:
bench/results/stream_groups_s59.json). Here the pairs are sorted by expert once (`plan_parts`);
a part's launch maps the blocks' experts to its bank's rows (one gather) and runs the same
grouped GEMMs and sum, so each pair's output is computed as `fused_moe_prefill` computes it.

Shapes: hidden [T, H], topk_ids [T, K] expert ids in [0, E), topk_weights [T, K] fp32,
rows [E] int32 (the part's bank row of each expert, -1: another part's), P = T * K pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from freetoken_agent.kernels.triton.moe_common import (
    PREFILL_TILES,
    _check,
    _dot_precision,
    _sum_over_k_kernel,
    _tiles,
)
from freetoken_agent.kernels.triton.moe_prefill import (
    _grouped_down_kernel,
    _grouped_gate_up_kernel,
    align_pairs_by_row,
)
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """One token chunk's pairs sorted by expert: tokens [t0, t1), order [S] (the pair at each
    sorted position), and per block its expert (E where unused: an index of `rows` padded with
    -1), first sorted position and end."""

    t0: int
    t1: int
    order: torch.Tensor
    blk_expert: torch.Tensor
    blk_start: torch.Tensor
    blk_end: torch.Tensor


def plan_parts(
    topk_ids: torch.Tensor,
    n_experts: int,
    h: int,
    i: int,
    max_pairs: int,
    tiles: dict[str, int] | None = None,
) -> tuple[list[ChunkPlan], dict[str, int]]:
    """The pairs of each chunk of at most `max_pairs` pairs sorted by expert, with the tiles
    the launches will use (the blocks are BLOCK_M pairs of one expert; `tiles` overrides the
    table's, for tests)."""
    c = _tiles(PREFILL_TILES, h, i, {**(tiles or {}), "CHUNK_PAIRS": max_pairs})
    t, k = topk_ids.shape
    chunk = max(1, c["CHUNK_PAIRS"] // max(k, 1))  # tokens per launch
    plans = []
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        order, expert, start, end = align_pairs_by_row(topk_ids[t0:t1].reshape(-1), n_experts,
                                                       c["BLOCK_M"])  # fmt: skip
        plans.append(ChunkPlan(t0, t1, order, torch.where(expert < 0, n_experts, expert), start,
                               end))  # fmt: skip
    return plans, c


def fused_moe_part(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    rows: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    plans: list[ChunkPlan],
    c: dict[str, int],
    out: torch.Tensor,
    add: torch.Tensor | None,
) -> None:
    """out = the part's experts' sum over k (+ add, then zeroed), as `fused_moe_prefill` would
    compute it with ids rows[topk_ids]; out may be `add` (fp32, read before written)."""
    ids = rows[topk_ids.long()]  # [T, K] bank rows, -1: another part's pair
    _check(hidden, w13, w2, ids, topk_weights, out)
    padded = torch.cat([rows, rows.new_full((1,), -1)])  # [E + 1]: unused blocks stay -1
    i, h = w13.shape[1] // 2, hidden.shape[1]
    prec = _dot_precision(hidden.dtype)
    for p in plans:
        x, part_ids, k = hidden[p.t0 : p.t1], ids[p.t0 : p.t1], ids.shape[1]
        n = p.t1 - p.t0
        blk_row = padded[p.blk_expert]  # [B] this part's bank row of each block, or -1
        n_blk = blk_row.numel()
        act = torch.empty(n * k, i, dtype=hidden.dtype, device=hidden.device)  # [S, I]
        y = torch.empty(n * k, h, dtype=torch.float32, device=hidden.device)  # [P, H]
        _grouped_gate_up_kernel[(n_blk * triton.cdiv(i, c["BLOCK_N"]),)](
            x, w13, p.order, blk_row, p.blk_start, p.blk_end, act, w13.stride(0), h, i,
            K=k, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PREC=prec,
            num_warps=c["WARPS_UP"], num_stages=c["STAGES_UP"],
        )  # fmt: skip
        _grouped_down_kernel[(n_blk * triton.cdiv(h, c["DOWN_BLOCK_N"]),)](
            act, w2, p.order, blk_row, p.blk_start, p.blk_end, y, w2.stride(0), h, i,
            BLOCK_M=c["BLOCK_M"], BLOCK_N=c["DOWN_BLOCK_N"], BLOCK_K=c["DOWN_BLOCK_K"], PREC=prec,
            num_warps=c["WARPS_DOWN"], num_stages=c["STAGES_DOWN"],
        )  # fmt: skip
        o = out[p.t0 : p.t1]
        a = o if add is None else add[p.t0 : p.t1]
        _sum_over_k_kernel[(n, triton.cdiv(h, c["SUM_BLOCK"]))](
            y, part_ids, topk_weights[p.t0 : p.t1], o, a, part_ids, part_ids, y, 0, h,
            K=k, BLOCK=c["SUM_BLOCK"], HOST=False, ADD=add is not None, COLLECT=False, SYS=False,
            **pdl_launch(hidden.device),
        )  # fmt: skip
