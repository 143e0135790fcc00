"""Per-head q/k RMSNorm + RoPE + KV-cache store in one Triton kernel.

Replaces, per attention layer: the q/k split and reshapes, two per-head RMSNorms, the cos/sin
gathers, the rotate-half (neg, cat, two multiplies, add) for q and k, and the two index_copy_
of the KV store. Twin: `kernels/reference.py` `qk_norm_rope_store`.

Grid (T, QB + 2 * KB): program (t, b) handles token t and a block of HB heads: q heads for
b < QB (written to the new q tensor), k heads for QB <= b < QB + KB (written to k_cache at the
token's slot), v heads after that (copied raw to v_cache). Decode at batch 1 thus spreads over
QB + 2 * KB programs instead of one.

Numerics follow the twin's rounding points (round = to the model dtype, `norm.round_to`):
n = round(w * round(x * rstd)), then out = round(round(n * cos) + round(rotated * sin)) on dims
< R. Products of two 16-bit values are exact in fp32 and a sum of two is rounded once either
way, so without norm weights the result equals the twin bit for bit; with them only the fp32
sum of squares / rsqrt may flip a rounding of n (one ulp). Rotate-half needs each element's
partner (d +- R/2): it is loaded a second time from memory (an L1 hit) rather than shuffled
across registers, and normalised with the same per-head rstd.
"""

# Shape legend: T tokens, Hq / Hkv query / kv heads, D head dim (D_PAD: padded to a power of two),
# R rotary dims, HB heads per program, QB = cdiv(Hq, HB), KB = cdiv(Hkv, HB), P pages of S slots.

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken_agent.kernels.triton.norm import round_mode, round_to
from freetoken_agent.kernels.triton.pdl import enter
from freetoken_agent.kernels.triton.pdl import launch as pdl_launch

# Elements (heads x padded head dim) per program: HB = min(Hkv padded, this // D_PAD), so the kv
# heads fit one program and decode still gets several q programs (Hq=32, D=128: 8 + 1 + 1).
_HEAD_BLOCK_ELEMS = 512
_NUM_WARPS = 4


@triton.jit
def _rotary_dims(HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr):
    """Per dim of a padded head [D_PAD]: its offset, whether it is a real dim, whether RoPE
    turns it, whether it is in the first rotary half, and its rotate-half partner."""
    offs_d = tl.arange(0, D_PAD)
    in_rot = offs_d < ROT
    first_half = offs_d < ROT // 2
    partner = tl.where(first_half, offs_d + ROT // 2, offs_d - ROT // 2)
    partner = tl.where(in_rot, partner, offs_d)
    return offs_d, offs_d < HEAD_DIM, in_rot, first_half, partner


@triton.jit
def _norm_rope_values(
    x, xp, w_ptr, cos_row, sin_row, offs_d, d_ok, in_rot, first_half, partner, eps, inv_d,
    HAS_NORM: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """Heads [HB, D_PAD] (fp32, masked dims 0) and their rotate-half partners' values xp:
    normed (HAS_NORM) and rotated, rounded as the twin rounds (also kernels/triton/
    norm_qkv.py's, whose heads come out of a projection instead of memory)."""
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) * inv_d + eps)[:, None]  # [HB, 1]
        w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = round_to(w * round_to(x * rstd, MODE), MODE)
        xp = round_to(wp * round_to(xp * rstd, MODE), MODE)
    c = tl.load(cos_row + offs_d, mask=in_rot, other=0.0).to(tl.float32)[None, :]  # [1, D_PAD]
    s = tl.load(sin_row + offs_d, mask=in_rot, other=0.0).to(tl.float32)[None, :]
    rotated = tl.where(first_half[None, :], -xp, xp)  # negation is exact
    out = round_to(round_to(x * c, MODE) + round_to(rotated * s, MODE), MODE)
    return tl.where(in_rot[None, :], out, x)  # dims R..D-1 pass through (normed)


@triton.jit
def _norm_rope_heads(
    src, dst, w_ptr, cos_row, sin_row, head0, n_heads, dst_head_stride, eps, inv_d,
    HB: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
    HAS_NORM: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    # src: this token's first head of the kind (contiguous [n_heads, D]); dst: its output.
    offs_h = head0 + tl.arange(0, HB)  # [HB]
    offs_d, d_ok, in_rot, first_half, partner = _rotary_dims(HEAD_DIM, D_PAD, ROT)
    mask = (offs_h < n_heads)[:, None] & d_ok[None, :]  # [HB, D_PAD]
    head_off = offs_h[:, None] * HEAD_DIM
    x = tl.load(src + head_off + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + head_off + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    out = _norm_rope_values(x, xp, w_ptr, cos_row, sin_row, offs_d, d_ok, in_rot, first_half,
                            partner, eps, inv_d, HAS_NORM, MODE)  # fmt: skip
    ptrs = dst + offs_h[:, None] * dst_head_stride + offs_d[None, :]
    tl.store(ptrs, out.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    slot_ptr, eps, inv_d, page_size, n_heads, n_kv_heads, q_blocks, kv_blocks,
    stride_qkv, stride_cos, stride_sin, stride_qt, stride_qh, stride_cp, stride_cs, stride_ch,
    HB: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, MODE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # first: pdl.py
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    row = qkv_ptr + t * stride_qkv
    # Both scalars are loaded by every program (two cached loads) so the branches below share
    # one set of definitions.
    pos = tl.load(pos_ptr + t)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    slot = tl.load(slot_ptr + t)
    cache_off = (slot // page_size) * stride_cp + (slot % page_size) * stride_cs
    if b < q_blocks:
        _norm_rope_heads(
            row, q_out_ptr + t * stride_qt, q_w_ptr, cos_row, sin_row, b * HB, n_heads,
            stride_qh, eps, inv_d, HB, HEAD_DIM, D_PAD, ROT, Q_NORM, MODE,
        )  # fmt: skip
    elif b < q_blocks + kv_blocks:
        _norm_rope_heads(
            row + n_heads * HEAD_DIM, k_cache_ptr + cache_off, k_w_ptr, cos_row, sin_row,
            (b - q_blocks) * HB, n_kv_heads, stride_ch, eps, inv_d,
            HB, HEAD_DIM, D_PAD, ROT, K_NORM, MODE,
        )  # fmt: skip
    else:  # v: a raw copy into the cache
        offs_h = (b - q_blocks - kv_blocks) * HB + tl.arange(0, HB)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h < n_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
        src = row + (n_heads + n_kv_heads) * HEAD_DIM + offs_h[:, None] * HEAD_DIM
        v = tl.load(src + offs_d[None, :], mask=mask, other=0.0)
        dst = v_cache_ptr + cache_off + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(dst, v, mask=mask)


def qk_norm_rope_store(
    qkv: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    """Triton twin of `reference.qk_norm_rope_store` (same contract); no host sync.

    qkv may have strided rows (its last dim contiguous); cos / sin rows likewise. The caches
    need a contiguous [Hkv, D] block per slot and one layout for both. Every slot must be valid
    (CUDA-graph padding rows point at a scratch page).
    """
    T = qkv.shape[0]
    Hq, Hkv, D = n_heads, n_kv_heads, head_dim
    R = cos.shape[-1]
    dtype = qkv.dtype
    assert qkv.dim() == 2 and qkv.shape[1] == (Hq + 2 * Hkv) * D, (qkv.shape, Hq, Hkv, D)
    assert qkv.stride(1) == 1, "qkv rows must be contiguous"
    assert cos.dim() == 2 and cos.shape == sin.shape and 0 < R <= D and R % 2 == 0, (cos.shape, D)
    assert cos.stride(1) == 1 and sin.stride(1) == 1, "cos / sin rows must be contiguous"
    assert cos.dtype == sin.dtype == dtype, (cos.dtype, sin.dtype, dtype)
    assert positions.shape == (T,) and slot_mapping.shape == (T,), (positions.shape, T)
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (Hkv, D), (k_cache.shape, Hkv, D)
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "cache layout"
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == D, "[Hkv, D] per slot must be dense"
    assert k_cache.dtype == v_cache.dtype == dtype, (k_cache.dtype, v_cache.dtype, dtype)
    for w in (q_norm_weight, k_norm_weight):
        assert w is None or (w.shape == (D,) and w.dtype == dtype and w.is_contiguous()), w
    mode = round_mode(dtype)
    q = torch.empty((T, Hq, D), dtype=dtype, device=qkv.device)
    if T == 0:
        return q
    d_pad = triton.next_power_of_2(D)
    hb = max(1, min(triton.next_power_of_2(Hkv), _HEAD_BLOCK_ELEMS // d_pad))
    q_blocks, kv_blocks = triton.cdiv(Hq, hb), triton.cdiv(Hkv, hb)
    _qk_norm_rope_store_kernel[(T, q_blocks + 2 * kv_blocks)](
        qkv, positions, cos, sin,
        qkv if q_norm_weight is None else q_norm_weight,  # never read without a norm
        qkv if k_norm_weight is None else k_norm_weight,
        q, k_cache, v_cache, slot_mapping,
        eps, 1.0 / D, k_cache.shape[1], Hq, Hkv, q_blocks, kv_blocks,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HB=hb, HEAD_DIM=D, D_PAD=d_pad, ROT=R,
        Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None, MODE=mode,
        num_warps=_NUM_WARPS,
        **pdl_launch(qkv.device),
    )  # fmt: skip
    return q
