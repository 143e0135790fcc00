"""Fused recurrent gated delta rule in Triton: decode and (token-looped) prefill in one kernel.

Grid (B, Hv, cdiv(Dv, BV)): a program owns one sequence, one value head and BV columns of the
[Dk, Dv] state. It loads its [Dk, BV] fp32 tile from `state[state_slots[b]]` into registers,
walks the sequence's tokens (L2-normalising q and k and scaling q in-kernel), stores the tile
after token t into `snap_out[snap_slots[t]]` when that is >= 0, and writes the final tile back.
The columns of S are independent under the delta rule (k^T S, k delta^T and q^T S act column by
column), so the Dv split needs no communication; each program recomputes the norms of q and k,
Dk values per token, which is noise beside its Dk x BV state updates.

One launch serves the whole packed batch; the grid depends only on shapes and the kernel reads
bounds from `cu_seqlens` on the device, so the decode call (one token per sequence) is CUDA-graph
capturable. Rows that share a state slot (the scratch row 0 of padded graph rows) race; their
state is garbage by contract.

Cost: decode moves the state once (read + write, 2 * Hv * Dk * Dv * 4 bytes per sequence: 4 MB at
Hv 32, Dk = Dv = 128), which is the floor for any form. Prefill walks the tokens one after another:
each token is a chain of dependent vector steps (decay, a Dk reduction, update, a Dk reduction)
of roughly a microsecond, so a 4096-token sequence costs on the order of milliseconds per layer
whatever the GPU's width, and B * Hv * Dv / BV programs cannot fill an H200 for one sequence.
A chunked (WY/UT) kernel on tensor cores would do prefill in a fraction of that; it is the next
step (see `kernels/reference_delta.py` for the form). The next token's inputs are loaded before
the current token's math so their memory latency hides behind it.
"""

# T tokens (packed over B sequences), Hk / Hv key / value heads, Dk / Dv head dims, N state
# slots, Cn checkpoint rows, BV state columns per program

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Tiles keyed by device class, then "decode" (one token per sequence) or "prefill". Starting
# points: BV 16 gives Hv * Dv / 16 = 256 programs per sequence at Hv 32, Dv 128 (two per H200
# SM) with a 128 x 16 fp32 tile (16 registers per thread at 4 warps). bench/gated_delta_kernel.py
# sweeps the alternatives on the device; put a measured winner under a device key.
TILES: dict[str, dict[str, dict[str, int]]] = {
    "default": {
        "decode": dict(BV=16, num_warps=4),
        "prefill": dict(BV=16, num_warps=4),
    },
}


def tiles_for(decode: bool, override: dict | None = None) -> dict[str, int]:
    return {**TILES["default"]["decode" if decode else "prefill"], **(override or {})}


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, hk, h, offs_k, offs_v, mask_v,
                sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, ACC: tl.constexpr):  # fmt: skip
    q = tl.load(q_ptr + t * sq_t + hk * sq_h + offs_k).to(ACC)
    k = tl.load(k_ptr + t * sk_t + hk * sk_h + offs_k).to(ACC)
    v = tl.load(v_ptr + t * sv_t + h * sv_h + offs_v, mask=mask_v, other=0.0).to(ACC)
    g = tl.load(g_ptr + t * sg_t + h).to(ACC)
    beta = tl.load(beta_ptr + t * sb_t + h).to(ACC)
    return q, k, v, g, beta


@triton.jit
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,  # [T, Hk, Dk] x2, [T, Hv, Dv], [T, Hv] x2, out
    state_ptr, slots_ptr, cu_ptr, snap_slots_ptr, snap_ptr,
    scale, eps, last,  # last = T - 1
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h,
    ss_n, ss_h, sn_n, sn_h,  # state / snapshot strides of rows and heads ([Dk, Dv] contiguous)
    DV,
    GROUP: tl.constexpr,  # Hv // Hk
    DK: tl.constexpr,
    BV: tl.constexpr,
    HAS_SNAP: tl.constexpr,
    ACC: tl.constexpr,  # math dtype: fp32 (fp64 for fp64 inputs)
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    bos = tl.load(cu_ptr + b).to(tl.int64)  # int64: t * stride must not wrap
    eos = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_v = offs_v < DV
    tile = offs_k[:, None] * DV + offs_v[None, :]  # [DK, BV] offsets inside one head's state
    s_ptrs = state_ptr + slot * ss_n + h * ss_h + tile
    s = tl.load(s_ptrs, mask=mask_v[None, :], other=0.0).to(ACC)  # [DK, BV]

    # Token loads clamp to the batch's last token: the prefetch past a sequence's end (or the
    # first load of an empty one) reads a real token it never uses, with no mask arithmetic.
    q, k, v, g, beta = _load_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tl.minimum(bos, last),
                                   hk, h, offs_k, offs_v, mask_v,
                                   sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, ACC)  # fmt: skip
    for t in range(bos, eos):
        # prefetch token t + 1 before the dependent math of token t
        nxt = tl.minimum(t + 1, last)
        qn, kn, vn, gn, bn = _load_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, nxt, hk, h, offs_k,
                                         offs_v, mask_v, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t,
                                         sb_t, ACC)  # fmt: skip
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + eps))  # l2norm then scale, as the models
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        s = s * tl.exp(g)
        kv = tl.sum(s * k[:, None], axis=0)  # [BV] what the state predicts for k
        delta = (v - kv) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)  # [BV]
        tl.store(out_ptr + t * so_t + h * so_h + offs_v, o.to(out_ptr.dtype.element_ty),
                 mask=mask_v)  # fmt: skip
        if HAS_SNAP:
            row = tl.load(snap_slots_ptr + t)
            if row >= 0:
                snap_ptrs = snap_ptr + row * sn_n + h * sn_h + tile
                tl.store(snap_ptrs, s.to(snap_ptr.dtype.element_ty), mask=mask_v[None, :])
        q, k, v, g, beta = qn, kn, vn, gn, bn
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask_v[None, :])


def _rows_inner(x: Tensor) -> Tensor:
    """The kernel takes any token / head strides but needs the last dim contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


def gated_delta_rule(
    q: Tensor,  # [T, Hk, Dk]
    k: Tensor,  # [T, Hk, Dk]
    v: Tensor,  # [T, Hv, Dv]
    g: Tensor,  # [T, Hv] fp32
    beta: Tensor,  # [T, Hv] fp32
    state: Tensor,  # [N, Hv, Dk, Dv] fp32, updated in place
    state_slots: Tensor,  # [B] int64
    cu_seqlens: Tensor,  # [B + 1] int32
    scale: float,
    snap_slots: Tensor | None = None,  # [T] int64
    snap_out: Tensor | None = None,  # [Cn, Hv, Dk, Dv] fp32
    decode: bool = False,  # picks the tile class only
    tiles: dict | None = None,  # overrides of the tile table (tests, sweeps)
) -> Tensor:
    """Launch the kernel (arguments checked by `kernels.gated_delta`). Returns [T, Hv, Dv]."""
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    assert dk & (dk - 1) == 0 and dk <= 256, (
        f"Triton gated delta rule: Dk={dk} must be a power of two <= 256 (the state tile is "
        "[Dk, BV] in registers)"
    )
    assert state.stride(-1) == 1 and state.stride(-2) == dv, "state: [Dk, Dv] must be contiguous"
    q, k, v, g, beta = (_rows_inner(x) for x in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # [T, Hv, Dv]
    B = state_slots.shape[0]
    if T == 0 or B == 0:
        return out
    has_snap = snap_slots is not None
    if has_snap:
        assert snap_out.stride(-1) == 1 and snap_out.stride(-2) == dv, "snap_out: [Dk, Dv] layout"
    else:  # any pointer will do: the kernel never reads them
        snap_slots, snap_out = state_slots, state
    acc = tl.float64 if torch.float64 in (v.dtype, state.dtype) else tl.float32
    c = tiles_for(decode, tiles)
    grid = (B, hv, triton.cdiv(dv, c["BV"]))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, out, state, state_slots, cu_seqlens, snap_slots, snap_out,
        scale, 1e-6, T - 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), snap_out.stride(0), snap_out.stride(1),
        dv, GROUP=hv // hk, DK=dk, BV=c["BV"], HAS_SNAP=has_snap, ACC=acc,
        num_warps=c["num_warps"],
    )  # fmt: skip
    return out
