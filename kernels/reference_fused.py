"""Plain-torch twins of the fused decode-path kernels: RMSNorm (+ residual add), per-head q/k
norm + RoPE + KV store, and the router's softmax + top-k.

Each function is the current unfused torch path of the engine, op for op (same dtypes, same
rounding points), so swapping the kernel in changes no bits on the CPU; the Triton kernels in
`kernels/triton/{norm,rope,router}.py` follow the same rounding points. To be merged into
`kernels/reference.py`.
"""

# Shape legend (fused norm / rope / router):
#   T  tokens, H hidden size
#   Hq query heads, Hkv kv heads, D head dim, R rotary dims (even, <= D; dims R..D-1 pass through)
#   P  pages in the KV cache, S tokens per page (flat slot = page * S + offset)
#   E  routed experts, K top-k

from __future__ import annotations

import torch
from torch import Tensor


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype of norms and softmax: fp32, or float64 for a float64 oracle."""
    return torch.promote_types(dtype, torch.float32)


def _rms_normalize(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # engine/layers/norm.py RMSNorm.forward: statistics in fp32, cast back to the model dtype
    # before the weight multiply (a dtype multiply: torch computes it in fp32, rounds once).
    dtype = x.dtype
    x32 = x.to(_wide(dtype))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim, optionally fused with the residual add before it.

    x: [T, H] fp32 / fp16 / bf16 (float64 here too); weight: [H], x.dtype; residual: [T, H].
    Without residual: returns y = weight * to_dtype(x32 * rsqrt(mean(x32^2) + eps)), [T, H].
    With residual: s = x + residual in x.dtype (computed in fp32, rounded once, as transformers'
    `residual + hidden_states`), y = rms_norm(s); returns (y, s), the new residual stream s.
    """
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    assert weight.dtype == x.dtype, (x.dtype, weight.dtype)
    if residual is None:
        return _rms_normalize(x, weight, eps)
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    s = x + residual  # [T, H]
    return _rms_normalize(s, weight, eps), s


def _rotate_half(x: Tensor, cos: Tensor, sin: Tensor, r: int) -> Tensor:
    # engine/layers/rope.py `_rotate`: every op in the model dtype, so each product is rounded
    # to the dtype, then their sum.
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


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
    """Split the stacked q/k/v projection, per-head RMSNorm q and k, RoPE them, store k and v.

    qkv: [T, (Hq + 2 * Hkv) * D] (q heads, then k heads, then v heads); positions: [T] int64;
    cos, sin: [max_pos, R] in qkv.dtype, laid out as cat(freqs, freqs) (GPT-NeoX rotate-half on
    dims 0..R-1, dims R..D-1 pass through); q_norm_weight, k_norm_weight: [D] or None (no norm);
    k_cache, v_cache: [P, S, Hkv, D], qkv.dtype; slot_mapping: [T] int64, every slot valid.
    Writes the normed, rotated k and the raw v at slot_mapping; returns q [T, Hq, D], normed and
    rotated, a new contiguous tensor.
    """
    T = qkv.shape[0]
    Hq, Hkv, D = n_heads, n_kv_heads, head_dim
    R = cos.shape[-1]
    assert qkv.dim() == 2 and qkv.shape[1] == (Hq + 2 * Hkv) * D, (qkv.shape, Hq, Hkv, D)
    assert cos.shape == sin.shape and R % 2 == 0 and R <= D, (cos.shape, sin.shape, D)
    assert positions.shape == (T,) and slot_mapping.shape == (T,), (positions.shape, T)
    assert k_cache.shape[2:] == (Hkv, D) and v_cache.shape == k_cache.shape, k_cache.shape
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = q.reshape(T, Hq, D)
    k = k.reshape(T, Hkv, D)
    v = v.reshape(T, Hkv, D)
    if q_norm_weight is not None:
        q = _rms_normalize(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = _rms_normalize(k, k_norm_weight, eps)
    c = cos[positions].unsqueeze(1)  # [T, 1, R]
    s = sin[positions].unsqueeze(1)
    q, k = _rotate_half(q, c, s, R), _rotate_half(k, c, s, R)
    # store_kv of kernels/reference.py: index_copy_ on the flat [P * S, Hkv, D] view.
    P, S = k_cache.shape[:2]
    k_cache.view(P * S, Hkv, D).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(P * S, Hkv, D).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q.contiguous()


def softmax_topk(
    logits: Tensor, k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The router after its linear layer (engine/layers/moe.py TopKRouter.forward).

    logits: [T, E] in the model dtype. probs = softmax(logits) in fp32; returns ids [T, K] int32
    of the k largest probs in descending order (ties: lowest index first; torch.topk here) and
    weights [T, K] fp32 (float64 for float64 logits): the top probs, divided by their sum when
    renormalize, rounded to round_to and back when round_to is given (Qwen / OLMoE; Mixtral
    passes None).
    """
    assert logits.dim() == 2 and 0 < k <= logits.shape[1], (logits.shape, k)
    probs = torch.softmax(logits, dim=-1, dtype=_wide(logits.dtype))  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to)
    return ids.to(torch.int32), weights.to(probs.dtype)
