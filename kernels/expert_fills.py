"""The in-graph cache fill (policy `gpu-fill`, engine/experts/device_fills.py): a MoE layer
plans its own fills on the device and copies the missing experts from the pinned pool into
victim slots, so a decode step needs no host decision. Triton on CUDA tensors
(kernels/triton/expert_fills.py), the plain-torch twin otherwise (kernels/reference_fills.py,
which documents the state tensors and the plan's rule).

Shapes: ids [P] (a layer's [T, K] routing, flattened), slot_of [N] int32, lid_of [S] int32,
stamp [S] int64, state [STATE] int64, moves [M >= P, 2] int64; banks [N, 2I, H] / [N, H, I]
(the pool: pinned host memory on CUDA) and [S, 2I, H] / [S, H, I] (the slots, any row stride).
The CPU's share (the plan's CpuPost; the MoE sum's CpuAnswer): kernels/cpu/worker.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freetoken_agent.kernels import reference_fills as reference
from freetoken_agent.kernels.dispatch import use_triton
from freetoken_agent.kernels.reference_fills import CpuPost, SplitTables

# The copy kernel's grid (its programs walk the moves' chunks) where no calibration chose one:
# the zero-copy probe read pinned memory at 51 GB/s from 16 programs on the H200 host; hosts
# differ (one H100 host's SM-issued reads ran ~37 GB/s), so `freetoken calibrate` times the
# kernel at COPY_PROGRAM_CHOICES and keeps the fastest (engine/experts/calibration.py).
COPY_PROGRAMS = 32
COPY_PROGRAM_CHOICES = (8, 16, 24, 32, 48, 64, 96, 128)
COPY_PROGRAMS_MAX = 1024  # the most a calibration entry or EngineConfig.copy_programs may ask


def plan_fills(
    ids: Tensor,
    base: int,
    slot_of: Tensor,
    lid_of: Tensor,
    stamp: Tensor,
    state: Tensor,
    moves: Tensor,
    live_pairs: int | None = None,
    post: CpuPost | None = None,
    *,
    uses: Tensor | None = None,
    through: bool = False,
    split: SplitTables | None = None,
    force_triton: bool = False,
) -> Tensor:
    """One MoE layer's plan (reference_fills.plan_fills); returns the rows [P] int64 that
    `fused_moe` reads with host banks. `live_pairs` None: state[LIVE_PAIRS] (captured graphs,
    whose padded rows must not fill). `post`: the CPU takes state[CPU_SHARE] of the misses,
    posted to its mailbox (`copy_fills` collects the answer). `uses` [N] int32: one more for
    each distinct lid the layer routes to. `through` (fill-through): a moved lid keeps its
    host id in the rows; `fused_moe(fill_slot_of=slot_of)` stores it into its slot as it reads
    it, and no `copy_fills` follows. `split` (with `post`, not `through`): the split expert
    at state[SPLIT_COLS] (reference_fills' docstring)."""
    p = ids.numel()
    if moves.shape[0] < p:
        raise ValueError(f"moves holds {moves.shape[0]} fills, the layer has {p} pairs")
    if stamp.shape != lid_of.shape:
        raise ValueError(f"stamp {tuple(stamp.shape)} and lid_of {tuple(lid_of.shape)} differ")
    if post is not None:
        t = post.hidden.shape[0]
        if t > post.box.max_tokens or p != t * post.box.top_k:
            raise ValueError(
                f"{t} tokens, {p} pairs: the mailbox holds {post.box.max_tokens} tokens of "
                f"{post.box.top_k} pairs"
            )
        if not post.hidden.is_contiguous() or post.weights.numel() != p:
            raise ValueError("post needs contiguous hidden [T, H] and weights [T, K]")
    if uses is not None and (uses.dtype != torch.int32 or uses.shape != slot_of.shape):
        raise ValueError(f"uses must be int32 {tuple(slot_of.shape)}, like slot_of")
    if split is not None:
        _check_split(split, lid_of, post, through)
    args = (base, slot_of, lid_of, stamp, state, moves, live_pairs, post, uses, through, split)
    if not use_triton(ids, force_triton, "plan_fills"):
        return reference.plan_fills(ids, *args)
    from freetoken_agent.kernels.triton import expert_fills as triton_impl

    return triton_impl.plan_fills(ids.reshape(-1), *args)


def _check_split(split: SplitTables, lid_of: Tensor, post: CpuPost | None, through: bool) -> None:
    s = lid_of.shape[0]
    if post is None or through:
        raise ValueError("a split plan posts the CPU's columns: it needs `post`, not `through`")
    if split.cols.shape != (s,) or split.cols.dtype != torch.int32:
        raise ValueError(f"split.cols must be [S={s}] int32, got {tuple(split.cols.shape)} "
                         f"{split.cols.dtype}")  # fmt: skip
    if split.landed.shape != (s,) or split.landed.dtype != torch.int64:
        raise ValueError(f"split.landed must be [S={s}] int64, got "
                         f"{tuple(split.landed.shape)} {split.landed.dtype}")  # fmt: skip


def copy_fills(
    state: Tensor,
    moves: Tensor,
    src_w13: Tensor,
    src_w2: Tensor,
    dst_w13: Tensor,
    dst_w2: Tensor,
    *,
    split: bool = False,
    programs: int = COPY_PROGRAMS,
    force_triton: bool = False,
) -> None:
    """The last plan's moves, dst[slot] = src[lid] in both banks (rows dense inside); `split`
    (after a split plan): the moves' columns [0, state[SPLIT_COLS]) only. The CPU's answer to a
    plan's post is collected by the MoE sum over k (`fused_moe(collect=CpuAnswer(...))`).
    `programs`: the Triton kernel's grid (the twin copies row by row whatever it is)."""
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be a positive integer, got {programs!r}")
    if src_w13.shape[1:] != dst_w13.shape[1:] or src_w2.shape[1:] != dst_w2.shape[1:]:
        raise ValueError("pool and slot rows differ in shape")
    if not all(t[0].is_contiguous() for t in (src_w13, src_w2, dst_w13, dst_w2)):
        raise ValueError("copy_fills needs rows contiguous inside")
    if not use_triton(dst_w13, force_triton, "copy_fills"):
        reference.copy_fills(state, moves, src_w13, src_w2, dst_w13, dst_w2, split)
        return
    from freetoken_agent.kernels.triton import expert_fills as triton_impl

    triton_impl.copy_fills(state, moves, src_w13, src_w2, dst_w13, dst_w2, split, programs)
