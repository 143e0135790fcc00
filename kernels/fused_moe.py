"""Fused MoE dispatcher: the Triton kernels on CUDA tensors, the plain-torch twin otherwise.

Shapes (legend in `kernels/reference_moe.py`): hidden [T, H], w13 [N, 2I, H], w2 [N, H, I],
topk_ids [T, K] (negative = skip), topk_weights [T, K] fp32, out [T, H].
"""

import torch

from freetoken_agent.kernels import reference_fills
from freetoken_agent.kernels.dispatch import use_triton
from freetoken_agent.kernels.reference import fused_moe as fused_moe_reference
from freetoken_agent.kernels.reference_fills import CpuAnswer

# Which Triton path serves a call, by its number of (token, choice) pairs P = T * K.
# Up to this many pairs the weight bytes dominate: the decode path (one program per pair and
# output block, pairs sharing a row computed by the first of them) streams them with no sorting
# launches; its in-kernel grouping holds all P ids per program, which spills registers past 128.
# Beyond that, rows picked by many tokens make tiles over pairs sorted by row (prefill) win.
# Decode batches of up to 16 sequences at K = 8 stay on one path, so a sequence's bits do not
# change as such a batch grows or shrinks.
PATH_LIMITS: dict[str, int] = {"decode_max_pairs": 128}
# The prefill path runs a long batch in token chunks of at most this many pairs: its buffers
# (act [P, I] and fp32 y [P, H], about 600 MB at 65536 pairs, H=2048, I=768) are bounded by it,
# and each chunk reads its rows' weights again. A caller whose prefill is bound by something
# else (a streamed layer waits on the link) passes a smaller `max_pairs`.
PREFILL_CHUNK_PAIRS = 65536


def prefill_workspace_bytes(
    tokens: int, top_k: int, hidden: int, width: int, itemsize: int, max_pairs: int
) -> int:
    """Device bytes the prefill path's buffers take for `tokens` tokens: per pair act [I] in
    the activation dtype, y [H] in fp32, and the row sort's int64 key and order."""
    pairs = min(tokens * top_k, max_pairs)
    return pairs * (width * itemsize + hidden * 4 + 16)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    host_w13: torch.Tensor | None = None,
    host_w2: torch.Tensor | None = None,
    force_triton: bool = False,
    max_pairs: int | None = None,
    add: torch.Tensor | None = None,
    rows_settled: bool = False,
    fill_slot_of: torch.Tensor | None = None,
    slot_cols: torch.Tensor | None = None,
    collect: CpuAnswer | None = None,
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden[t]).

    host_w13 / host_w2: a second pair of banks in pinned host memory, whose row r an id of
    -r - 2 names (`reference.host_ids`); the kernels read those experts over the link
    themselves. Decode batches only (up to PATH_LIMITS["decode_max_pairs"] pairs).
    force_triton runs CPU tensors through the Triton kernels (needs TRITON_INTERPRET=1 set before
    triton is imported); it is for tests.
    max_pairs: the prefill path's chunk ((token, expert) pairs per launch; None:
    PREFILL_CHUNK_PAIRS); the results do not depend on it, its workspace does
    (`prefill_workspace_bytes`).
    add [T, H]: a part of the sum computed elsewhere, added before the result's rounding and
    then zeroed (`reference.check_add`), in the summing kernel of either path.
    out [T, H] in hidden's dtype, or in fp32 (float64 for float64 hidden): then the sum is not
    rounded, and a later call can take it as `add`, so launches over parts of the experts sum
    in fp32 and round once (kernels/moe_parts.py). `out` is never `add` itself: the summing
    kernel zeroes `add` before it stores `out`.
    rows_settled: topk_ids were written two or more kernels before this call (the in-graph fill
    plan's rows): the decode path may prefetch their weights early (kernels/triton/pdl.py).
    fill_slot_of [Nh] int32 (fill-through, with host banks): what the kernels read of host row
    r they also store into slot fill_slot_of[r] of w13 / w2 where that is >= 0, so a miss
    crosses the link once, into the slot that keeps it, with no copy kernel before.
    slot_cols [N] int32 (the split expert's device half): bank row r holds only columns
    [0, slot_cols[r]) of the expert width and computes those (`reference.fused_moe`); decode
    batches only.
    collect (decode batches, not with `add`): the CPU worker's answer to the last fill plan's
    post, waited for by the summing kernel after the other kernels and added as `add` would be
    (kernels/triton/cpu_answer.py; the twin: `reference_fills.wait_cpu`, then `add`).
    """
    host = dict(host_w13=host_w13, host_w2=host_w2) if host_w13 is not None else {}
    if fill_slot_of is not None:
        if not host:
            raise ValueError("fill_slot_of needs host banks (host_w13, host_w2)")
        host["fill_slot_of"] = fill_slot_of
    # Host banks, partly filled slots and the CPU worker's answer are the decode path's only.
    extra = {**host, "slot_cols": slot_cols} if slot_cols is not None else host
    given = {"host banks": bool(host), "slot_cols (partly filled slots)": slot_cols is not None,
             "the CPU worker's answers (collect)": collect is not None}  # fmt: skip
    decode_only = [name for name, on in given.items() if on]
    pairs = topk_ids.shape[0] * topk_ids.shape[1]
    if decode_only and pairs > PATH_LIMITS["decode_max_pairs"]:
        raise ValueError(
            f"{decode_only[0]} serve decode batches of at most "
            f"{PATH_LIMITS['decode_max_pairs']} (token, expert) pairs, got {pairs}"
        )
    if add is not None and out is not None and add.data_ptr() == out.data_ptr():
        raise ValueError("fused_moe's out must not be its add (add is zeroed as it is read)")
    if collect is not None:
        _check_collect(collect, add, hidden)
    if not use_triton(hidden, force_triton, "fused_moe"):
        if collect is not None:  # the answer into a fresh `add` (zero when none came)
            add = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            reference_fills.wait_cpu(collect.state, collect.box, add, collect.timeout_s,
                                     behind=collect.behind)  # fmt: skip
        return fused_moe_reference(hidden, w13, w2, topk_ids, topk_weights, out, **extra, add=add)
    # Imported here so the CPU fallback works on machines without triton (CPU builds of torch).
    from freetoken_agent.kernels.triton.fused_moe import fused_moe_decode, fused_moe_prefill

    if pairs <= PATH_LIMITS["decode_max_pairs"]:
        return fused_moe_decode(hidden, w13, w2, topk_ids, topk_weights, out, **extra, add=add,
                                rows_settled=rows_settled, collect=collect)  # fmt: skip
    chunk = {"CHUNK_PAIRS": max_pairs or PREFILL_CHUNK_PAIRS}
    return fused_moe_prefill(hidden, w13, w2, topk_ids, topk_weights, out, tiles=chunk, add=add)


def _check_collect(collect: CpuAnswer, add: torch.Tensor | None, hidden: torch.Tensor) -> None:
    if add is not None:
        raise ValueError("collect adds the CPU worker's answer: pass it or add, not both")
    t, h = hidden.shape
    if t > collect.box.max_tokens or collect.box.hidden.shape[1] != h:
        raise ValueError(f"collect's mailbox answers {collect.box.max_tokens} tokens of "
                         f"{collect.box.hidden.shape[1]}, the layer has {t} of {h}")  # fmt: skip
