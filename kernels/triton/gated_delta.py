"""Gated delta rule in Triton: a fused recurrent kernel (decode, short prefill) and a chunked
two-kernel form (prefill).

Recurrent, grid (B, Hv, cdiv(Dv, BV)): a program owns one sequence, one value head and BV columns
of the [Dk, Dv] state. It loads its [Dk, BV] fp32 tile from `state[state_slots[b]]` into
registers, walks the sequence's tokens (L2-normalising q and k and scaling q in-kernel), stores
the tile after token t into `snap_out[snap_slots[t]]` when that is >= 0, and writes the final
tile back. The columns of S are independent under the delta rule (k^T S, k delta^T and q^T S act
column by column), so the Dv split needs no communication; each program recomputes the norms of
q and k, Dk values per token, which is noise beside its Dk x BV state updates. One launch serves
the whole packed batch; the grid depends only on shapes and the kernel reads bounds from
`cu_seqlens` on the device, so the decode call (one token per sequence) is CUDA-graph
capturable. Rows that share a state slot (the scratch row 0 of padded graph rows) race; their
state is garbage by contract.

Cost of the recurrent form: decode moves the state once (read + write, 2 * Hv * Dk * Dv * 4
bytes per sequence: 4 MiB at Hv 32, Dk = Dv = 128), the floor for any form. Prefill walks the
tokens one after another: each token is a chain of dependent vector steps (decay, a Dk
reduction, update, a Dk reduction) of roughly a microsecond, so a 4096-token sequence costs
milliseconds per layer whatever the GPU's width, and B * Hv * Dv / BV programs cannot fill an
H200 for one sequence. The next token's inputs are loaded before the current token's math so
their memory latency hides behind it.

The chunked form (prefill, see its section below and `kernels/reference_delta.py` for the
math) replaces CHUNK dependent token steps by a handful of CHUNK-row matmuls per chunk; it needs
the host bounds (seq_bounds), so it never runs in a captured decode graph.
"""

# T tokens (packed over B sequences), Hk / Hv key / value heads, Dk / Dv head dims, N state
# slots, Cn checkpoint rows, BV state columns per program

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

# Tiles keyed by device class, then "decode" (one token per sequence) or "prefill". Starting
# points: BV 16 gives Hv * Dv / 16 = 256 programs per sequence at Hv 32, Dv 128 (two per H200
# SM) with a 128 x 16 fp32 tile (16 registers per thread at 4 warps). bench/gated_delta_kernel.py
# sweeps the alternatives on the device; put a measured winner under a device key.
TILES: dict[str, dict[str, dict]] = {
    "default": {
        "decode": dict(BV=16, num_warps=4),
        "prefill": dict(BV=16, num_warps=4),
        # The chunked prefill: used once a sequence of the call has min_tokens; tf32x3 keeps the
        # matmuls at about fp32 accuracy on tensor cores (plain tf32 loses ~3 digits).
        # num_stages 1: the default software pipelining (3 stages on Hopper) multiplies the
        # shared memory of the chunk loop's tiles past the H200's 227 KB.
        "chunk": dict(
            BV=32, num_warps=4, solve_warps=4, num_stages=1, min_tokens=64, precision="tf32x3"
        ),
    },
}
CHUNK = 64  # tokens per chunk of the chunked form (as transformers and FLA)
# (device, Dk) pairs whose shared memory cannot hold the chunked kernels' tiles (about 200 KB at
# Dk = 128, 360 KB at 256: Hopper-class GPUs have 227 KB, consumer GPUs ~100 KB): those prefill
# with the recurrent kernel. Found at the first launch, which Triton refuses before it runs.
_NO_CHUNK: set[tuple[torch.device, int]] = set()


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


# `last` and `NC` change with every batch: specialising on them (divisible by 16, equal to 1)
# would compile a new variant mid-serving, a second of stall on some steps.
@triton.jit(do_not_specialize=["last"])
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


# ---- chunked prefill (WY/UT form, tensor cores) ----------------------------------------------
# Two launches. _chunk_solve_kernel, grid (chunks of all sequences, Hv), fully parallel: the
# chunk's unit lower-triangular system (I + A), A[t, s] = beta_t (k_t . k_s) Gamma_t / Gamma_s for
# s < t, inverted by blocked forward substitution (the stable way: the power series
# sum (-A)^n cancels huge binomial terms when keys are alike). _chunk_scan_kernel, grid
# (B, Hv, cdiv(Dv, BV)), walks each sequence's chunks with the [Dk, BV] state tile in registers:
# per chunk six CHUNK-row matmuls instead of CHUNK dependent token steps. Snapshots inside a
# chunk are rebuilt from the chunk's start state and deltas (one extra matmul per snapshot).


@triton.jit
def _load_rows(ptr, tok, live, head, offs, stride_t, stride_h, mask_cols):
    # [CHUNK, D] rows of one head, zero past the sequence's end, in fp32
    ptrs = ptr + tok[:, None] * stride_t + head * stride_h + offs[None, :]
    return tl.load(ptrs, mask=live[:, None] & mask_cols[None, :], other=0.0).to(tl.float32)


@triton.jit
def _unit_rows(x, eps):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps))[:, None]


@triton.jit(do_not_specialize=["NC"])
def _chunk_solve_kernel(
    k_ptr, g_ptr, beta_ptr, chunks_ptr, tinv_ptr,  # chunks: [2, NC] start and end tokens
    eps, sk_t, sk_h, sg_t, sb_t, st_c, st_h, NC,
    GROUP: tl.constexpr, DK: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(chunks_ptr + c).to(tl.int64)
    end = tl.load(chunks_ptr + NC + c)
    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, DK)
    tok = start + rows
    live = tok < end
    k = _unit_rows(_load_rows(k_ptr, tok, live, h // GROUP, offs_k, sk_t, sk_h, offs_k < DK), eps)
    g = tl.load(g_ptr + tok * sg_t + h, mask=live, other=0.0)
    beta = tl.load(beta_ptr + tok * sb_t + h, mask=live, other=0.0)
    cum = tl.cumsum(g, axis=0)  # [CHUNK] log Gamma_t
    lower = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0))  # no overflow above
    a = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PREC) * decay
    a = tl.where(lower, a, 0.0)  # [CHUNK, CHUNK] strictly lower
    # Forward substitution by blocks of BLOCK rows. Diagonal blocks first, all four at once:
    # x = I - A_bd x, repeated BLOCK - 1 times, recomputes row r from rows j < r of its block;
    # once those are final (after r % BLOCK passes) row r is final too, and its last
    # computation is exactly the substitution formula: no series, no cancellation.
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    same = (rows[:, None] // BLOCK) == (rows[None, :] // BLOCK)
    a_bd = tl.where(same, a, 0.0)
    dinv = eye
    for _ in tl.static_range(BLOCK - 1):
        dinv = eye - tl.dot(a_bd, dinv, input_precision=PREC)
    # Then block rows i = 1, 2, ...: X[i, :i] = -D_ii^-1 sum_{k < i} A[i, k] X[k, :i].
    a_off = tl.where(same, 0.0, a)
    x = dinv
    for i in tl.static_range(1, CHUNK // BLOCK):
        upd = -tl.dot(dinv, tl.dot(a_off, x, input_precision=PREC), input_precision=PREC)
        x = tl.where((rows[:, None] // BLOCK == i) & (rows[None, :] < i * BLOCK), upd, x)
    tl.store(tinv_ptr + c * st_c + h * st_h + rows[:, None] * CHUNK + rows[None, :], x)


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr, cu_ptr, snap_slots_ptr,
    snap_ptr, tinv_ptr, first_ptr,  # first: [B] index of each sequence's first chunk
    scale, eps,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h, ss_n, ss_h, sn_n, sn_h, st_c, st_h,
    DV,
    GROUP: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    HAS_SNAP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    bos = tl.load(cu_ptr + b).to(tl.int64)
    eos = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    first = tl.load(first_ptr + b).to(tl.int64)
    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_v = offs_v < DV
    all_k = offs_k < DK
    tile = offs_k[:, None] * DV + offs_v[None, :]  # [DK, BV]
    s_ptrs = state_ptr + slot * ss_n + h * ss_h + tile
    s = tl.load(s_ptrs, mask=mask_v[None, :], other=0.0)  # [DK, BV] fp32
    incl = rows[:, None] >= rows[None, :]
    for cs in range(bos, eos, CHUNK):
        tok = cs + rows
        live = tok < eos
        q = _unit_rows(_load_rows(q_ptr, tok, live, hk, offs_k, sq_t, sq_h, all_k), eps) * scale
        k = _unit_rows(_load_rows(k_ptr, tok, live, hk, offs_k, sk_t, sk_h, all_k), eps)
        v = _load_rows(v_ptr, tok, live, h, offs_v, sv_t, sv_h, mask_v)  # [CHUNK, BV]
        g = tl.load(g_ptr + tok * sg_t + h, mask=live, other=0.0)
        beta = tl.load(beta_ptr + tok * sb_t + h, mask=live, other=0.0)
        cum = tl.cumsum(g, axis=0)  # padding rows add g = 0: cum[-1] is the chunk's decay
        ci = first + (cs - bos) // CHUNK
        tinv = tl.load(tinv_ptr + ci * st_c + h * st_h + rows[:, None] * CHUNK + rows[None, :])
        u = tl.dot(tinv, v * beta[:, None], input_precision=PREC)  # [CHUNK, BV]
        w = tl.dot(tinv, k * (beta * tl.exp(cum))[:, None], input_precision=PREC)  # [CHUNK, DK]
        d = u - tl.dot(w, s, input_precision=PREC)  # the chunk's deltas
        decay = tl.exp(tl.where(incl, cum[:, None] - cum[None, :], 0.0))
        attn = tl.where(incl, tl.dot(q, tl.trans(k), input_precision=PREC) * decay, 0.0)
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PREC)
        o += tl.dot(attn, d, input_precision=PREC)
        o_ptrs = out_ptr + tok[:, None] * so_t + h * so_h + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=live[:, None] & mask_v[None, :])
        if HAS_SNAP:
            snaps = tl.load(snap_slots_ptr + tok, mask=live, other=-1)
            if tl.max(snaps, axis=0) >= 0:  # rare (anchors): only such chunks pay the loop
                for j in range(CHUNK):
                    row = tl.max(tl.where(rows == j, snaps, -1), axis=0)
                    if row >= 0:  # S after token j: the start state and deltas 0..j
                        cum_j = tl.sum(tl.where(rows == j, cum, 0.0), axis=0)
                        k_j = k * tl.exp(tl.where(rows <= j, cum_j - cum, 0.0))[:, None]
                        k_j = tl.where((rows <= j)[:, None], k_j, 0.0)
                        s_j = s * tl.exp(cum_j) + tl.dot(tl.trans(k_j), d, input_precision=PREC)
                        snap_ptrs = snap_ptr + row * sn_n + h * sn_h + tile
                        tl.store(snap_ptrs, s_j, mask=mask_v[None, :])
        cum_last = tl.sum(tl.where(rows == CHUNK - 1, cum, 0.0), axis=0)
        k_out = k * tl.exp(cum_last - cum)[:, None]  # [CHUNK, DK]
        s = s * tl.exp(cum_last) + tl.dot(tl.trans(k_out), d, input_precision=PREC)
    tl.store(s_ptrs, s, mask=mask_v[None, :])


def _rows_inner(x: Tensor) -> Tensor:
    """The kernel takes any token / head strides but needs the last dim contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


def pick_form(seq_bounds: tuple[int, ...] | None, dk: int, fp64: bool) -> str:
    """The chunked form for prefill with a sequence of at least min_tokens (fp32 math, Dk >= 16
    for tl.dot); the recurrent one otherwise (decode, short chunks, fp64 oracle runs)."""
    if seq_bounds is None or fp64 or dk < 16:
        return "recurrent"
    longest = max(b - a for a, b in zip(seq_bounds[:-1], seq_bounds[1:], strict=True))
    return "chunk" if longest >= TILES["default"]["chunk"]["min_tokens"] else "recurrent"


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
    seq_bounds: tuple[int, ...] | None = None,  # None: decode (graph-capturable)
    snap_slots: Tensor | None = None,  # [T] int64
    snap_out: Tensor | None = None,  # [Cn, Hv, Dk, Dv] fp32
    tiles: dict | None = None,  # overrides of the tile table (tests, sweeps)
    form: str | None = None,  # "recurrent" | "chunk"; None: pick_form
) -> Tensor:
    """Launch the kernels (arguments checked by `kernels.gated_delta`). Returns [T, Hv, Dv]."""
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
    else:  # any pointer will do: the kernels never read them
        snap_slots, snap_out = state_slots, state
    fp64 = torch.float64 in (v.dtype, state.dtype)
    picked = form is None
    if picked:
        form = pick_form(seq_bounds, dk, fp64)
        form = "recurrent" if (q.device, dk) in _NO_CHUNK else form
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               g.stride(0), beta.stride(0), out.stride(0), out.stride(1), state.stride(0),
               state.stride(1), snap_out.stride(0), snap_out.stride(1))  # fmt: skip
    if form == "chunk":
        assert seq_bounds is not None and not fp64 and dk >= 16, "chunk form: fp32 prefill only"
        c = {**TILES["default"]["chunk"], **(tiles or {})}
        try:
            _launch_chunked(q, k, v, g, beta, out, state, state_slots, cu_seqlens, snap_slots,
                            snap_out, scale, seq_bounds, strides, has_snap, c)  # fmt: skip
            return out
        except OutOfResources:  # raised before the scan kernel writes anything
            if not picked:
                raise
            _NO_CHUNK.add((q.device, dk))
    c = tiles_for(seq_bounds is None, tiles)
    grid = (B, hv, triton.cdiv(dv, c["BV"]))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, out, state, state_slots, cu_seqlens, snap_slots, snap_out,
        scale, 1e-6, T - 1, *strides,
        dv, GROUP=hv // hk, DK=dk, BV=c["BV"], HAS_SNAP=has_snap,
        ACC=tl.float64 if fp64 else tl.float32, num_warps=c["num_warps"],
    )  # fmt: skip
    return out


def chunk_table(
    starts: list[int], ends: list[int], first: list[int], device: torch.device
) -> tuple[torch.Tensor, int]:
    """The chunk table [starts (nc), ends (nc), pad, first (B)] int32 and where `first`
    begins. Triton specialises a pointer on 16-byte alignment: a `first` right after the ends
    (offset 8 * nc bytes) changed alignment with the parity of nc, and a prompt with an odd
    chunk count compiled the scan kernel again (~5 s, inside an agent's turn on the device).
    Padded, it always starts 16-byte aligned."""
    at = -(-2 * len(starts) // 4) * 4  # int32 elements: a multiple of 4 is 16 bytes
    pad = [0] * (at - 2 * len(starts))
    return torch.tensor(starts + ends + pad + first, dtype=torch.int32).to(device), at


def _launch_chunked(q, k, v, g, beta, out, state, state_slots, cu_seqlens, snap_slots, snap_out,
                    scale, seq_bounds, strides, has_snap, c) -> None:  # fmt: skip
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    # The chunk table comes from the host bounds: each sequence's chunks start at its own start.
    starts, ends, first = [], [], []
    for lo, hi in zip(seq_bounds[:-1], seq_bounds[1:], strict=True):
        first.append(len(starts))
        starts += range(lo, hi, CHUNK)
        ends += [min(t + CHUNK, hi) for t in range(lo, hi, CHUNK)]
    nc = len(starts)
    if nc == 0:
        return
    table, first_at = chunk_table(starts, ends, first, q.device)
    tinv = torch.empty(nc, hv, CHUNK, CHUNK, dtype=torch.float32, device=q.device)
    _chunk_solve_kernel[(nc, hv)](
        k, g, beta, table, tinv, 1e-6, k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
        tinv.stride(0), tinv.stride(1), nc,
        GROUP=hv // hk, DK=dk, CHUNK=CHUNK, BLOCK=16, PREC=c["precision"],
        num_warps=c["solve_warps"], num_stages=c["num_stages"],
    )  # fmt: skip
    _chunk_scan_kernel[(len(first), hv, triton.cdiv(dv, c["BV"]))](
        q, k, v, g, beta, out, state, state_slots, cu_seqlens, snap_slots, snap_out, tinv,
        table[first_at:], scale, 1e-6, *strides, tinv.stride(0), tinv.stride(1), dv,
        GROUP=hv // hk, DK=dk, BV=c["BV"], CHUNK=CHUNK, HAS_SNAP=has_snap, PREC=c["precision"],
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )  # fmt: skip
