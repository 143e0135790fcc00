"""Plain-torch twins of the gated DeltaNet kernels: test oracle and CPU path.

DESIGN section 4 puts every twin in `kernels/reference.py`; that file is near the 400-line
limit, so the recurrent-layer twins (gated delta rule, short causal conv) live here. The public
dispatchers are in `kernels/gated_delta.py`, which also checks the arguments.

Gated delta rule, per sequence and value head h (q and k from key head h // (Hv // Hk), both
L2-normalised over Dk, q times `scale`; math in fp32, fp64 when the inputs are fp64):

    S = S * exp(g_t);  delta = (v_t - k_t^T S) * beta_t;  S = S + k_t delta^T;  o_t = q_t^T S

Two forms. `recurrent_delta` runs that loop token by token (decode: one vectorised step over the
batch). `chunk_delta` (prefill) is the WY/UT form of transformers' `torch_chunk_gated_delta_rule`:
inside a chunk of C tokens with cumulative log decay c_t (Gamma_t = exp(c_t)) and start state S0,

    (I + A) D = beta V - (beta K * Gamma) S0,  A[t, s] = beta_t (k_t . k_s) Gamma_t / Gamma_s
                                               for s < t, zero elsewhere

is solved for the C rows of delta D at once (one triangular solve, not C dependent steps), then
o_t = Gamma_t q_t^T S0 + sum_{s <= t} (Gamma_t / Gamma_s) (q_t . k_s) d_s and
S_end = Gamma_C S0 + sum_s (Gamma_C / Gamma_s) k_s d_s^T. Padding tokens (k = v = beta = g = 0)
change nothing. Snapshots split a sequence at the snapshot tokens: each piece's final state is
the snapshot.
"""

# T tokens (packed over B sequences), L tokens of one piece, Hk / Hv key / value heads,
# Dk / Dv head dims, N state slots, Cn checkpoint rows, C conv channels, K conv width,
# n chunks of CHUNK tokens

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # the chunk size of transformers and FLA: a 64 x 64 triangular solve per chunk
L2_EPS = 1e-6  # transformers' l2norm (aligned with FLA)


def math_dtype(*tensors: Tensor) -> torch.dtype:
    """fp64 when any input is fp64 (CPU oracle runs), else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def prepare_qk(q: Tensor, k: Tensor, hv: int, scale: float, dtype: torch.dtype):
    """[T, Hk, Dk] -> [T, Hv, Dk] each, normalised (q scaled); key head h // (Hv // Hk)."""
    group = hv // q.shape[1]
    q = (l2norm(q.to(dtype)) * scale).repeat_interleave(group, dim=1)
    k = l2norm(k.to(dtype)).repeat_interleave(group, dim=1)
    return q, k


def delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor):
    """One token of every row: q, k [..., Hv, Dk] (prepared), v [..., Hv, Dv], g, beta [..., Hv],
    s [..., Hv, Dk, Dv]. Returns (o [..., Hv, Dv], new s)."""
    s = s * g.exp()[..., None, None]
    kv = (k.unsqueeze(-2) @ s).squeeze(-2)  # [..., Hv, Dv]
    delta = (v - kv) * beta[..., None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-2) @ s).squeeze(-2), s


def recurrent_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor):
    """Token loop over one piece: q, k [L, Hv, Dk] prepared, v [L, Hv, Dv], g, beta [L, Hv],
    s [Hv, Dk, Dv]. Returns (o [L, Hv, Dv], final s)."""
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        out[t], s = delta_step(q[t], k[t], v[t], g[t], beta[t], s)
    return out, s


def chunk_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor):
    """The chunked (WY/UT) form of `recurrent_delta`: same arguments, same results."""
    length, hv, dv = v.shape
    n = -(-length // CHUNK)
    pad = n * CHUNK - length

    def chunks(x: Tensor) -> Tensor:  # [L, Hv, *D] -> [Hv, n, CHUNK, *D], zero padded
        x = x.movedim(0, 1)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(hv, n, CHUNK, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    kb, vb = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [Hv, n, CHUNK] log Gamma_t inside each chunk
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).tril()
    # log(Gamma_t / Gamma_s) for s <= t; -inf above the diagonal so exp gives exact zeros
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * decay  # [Hv, n, CHUNK, CHUNK]; the solve reads s < t
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, kb * cum.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk scores, diagonal included
    q_in = q * cum.exp()[..., None]  # reads the chunk's start state
    k_out = k * (cum[..., -1:] - cum).exp()[..., None]  # writes into the chunk's end state
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, n, 1, 1]
    out = torch.empty_like(v)  # [Hv, n, CHUNK, Dv]
    for i in range(n):
        d = u[:, i] - w[:, i] @ s  # [Hv, CHUNK, Dv] the deltas of chunk i
        out[:, i] = q_in[:, i] @ s + attn[:, i] @ d
        s = s * chunk_decay[:, i] + k_out[:, i].transpose(-1, -2) @ d
    return out.reshape(hv, n * CHUNK, dv)[:, :length].movedim(0, 1), s


def copy_rows_where(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """dst[rows[t]] = src[t] for every t with rows[t] >= 0, without a host sync (CUDA-graph
    safe). Row by row: an index_copy_ of all rows at once would need the -1 rows filtered out
    (a sync) or sent somewhere harmless, and duplicate targets race."""
    for t in range(rows.shape[0]):
        row = rows[t : t + 1]  # [1]: a 1-element index, so no .item() hides in the indexing
        keep = (row >= 0).view(1, *[1] * (src.dim() - 1))
        target = row.clamp(min=0)
        kept = dst.index_select(0, target)
        dst.index_copy_(0, target, torch.where(keep, src[t : t + 1].to(dst.dtype), kept))


def gated_delta_rule(
    q: Tensor,  # [T, Hk, Dk]
    k: Tensor,  # [T, Hk, Dk]
    v: Tensor,  # [T, Hv, Dv]
    g: Tensor,  # [T, Hv]
    beta: Tensor,  # [T, Hv]
    state: Tensor,  # [N, Hv, Dk, Dv], updated in place
    state_slots: Tensor,  # [B] int64
    cu_seqlens: Tensor,  # [B + 1] int32
    scale: float,
    seq_bounds: tuple[int, ...] | None = None,
    snap_slots: Tensor | None = None,  # [T] int64
    snap_out: Tensor | None = None,  # [Cn, Hv, Dk, Dv]
    form: str = "chunk",  # "chunk" or "recurrent": how prefill pieces run (decode: one step)
) -> Tensor:
    """The contract of `kernels.gated_delta.gated_delta_rule` (arguments checked there)."""
    dtype, out_dtype = math_dtype(v, state), v.dtype
    hv = v.shape[1]
    q, k = prepare_qk(q, k, hv, scale, dtype)  # [T, Hv, Dk]
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    if seq_bounds is None:  # decode: token b is sequence b; one vectorised step, no host sync
        s = state.index_select(0, state_slots).to(dtype)  # [B, Hv, Dk, Dv]
        out, s = delta_step(q, k, v, g, beta, s)
        state.index_copy_(0, state_slots, s.to(state.dtype))
        if snap_slots is not None:
            copy_rows_where(snap_out, snap_slots, s)
        return out.to(out_dtype)
    run = {"chunk": chunk_delta, "recurrent": recurrent_delta}[form]
    out = torch.empty_like(v)  # [T, Hv, Dv] in the math dtype
    snaps = snap_slots.tolist() if snap_slots is not None else None
    for b, slot in enumerate(state_slots.tolist()):
        lo, hi = seq_bounds[b], seq_bounds[b + 1]
        if hi == lo:
            continue  # an empty sequence leaves its state untouched
        ends = [t + 1 for t in range(lo, hi - 1) if snaps and snaps[t] >= 0] + [hi]
        s = state[slot].to(dtype)
        for start, end in zip([lo] + ends[:-1], ends, strict=True):
            out[start:end], s = run(q[start:end], k[start:end], v[start:end],
                                    g[start:end], beta[start:end], s)  # fmt: skip
            if snaps and snaps[end - 1] >= 0:
                snap_out[snaps[end - 1]] = s
        state[slot] = s
    return out.to(out_dtype)


def causal_conv1d(
    x: Tensor,  # [T, C]
    weight: Tensor,  # [C, K]
    conv_state: Tensor,  # [N, C, K - 1], updated in place
    state_slots: Tensor,  # [B] int64
    cu_seqlens: Tensor,  # [B + 1] int32
    seq_bounds: tuple[int, ...] | None = None,
    snap_slots: Tensor | None = None,  # [T] int64
    snap_out: Tensor | None = None,  # [Cn, C, K - 1]
) -> Tensor:
    """silu(depthwise causal conv over [state; x]) per sequence, no bias; the contract of
    `kernels.gated_delta.causal_conv1d`. Tap j multiplies the input K - 1 - j tokens back (the
    last tap the current token), as nn.Conv1d's cross-correlation over [state; x] does."""
    dtype = math_dtype(x)
    w = weight.to(dtype)
    taps = w.shape[1]
    if seq_bounds is None:  # decode: window = [state; x_b] per row, vectorised, no host sync
        win = torch.cat([conv_state.index_select(0, state_slots), x.unsqueeze(-1)], -1)  # [B,C,K]
        out = F.silu((win.to(dtype) * w).sum(-1))
        conv_state.index_copy_(0, state_slots, win[..., 1:])
        if snap_slots is not None:
            copy_rows_where(snap_out, snap_slots, win[..., 1:])
        return out.to(x.dtype)
    out = torch.empty_like(x)
    snaps = snap_slots.tolist() if snap_slots is not None else None
    for b, slot in enumerate(state_slots.tolist()):
        lo, hi = seq_bounds[b], seq_bounds[b + 1]
        if hi == lo:
            continue
        xs = torch.cat([conv_state[slot].t(), x[lo:hi]])  # [K - 1 + L, C]
        xs32 = xs.to(dtype)
        acc = sum(xs32[j : j + hi - lo] * w[:, j] for j in range(taps))  # [L, C]
        out[lo:hi] = F.silu(acc).to(x.dtype)
        conv_state[slot] = xs[hi - lo :].t()
        for t in range(lo, hi) if snaps else ():
            if snaps[t] >= 0:  # the K - 1 inputs ending at token t: xs rows t - lo + 1 ...
                snap_out[snaps[t]] = xs[t - lo + 1 : t - lo + taps].t()
    return out
