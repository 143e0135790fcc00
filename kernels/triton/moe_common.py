"""Shared pieces of the Triton fused-MoE paths: tile tables, checks and the sum over k.

The decode path (`moe_decode.py`) and the prefill path (`moe_prefill.py`) both pick their tiles
here, validate their inputs with `_check`, and end with `_sum_over_k_kernel`. The overview of
both paths, the shape legend and the determinism argument are in `fused_moe.py`'s docstring.
"""

import torch
import triton
import triton.language as tl

from freetoken_agent.kernels.fused_moe import PREFILL_CHUNK_PAIRS
from freetoken_agent.kernels.reference import check_host_banks, check_moe_shapes
from freetoken_agent.kernels.triton.cpu_answer import posted, wait_answer
from freetoken_agent.kernels.triton.pdl import enter

# fmt: off
# Tiles keyed by (H, I); "default" covers other shapes. First guesses for the H200;
# `python -m freetoken_agent.bench.moe_kernel` sweeps alternatives to tune them.
DECODE_TILES: dict[tuple[int, int] | str, dict[str, int]] = {
    # gate/up: BLOCK_M members x BLOCK_I outputs, H walked in BLOCK_H steps (tl.dot needs every
    # dim >= 16); down: BLOCK_M members x BLOCK_N outputs, I walked in BLOCK_K steps. Small output
    # blocks give T=1, K=8 enough programs (384 and 512) to keep 132 SMs streaming; compiled for
    # sm_90 these use no local memory and keep 3-4 programs x 3 weight tiles in flight per SM.
    "default": dict(
        BLOCK_M=16, BLOCK_I=16, BLOCK_H=256, WARPS_UP=4, STAGES_UP=4,
        BLOCK_N=32, BLOCK_K=128, WARPS_DOWN=4, STAGES_DOWN=4, SUM_BLOCK=512,
    ),
    # Measured on an H200 (bench/moe_kernel.py sweep, graph-replayed, 8 layers' rows): against
    # the default, H=2048 I=768 decodes T=1 in 29.6 vs 32.9 us/layer (60% vs 54% of copy
    # bandwidth) and T=4 in 86.7 vs 97.4; H=2048 I=512: 24.3 vs 26.1 and 65.5 vs 76.3.
    # Down's tiles from the twenty-second session's `--wide` sweep (one kernel changed at a
    # time): BLOCK_N=128 BLOCK_K=64 with 4 warps took T=4 from 87.4 to 79.5 us/layer (I=768)
    # and 65.9 to 58.9 (I=512), T=1 from 29.8 to 29.2 and 24.6 to 23.9; gate/up's candidates
    # were all within 1% at T=1 or slower.
    (2048, 768): dict(
        BLOCK_M=16, BLOCK_I=32, BLOCK_H=128, WARPS_UP=4, STAGES_UP=3,
        BLOCK_N=128, BLOCK_K=64, WARPS_DOWN=4, STAGES_DOWN=4, SUM_BLOCK=512,
    ),
    (2048, 512): dict(
        BLOCK_M=16, BLOCK_I=32, BLOCK_H=128, WARPS_UP=4, STAGES_UP=3,
        BLOCK_N=128, BLOCK_K=64, WARPS_DOWN=4, STAGES_DOWN=4, SUM_BLOCK=512,
    ),
}
PREFILL_TILES: dict[tuple[int, int] | str, dict[str, int]] = {
    # CHUNK_PAIRS: pairs per launch (the dispatcher passes its max_pairs; the default is its
    # PREFILL_CHUNK_PAIRS).
    "default": dict(
        BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, WARPS_UP=8, STAGES_UP=3,
        DOWN_BLOCK_N=128, DOWN_BLOCK_K=64, WARPS_DOWN=4, STAGES_DOWN=4,
        SUM_BLOCK=512, CHUNK_PAIRS=PREFILL_CHUNK_PAIRS,
    ),
}
# fmt: on
# The decode kernels hold all P ids and a [BLOCK_M, P] member selection in every program; past
# 128 pairs that spills registers on sm_90 (and sorting by row pays off anyway).
DECODE_MAX_PAIRS = 128


def _tiles(table: dict, h: int, i: int, override: dict | None) -> dict[str, int]:
    return {**table.get((h, i), table["default"]), **(override or {})}


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would default to TF32 on tensor cores (10-bit mantissa); keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _sum_over_k_kernel(
    y_ptr,  # [P, H] fp32
    ids_ptr,  # [P]
    wts_ptr,  # [P] fp32
    out_ptr,  # [T, H]
    add_ptr,  # [T, H] (ADD): added before the rounding, then zeroed
    state_ptr,  # [STATE] int64 (COLLECT): the fill plan's state (reference_fills.py)
    ctrl_ptr,  # [CTRL] int64 (COLLECT): the CPU worker's mailbox (kernels/cpu/worker.py)
    answer_ptr,  # [T_max, H] fp32 (COLLECT): the mailbox's answer
    timeout,  # (COLLECT) the wait's bound (cpu_answer.timeout_ticks)
    H,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    HOST: tl.constexpr,
    ADD: tl.constexpr,
    COLLECT: tl.constexpr,
    SYS: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)  # first: pdl.py
    # A separate pass because the pairs of one token live in different row groups; summing here
    # in k order keeps the result deterministic without atomics.
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(K):
        p = t * K + k
        pair_id = tl.load(ids_ptr + p)
        if HOST:  # noqa: SIM108 - compile-time; a skipped pair's y was never written
            live = pair_id != -1
        else:
            live = pair_id >= 0
        wt = tl.where(live, tl.load(wts_ptr + p), 0.0)
        y_mask = offs < tl.where(live, H, 0)
        acc += wt * tl.load(y_ptr + p * H + offs, mask=y_mask, other=0.0)
    if ADD:  # the part summed elsewhere (the CPU branch), consumed: zeros for the next use
        acc += tl.load(add_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(add_ptr + t * H + offs, tl.zeros((BLOCK,), dtype=add_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    if COLLECT:  # noqa: SIM102 - the CPU worker's answer to the layer's post, if it posted
        if posted(state_ptr):  # noqa: SIM102 - a plain `and` would wait with no post (Triton)
            if wait_answer(state_ptr, ctrl_ptr, timeout, SYS):
                acc += tl.load(answer_ptr + t * H + offs, mask=mask, other=0.0, volatile=True)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(hidden, w13, w2, topk_ids, topk_weights, out) -> tuple[int, int, int, int]:
    t, h, i, k = check_moe_shapes(hidden, w13, w2, topk_ids, topk_weights, out)
    tensors = [hidden, topk_ids, topk_weights] + ([out] if out is not None else [])
    assert all(x.is_contiguous() for x in tensors), "fused_moe needs contiguous tensors"
    # Bank rows may sit at any stride (arena slots interleave w13 and w2 rows, engine/arena.py);
    # each row's [2I, H] / [H, I] block must be dense, which is what the kernels index.
    assert w13.stride()[1:] == (h, 1) and w2.stride()[1:] == (i, 1), (
        f"fused_moe needs dense rows: w13 strides {w13.stride()}, w2 strides {w2.stride()}"
    )
    n = w13.shape[0]
    assert n <= 1 or (w13.stride(0) >= 2 * i * h and w2.stride(0) >= h * i), "bank rows overlap"
    tensors += [w13, w2]
    assert all(x.device == hidden.device for x in tensors), "fused_moe tensors on one device"
    assert hidden.numel() < 2**31, "token offsets are int32"
    return t, h, i, k


def _check_host(hidden, w13, host_w13, host_w2) -> None:
    check_host_banks(w13, host_w13, host_w2)
    h, i = host_w13.shape[2], host_w13.shape[1] // 2
    assert host_w13.stride()[1:] == (h, 1) and host_w2.stride()[1:] == (i, 1), (
        "fused_moe needs dense host bank rows"
    )
    for bank in (host_w13, host_w2):  # the kernels reach pinned memory through its mapping
        assert bank.device == hidden.device or (bank.device.type == "cpu" and bank.is_pinned()), (
            f"host banks must be pinned host memory (or on {hidden.device}), got {bank.device}"
        )
