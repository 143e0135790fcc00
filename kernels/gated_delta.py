"""Gated DeltaNet entry points (Qwen3-Next / Qwen3.5-MoE linear attention): thin launchers that
check shapes and dtypes, then run the Triton kernel on CUDA tensors and the plain-torch twin of
`kernels/reference_delta.py` otherwise (`force_triton=True`: the Triton kernel in Triton's
interpreter on CPU tensors, for tests).

State layout (engine/layers/recurrent.py): the delta-rule state pool is [N, Hv, Dk, Dv] fp32 and
the conv pool [N, C, K - 1] in the model dtype, one row per state slot; sequence b reads and
overwrites row state_slots[b]. Checkpoint pools have the same rows: snap_slots[t] >= 0 copies
the state after token t there. `seq_bounds` is the host copy of cu_seqlens; None declares a
decode step (one token per sequence, T == B) and promises a CUDA-graph-capturable call.
"""

# T tokens (packed over B sequences), Hk / Hv key / value heads, Dk / Dv head dims, N state
# slots, Cn checkpoint rows, C conv channels, K conv width

from __future__ import annotations

import torch
from torch import Tensor

from freetoken_agent.kernels import reference_delta
from freetoken_agent.kernels.dispatch import use_triton

_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.float64)  # fp64 on the CPU only (oracle runs)


def gated_delta_rule(
    q: Tensor,  # [T, Hk, Dk] model dtype
    k: Tensor,  # [T, Hk, Dk]
    v: Tensor,  # [T, Hv, Dv]
    g: Tensor,  # [T, Hv] fp32: log of the per-token decay (<= 0)
    beta: Tensor,  # [T, Hv] fp32: write strength in (0, 1)
    state: Tensor,  # [N, Hv, Dk, Dv] fp32, read at each sequence's start, overwritten at its end
    state_slots: Tensor,  # [B] int64
    cu_seqlens: Tensor,  # [B + 1] int32
    scale: float,
    seq_bounds: tuple[int, ...] | None = None,
    snap_slots: Tensor | None = None,  # [T] int64, -1 = no snapshot after token t
    snap_out: Tensor | None = None,  # [Cn, Hv, Dk, Dv] fp32
    *,
    force_triton: bool = False,
) -> Tensor:
    """The gated delta rule over a packed batch (see `kernels/reference_delta.py` for the math;
    it equals transformers' torch_chunk/recurrent_gated_delta_rule with
    use_qk_l2norm_in_kernel=True, initial_state and output_final_state). Returns [T, Hv, Dv] in
    v.dtype; `state` rows of the batch's sequences hold their final states (empty sequences
    leave theirs untouched)."""
    _check_delta(q, k, v, g, beta, state, state_slots, cu_seqlens, seq_bounds, snap_slots,
                 snap_out)  # fmt: skip
    if not use_triton(q, force_triton, "gated_delta_rule"):
        args = (q, k, v, g, beta, state, state_slots, cu_seqlens, scale)
        return reference_delta.gated_delta_rule(*args, seq_bounds, snap_slots, snap_out)
    # Imported here so the CPU fallback works on machines without triton.
    from freetoken_agent.kernels.triton.gated_delta import gated_delta_rule as triton_impl

    return triton_impl(q, k, v, g, beta, state, state_slots, cu_seqlens, scale, seq_bounds,
                       snap_slots, snap_out)  # fmt: skip


def causal_conv1d(
    x: Tensor,  # [T, C] model dtype: the conv inputs (q, k, v projections concatenated)
    weight: Tensor,  # [C, K] depthwise taps (transformers' conv1d.weight[:, 0, :])
    conv_state: Tensor,  # [N, C, K - 1] model dtype, overwritten in place
    state_slots: Tensor,  # [B] int64
    cu_seqlens: Tensor,  # [B + 1] int32
    seq_bounds: tuple[int, ...] | None = None,
    snap_slots: Tensor | None = None,  # [T] int64
    snap_out: Tensor | None = None,  # [Cn, C, K - 1]
) -> Tensor:
    """silu(causal depthwise conv over [state; x]) per sequence, no bias: [T, C] in x.dtype.

    Plain torch on every device: the conv is a few multiply-adds per element, bound by reading x
    once; the decode path is one vectorised gather / compute / scatter without host syncs."""
    _check_conv(x, weight, conv_state, state_slots, cu_seqlens, seq_bounds, snap_slots, snap_out)
    return reference_delta.causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens,
                                         seq_bounds, snap_slots, snap_out)  # fmt: skip


def _check_delta(q, k, v, g, beta, state, state_slots, cu_seqlens, seq_bounds, snap_slots,
                 snap_out) -> None:  # fmt: skip
    name = "gated_delta_rule"
    assert q.dim() == 3 and k.shape == q.shape, (
        f"{name}: q and k must both be [T, Hk, Dk], got {tuple(q.shape)} and {tuple(k.shape)}"
    )
    T, hk, dk = q.shape
    assert v.dim() == 3 and v.shape[0] == T, f"{name}: v must be [T={T}, Hv, Dv], got {_s(v)}"
    hv, dv = v.shape[1:]
    assert hv % hk == 0, f"{name}: Hv={hv} value heads must be a multiple of Hk={hk} key heads"
    assert q.dtype == k.dtype == v.dtype and v.dtype in _MODEL_DTYPES, (
        f"{name}: q, k, v must share one of {_MODEL_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
    )
    for arg, x in (("g", g), ("beta", beta)):
        assert x.shape == (T, hv), f"{name}: {arg} must be [T={T}, Hv={hv}], got {_s(x)}"
        assert x.dtype in _STATE_DTYPES, f"{name}: {arg} must be fp32, got {x.dtype}"
    _check_pool(name, "state", state, (hv, dk, dv))
    _check_batch(name, T, state_slots, cu_seqlens, seq_bounds)
    _check_snap(name, T, snap_slots, snap_out, state)
    _same_device(name, q, k, v, g, beta, state, state_slots, cu_seqlens, snap_slots, snap_out)


def _check_conv(x, weight, conv_state, state_slots, cu_seqlens, seq_bounds, snap_slots,
                snap_out) -> None:  # fmt: skip
    name = "causal_conv1d"
    assert x.dim() == 2 and x.dtype in _MODEL_DTYPES, (
        f"{name}: x must be [T, C] in one of {_MODEL_DTYPES}, got {_s(x)} {x.dtype}"
    )
    T, c = x.shape
    assert weight.dim() == 2 and weight.shape[0] == c and weight.shape[1] >= 2, (
        f"{name}: weight must be [C={c}, K >= 2], got {_s(weight)}"
    )
    assert weight.is_floating_point(), f"{name}: weight must be floating point, got {weight.dtype}"
    taps = weight.shape[1]
    assert conv_state.shape[1:] == (c, taps - 1) and conv_state.dtype == x.dtype, (
        f"{name}: conv_state must be [N, C={c}, K - 1={taps - 1}] {x.dtype}, got "
        f"{_s(conv_state)} {conv_state.dtype}"
    )
    _check_batch(name, T, state_slots, cu_seqlens, seq_bounds)
    _check_snap(name, T, snap_slots, snap_out, conv_state)
    _same_device(name, x, weight, conv_state, state_slots, cu_seqlens, snap_slots, snap_out)


def _check_pool(name: str, arg: str, pool: Tensor, row: tuple[int, ...]) -> None:
    assert pool.dim() == 4 and pool.shape[1:] == row, (
        f"{name}: {arg} must be [N, Hv, Dk, Dv] = [N, {', '.join(map(str, row))}], got {_s(pool)}"
    )
    assert pool.dtype == torch.float32 or (pool.dtype == torch.float64 and not pool.is_cuda), (
        f"{name}: {arg} must be fp32 (fp64 only on the CPU), got {pool.dtype} on {pool.device}"
    )


def _check_batch(name: str, T: int, state_slots: Tensor, cu_seqlens: Tensor,
                 seq_bounds: tuple[int, ...] | None) -> None:  # fmt: skip
    assert state_slots.dim() == 1 and state_slots.dtype == torch.int64, (
        f"{name}: state_slots must be [B] int64, got {_s(state_slots)} {state_slots.dtype}"
    )
    B = state_slots.shape[0]
    assert cu_seqlens.shape == (B + 1,) and cu_seqlens.dtype == torch.int32, (
        f"{name}: cu_seqlens must be [B + 1 = {B + 1}] int32, got {_s(cu_seqlens)} "
        f"{cu_seqlens.dtype}"
    )
    if seq_bounds is None:
        assert T == B, f"{name}: seq_bounds=None means decode (one token per sequence): {T=}, {B=}"
        return
    assert len(seq_bounds) == B + 1 and seq_bounds[0] == 0 and seq_bounds[-1] == T, (
        f"{name}: seq_bounds must be the host copy of cu_seqlens (B + 1 = {B + 1} bounds from 0 "
        f"to T={T}), got {len(seq_bounds)} bounds from {seq_bounds[:1]} to {seq_bounds[-1:]}"
    )
    assert all(a <= b for a, b in zip(seq_bounds[:-1], seq_bounds[1:], strict=True)), (
        f"{name}: seq_bounds must be nondecreasing"
    )


def _check_snap(name: str, T: int, snap_slots: Tensor | None, snap_out: Tensor | None,
                pool: Tensor) -> None:  # fmt: skip
    assert (snap_slots is None) == (snap_out is None), (
        f"{name}: snap_slots and snap_out come together (got only one)"
    )
    if snap_slots is None:
        return
    assert snap_slots.shape == (T,) and snap_slots.dtype == torch.int64, (
        f"{name}: snap_slots must be [T={T}] int64, got {_s(snap_slots)} {snap_slots.dtype}"
    )
    assert snap_out.dim() == pool.dim() and snap_out.shape[1:] == pool.shape[1:], (
        f"{name}: snap_out rows must match the state rows {tuple(pool.shape[1:])}, "
        f"got {_s(snap_out)}"
    )
    assert snap_out.dtype == pool.dtype, (
        f"{name}: snap_out must be {pool.dtype} like the state, got {snap_out.dtype}"
    )


def _same_device(name: str, *tensors: Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    assert len(devices) == 1, f"{name}: all tensors must be on one device, got {devices}"


def _s(x: Tensor) -> tuple[int, ...]:
    return tuple(x.shape)
