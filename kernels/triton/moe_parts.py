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

from freetoken_agent.kernels.triton.moe_common import PREFILL_TILES, _check, _tiles
from freetoken_agent.kernels.triton.moe_prefill import align_pairs_by_row, run_blocks


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
    compute it with ids rows[topk_ids]; out is never `add` (`fused_moe`'s rule)."""
    ids = rows[topk_ids.long()]  # [T, K] bank rows, -1: another part's pair
    _check(hidden, w13, w2, ids, topk_weights, out)
    padded = torch.cat([rows, rows.new_full((1,), -1)])  # [E + 1]: unused blocks stay -1
    for p in plans:
        chunk = slice(p.t0, p.t1)
        blk_row = padded[p.blk_expert]  # [B] this part's bank row of each block, or -1
        run_blocks(hidden[chunk], w13, w2, (p.order, blk_row, p.blk_start, p.blk_end),
                   ids[chunk], topk_weights[chunk], out[chunk], c,
                   None if add is None else add[chunk])  # fmt: skip
