"""RMSNorm in Triton, optionally fused with the residual add before it; one program per row.

Twin: `kernels/reference.py` `rms_norm`. The math runs in fp32 and reproduces the twin's
rounding points: s = round(x + residual), n = round(s * rsqrt(mean(s^2) + eps)), y = round(w * n)
(round = to the model dtype). Only the fp32 sum of squares (reduction order) and rsqrt may differ
from torch's in the last fp32 bit, which can flip a dtype rounding of n: y then differs from the
twin by one ulp of n times w, rarely. Zero-centred norms (ZERO_CENTRED, Qwen3-Next) compute
y = round(s * rstd * (1 + w)) with w upcast to fp32 first and no rounding of n; there a flip
moves y by one ulp of y.

`round_to` below is shared with the rope and router kernels: Triton's interpreter converts fp32
to bf16 by truncation (and its bf16 arithmetic is wrong), so under TRITON_INTERPRET=1 bf16
rounding is emulated with integer ops (round to nearest even on the bits); compiled kernels use
the hardware conversion. With every value rounded before it is stored, a bf16 store then only
drops zero bits, and bf16 kernels can be checked bit for bit on the CPU too.
"""

# Shape legend: T rows (tokens), H hidden size (BLOCK_H: H padded to a power of two, or the chunk
# width when a row is walked in chunks).

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch

# Rounding modes of `round_to` (constexpr codes).
ROUND_NONE, ROUND_FP16, ROUND_BF16, ROUND_BF16_EMULATED = 0, 1, 2, 3

# Rows up to this width stay in registers (one read of x); wider rows are walked twice in chunks
# of _CHUNK (sum of squares, then normalise) instead of spilling.
_MAX_SINGLE_BLOCK = 8192
_CHUNK = 4096
# Warps per program by padded row width (first bound >= BLOCK_H wins): about 8-16 fp32 values
# per thread. First guesses for the H200; decode rows are latency-bound, not bandwidth-bound.
_WARPS_BY_WIDTH = ((256, 1), (1024, 4), (4096, 8), (_MAX_SINGLE_BLOCK, 16))


def round_mode(dtype: torch.dtype) -> int:
    """The `round_to` code that rounds fp32 values to `dtype` in a kernel."""
    if dtype == torch.float32:
        return ROUND_NONE
    if dtype == torch.float16:
        return ROUND_FP16
    if dtype == torch.bfloat16:
        # Integer rounding everywhere: the interpreter truncates fp32 -> bf16, and compiled code
        # was seen on the H200 (triton 3.6) to fold the x.to(bf16).to(fp32) round trip away,
        # leaving one rounding where the twin has two (1-ulp differences in ~5% of elements).
        return ROUND_BF16_EMULATED
    raise TypeError(f"unsupported dtype {dtype} (fp32, fp16 or bf16)")


def warps_for(block: int) -> int:
    return next((w for bound, w in _WARPS_BY_WIDTH if block <= bound), _WARPS_BY_WIDTH[-1][1])


@triton.jit
def round_to(x, MODE: tl.constexpr):
    """fp32 x rounded (to nearest even) to fp16 / bf16 and returned as fp32; MODE: ROUND_*."""
    if MODE == 1:
        y = x.to(tl.float16).to(tl.float32)
    elif MODE == 2:
        y = x.to(tl.bfloat16).to(tl.float32)
    elif MODE == 3:
        # Round to nearest even on the bit pattern: add 0x7FFF plus the lowest kept bit, then
        # clear the 16 dropped bits (finite values; an overflow correctly becomes inf).
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x
    return y


@triton.jit
def _load_sum(x_ptr, r_ptr, offs, mask, HAS_RES: tl.constexpr, MODE: tl.constexpr):
    # The row values the norm sees: x, or round(x + residual), in fp32. Masked lanes are 0.
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = round_to(x + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32), MODE)
    return x


@triton.jit
def _scale(x, rstd, w_ptr, offs, mask, ZERO_CENTRED: tl.constexpr, MODE: tl.constexpr):
    # The normalised row times the weight, rounded to the model dtype (fp32 in, fp32 out).
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        y = round_to(x * rstd * (w + 1.0), MODE)
    else:
        y = round_to(w * round_to(x * rstd, MODE), MODE)
    return y


@triton.jit
def _row_rstd(x, inv_h, eps):
    """1 / rms of a row held whole (fp32, masked lanes 0): the mean as torch's CUDA reduction
    computes it, the sum times the fp32 reciprocal of H (also kernels/triton/norm_qkv.py's)."""
    return tl.rsqrt(tl.sum(x * x, 0) * inv_h + eps)


@triton.jit
def _normalise_row(x, offs, mask, w_ptr, y_row, s_row, inv_h, eps, HAS_RES: tl.constexpr,
                   MODE: tl.constexpr, ZERO_CENTRED: tl.constexpr):  # fmt: skip
    """A row held whole: x the values the norm sees (fp32, masked lanes 0), stored as s with
    HAS_RES; y = the normalised row times the weight, stored (also kernels/triton/
    proj_norm.py's last program)."""
    if HAS_RES:
        tl.store(s_row + offs, x.to(s_row.dtype.element_ty), mask=mask)
    y = _scale(x, _row_rstd(x, inv_h, eps), w_ptr, offs, mask, ZERO_CENTRED, MODE)
    tl.store(y_row + offs, y.to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr,  # x, residual, y, s [T, H]; w [H]
    H, inv_h, eps, stride_x, stride_r, stride_y, stride_s,
    BLOCK_H: tl.constexpr, CHUNKED: tl.constexpr, HAS_RES: tl.constexpr, MODE: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # first: pdl.py
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row = x_ptr + row * stride_x, r_ptr + row * stride_r
    y_row, s_row = y_ptr + row * stride_y, s_ptr + row * stride_s
    offs = tl.arange(0, BLOCK_H)
    if not CHUNKED:
        mask = offs < H
        x = _load_sum(x_row, r_row, offs, mask, HAS_RES, MODE)  # [BLOCK_H]
        _normalise_row(x, offs, mask, w_ptr, y_row, s_row, inv_h, eps, HAS_RES, MODE,
                       ZERO_CENTRED)  # fmt: skip
    else:
        acc = tl.zeros([BLOCK_H], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            x = _load_sum(x_row, r_row, h0 + offs, h0 + offs < H, HAS_RES, MODE)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, 0) * inv_h + eps)
        for h0 in range(0, H, BLOCK_H):  # second pass re-reads x (+ residual): no spills
            mask = h0 + offs < H
            x = _load_sum(x_row, r_row, h0 + offs, mask, HAS_RES, MODE)
            if HAS_RES:
                tl.store(s_row + h0 + offs, x.to(s_ptr.dtype.element_ty), mask=mask)
            y = _scale(x, rstd, w_ptr, h0 + offs, mask, ZERO_CENTRED, MODE)
            tl.store(y_row + h0 + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    zero_centred: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Triton twin of `reference.rms_norm` (same contract); no host synchronisation.

    x, residual: [T, H] with a contiguous last dim (rows may be strided); weight: [H]. Returns
    y, or (y, s) with residual; both new contiguous [T, H] tensors in x.dtype.
    """
    assert x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}"
    T, H = x.shape
    assert weight.shape == (H,) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)
    assert x.stride(1) == 1 and weight.is_contiguous(), "the hidden dim must be contiguous"
    mode = round_mode(x.dtype)
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
        assert residual.stride(1) == 1, "the residual's hidden dim must be contiguous"
        s = torch.empty_like(y)
    if T > 0 and H > 0:
        chunked = H > _MAX_SINGLE_BLOCK
        block = _CHUNK if chunked else triton.next_power_of_2(H)
        r, out_s = (residual, s) if residual is not None else (x, y)  # unused without residual
        _rms_norm_kernel[(T,)](
            x, r, weight, y, out_s, H, 1.0 / H, eps,
            x.stride(0), r.stride(0), y.stride(0), out_s.stride(0),
            BLOCK_H=block, CHUNKED=chunked, HAS_RES=residual is not None, MODE=mode,
            ZERO_CENTRED=zero_centred, num_warps=warps_for(block),
            **pdl_launch(x.device),
        )  # fmt: skip
    return y if residual is None else (y, s)
