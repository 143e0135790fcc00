"""A decode step's MoE router in one launch: the router's linear layer, then softmax, top-k,
renormalise and round (kernels/triton/router.py's row code).

Why: at decode the router is two small launches a layer, a cuBLAS GEMV of [T, H] x [E, H]
(0.5 MB at Qwen3-30B-A3B's shape: 4.9 us on the H200, latency, not bandwidth) and the top-k
kernel; a 48-layer step spends ~0.3 ms on them (bench/results/NOTES.md, twelfth session).
Here E / BLOCK_E programs each compute BLOCK_E logits of every token, rounded to the model
dtype as F.linear's output is, into a scratch row; the last program to finish (an atomic
counter, acquire-release at GPU scope, as kernels/triton/sampling.py draws) reads all E logits
of each token and picks its experts, then puts the counter back to 0 for the next launch.

Numerics: the logits are fp32 sums in another order than cuBLAS's, rounded to the model dtype,
so a logit can land one ulp of that dtype away from F.linear's; the top k then follow from
those logits exactly as softmax_topk's do. Prefill chunks keep F.linear + softmax_topk.

Shape legend: T tokens (<= MAX_TOKENS), H hidden, E experts (E_PAD padded to a power of two),
K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.router import ROUTE_MAX_TOKENS as MAX_TOKENS
from freetoken_agent.kernels.triton.norm import round_mode, round_to
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch
from freetoken_agent.kernels.triton.router import MAX_EXPERTS, MAX_TOP_K, _topk_row

# Default tiles (`bench gemv` times others). One warp a program: the last program's k argmax
# rounds then reduce with shuffles alone (router.py). One expert's whole row a program (128
# programs at E = 128, one 4 KB load each at H = 2048): on the H200 host, one row, 5.54 us
# against 6.52 for two experts in 1024-wide steps and 7.34 / 10.34 for the other candidates
# (bench/results/gemv_router_s21.json: these tiles were its row `route2`).
TILES = dict(BLOCK_E=1, BLOCK_H=2048, WARPS=1)


@triton.jit
def _route_kernel(
    x_ptr, w_ptr, logits_ptr, done_ptr, ids_ptr, wt_ptr, T, E, H, stride_x, stride_w,
    K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
    MODE: tl.constexpr, LOGIT_MODE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # first: pdl.py
    pid = tl.program_id(0)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    for t in range(T):
        acc = tl.zeros([BLOCK_E], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h_ok = h0 + offs_h < H
            x = tl.load(x_ptr + t * stride_x + h0 + offs_h, mask=h_ok, other=0.0)
            w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_w + h0 + offs_h[None, :],
                        mask=e_ok[:, None] & h_ok[None, :], other=0.0)  # fmt: skip
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        # F.linear's output is in the model dtype: the same rounding before the softmax
        # (round_to's bf16 rounding is integer arithmetic: compiled code folded a bf16 round
        # trip away on the H200, and the interpreter truncates; kernels/triton/norm.py).
        tl.store(logits_ptr + t * E_PAD + offs_e, round_to(acc, LOGIT_MODE), mask=e_ok)
    # The stores above are ordered before the add (release); the last program's loads after it
    # (acquire) see every program's logits.
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(done_ptr, 0)
        for t in range(T):
            _topk_row(logits_ptr + t * E_PAD, ids_ptr + t * K, wt_ptr + t * K, E, K, E_PAD,
                      K_PAD, RENORM, MODE)  # fmt: skip


def new_scratch(device: torch.device) -> tuple[Tensor, Tensor]:
    """A launch's scratch: the logits [MAX_TOKENS * MAX_EXPERTS] fp32 and the counter (0
    between launches). Full size at once: a captured graph keeps their addresses. Each router
    keeps its own (engine/layers/moe.py), so routers of engines on other streams never share
    one; launches on one stream may (the tests' default)."""
    logits = torch.zeros(MAX_TOKENS * MAX_EXPERTS, dtype=torch.float32, device=device)
    return logits, torch.zeros(1, dtype=torch.int32, device=device)


_shared: dict[torch.device, tuple[Tensor, Tensor]] = {}  # per device: calls without scratch


def _buffers(device: torch.device) -> tuple[Tensor, Tensor]:
    if device not in _shared:
        _shared[device] = new_scratch(device)
    return _shared[device]


def route(
    x: Tensor,
    weight: Tensor,
    k: int,
    renormalize: bool,
    round_to: torch.dtype | None = None,
    tiles: dict[str, int] | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(ids [T, K] int32, weights [T, K] fp32) of x [T, H] routed by weight [E, H]: the same
    contract as F.linear followed by softmax_topk, in one launch; no host synchronisation.
    T <= MAX_TOKENS, E <= 512, k <= 16; x and weight of one dtype, rows contiguous. `tiles`:
    TILES' keys, any of them (bench gemv's sweep); `scratch`: new_scratch's, else the
    device's shared one."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        tuple(x.shape), tuple(weight.shape))  # fmt: skip
    T, H = x.shape
    E = weight.shape[0]
    assert T <= MAX_TOKENS and 0 < k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS, (T, E, k)
    assert x.dtype == weight.dtype and x.stride(1) == 1 and weight.stride(1) == 1
    mode = 0 if round_to is None else round_mode(round_to)
    ids = torch.empty((T, k), dtype=torch.int32, device=x.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, weights
    logits, done = scratch if scratch is not None else _buffers(x.device)
    e_pad = triton.next_power_of_2(E)
    t = {**TILES, **(tiles or {})}
    _route_kernel[(triton.cdiv(E, t["BLOCK_E"]),)](
        x, weight, logits, done, ids, weights, T, E, H, x.stride(0), weight.stride(0),
        K=k, E_PAD=e_pad, K_PAD=triton.next_power_of_2(k), RENORM=renormalize, MODE=mode,
        LOGIT_MODE=round_mode(x.dtype), BLOCK_E=t["BLOCK_E"], BLOCK_H=t["BLOCK_H"],
        num_warps=t["WARPS"],
        **pdl_launch(x.device),
    )  # fmt: skip
    return ids, weights


def scratch_logits(device: torch.device, T: int, E: int) -> Tensor:
    """The rounded logits the last `route` on `device` without a scratch of its own computed:
    [T, E] (tests)."""
    logits, _ = _buffers(device)
    return logits[: T * triton.next_power_of_2(E)].view(T, -1)[:, :E]
