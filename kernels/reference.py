"""Plain-torch twins of the kernels: the test oracle and the CPU fallback.

Every function here is the specification of a kernel in `kernels/triton/`: same signature, same
results within float tolerance. They favour clarity over speed, may synchronise with the host
(`.tolist()`), and must never be used on a hot GPU path. The fused MoE's twin is in
`kernels/reference_moe.py` (re-exported here).
"""

# Shape legend (paged attention):
#   T  query tokens of all sequences, flattened sequence after sequence
#   B  sequences in the batch
#   Hq query heads, Hkv kv heads, G = Hq // Hkv (GQA group: query head h reads kv head h // G)
#   D  head dim
#   P  pages in the KV cache, S tokens per page (a page holds S consecutive positions)
#   L  kv length of one sequence, n its query length

from __future__ import annotations

import torch
from torch import Tensor

# The fused MoE's twin and its contract checks live in reference_moe.py (with their shape
# legend); re-exported here, where callers import them.
from freetoken_agent.kernels.reference_moe import (  # noqa: F401 - re-exported (see above)
    check_add,
    check_host_banks,
    check_moe_shapes,
    check_slot_cols,
    fused_moe,
    host_ids,
    swiglu_columns,
)

# Query rows processed at once per sequence: bounds the [Hq, rows, L] fp32 score tensor
# (a 32k-token prefill would otherwise need 32 * 32k * 32k * 4 bytes).
_REF_Q_CHUNK = 256


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write new tokens' K/V into their cache slots, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [P, S, Hkv, D] with each page's [S, Hkv, D] dense
    (pages may be strided: the KV pool lives in an elastic arena, engine/arena.py);
    slot_mapping: [T] int64, slot = page * S + offset. Serves the CPU and CUDA alike:
    `index_put_` with tensor indices has no host synchronisation, so it can be captured in a
    CUDA graph.
    """
    P, S, Hkv, D = k_cache.shape
    assert v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert k.shape == v.shape and k.shape[1:] == (Hkv, D), (k.shape, v.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    page, offset = slot_mapping // S, slot_mapping % S
    k_cache.index_put_((page, offset), k.to(k_cache.dtype))
    v_cache.index_put_((page, offset), v.to(v_cache.dtype))


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_q_lens: Tensor,
    kv_lens: Tensor,
    scale: float,
    max_q_len: int,
    window: int = 0,
    out: Tensor | None = None,
    max_kv_len: int | None = None,
) -> Tensor:
    """Causal (optionally sliding-window) attention of a varlen batch over a paged KV cache.

    q: [T, Hq, D]; k_cache, v_cache: [P, S, Hkv, D]; page_table: [B, max_pages] int32;
    cu_q_lens: [B+1] int32; kv_lens: [B] int32 (including the new tokens, already stored).
    Query i of sequence b sits at position p = kv_len_b - q_len_b + i and attends to kv
    positions j <= p, and with window > 0 only to p - window < j <= p. Softmax in fp32 (fp64
    for fp64 inputs), output in q.dtype, written into `out` ([T, Hq, D]) when given. max_q_len
    and max_kv_len are launch hints of the Triton kernel, unused here.
    """
    T, Hq, D = q.shape
    P, S, Hkv, Dk = k_cache.shape
    B = page_table.shape[0]
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, (q.shape, k_cache.shape)
    assert cu_q_lens.shape == (B + 1,) and kv_lens.shape == (B,), (cu_q_lens.shape, kv_lens.shape)
    G = Hq // Hkv
    wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for a float64 oracle
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape, (out.shape, q.shape)
    cu = cu_q_lens.tolist()  # host sync: acceptable in the reference only
    lens = kv_lens.tolist()
    for b in range(B):
        q0, n, L = cu[b], cu[b + 1] - cu[b], lens[b]
        if n == 0:
            continue
        if n > L:
            raise ValueError(f"sequence {b}: kv_len {L} < q_len {n} (new tokens must be stored)")
        pages = page_table[b, : (L + S - 1) // S].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:L].to(wide).permute(1, 2, 0)  # [Hkv, D, L]
        v = v_cache[pages].reshape(-1, Hkv, D)[:L].to(wide).permute(1, 0, 2)  # [Hkv, L, D]
        j = torch.arange(L, device=q.device)  # kv positions
        for c0 in range(0, n, _REF_Q_CHUNK):
            c1 = min(n, c0 + _REF_Q_CHUNK)
            qc = q[q0 + c0 : q0 + c1].to(wide).view(c1 - c0, Hkv, G, D).permute(1, 2, 0, 3)
            s = (qc @ k[:, None]) * scale  # [Hkv, G, c, L]
            pos = (L - n + torch.arange(c0, c1, device=q.device))[:, None]  # [c, 1]
            allowed = j[None, :] <= pos  # [c, L]
            if window > 0:
                allowed &= j[None, :] > pos - window
            s = s.masked_fill(~allowed, float("-inf"))
            o = torch.softmax(s, dim=-1) @ v[:, None]  # [Hkv, G, c, D]
            out[q0 + c0 : q0 + c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, Hq, D).to(out.dtype)
    return out


# --- fused norm / rope / router (the decode path's small ops) -------------------------
# Shape legend (fused norm / rope / router):
#   T  tokens, H hidden size
#   Hq query heads, Hkv kv heads, D head dim, R rotary dims (even, <= D; dims R..D-1 pass through)
#   P  pages in the KV cache, S tokens per page (flat slot = page * S + offset)
#   E  routed experts, K top-k


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype of norms and softmax: fp32, or float64 for a float64 oracle."""
    return torch.promote_types(dtype, torch.float32)


def _rms_normalize(x: Tensor, weight: Tensor, eps: float, zero_centred: bool = False) -> Tensor:
    # engine/layers/norm.py RMSNorm.forward: statistics in fp32, cast back to the model dtype
    # before the weight multiply (a dtype multiply: torch computes it in fp32, rounds once).
    # Zero-centred (Qwen3-Next's RMSNorm): the stored weight is w - 1; n * (1 + w) is formed in
    # fp32 and rounded once, with no rounding of n in between.
    dtype = x.dtype
    x32 = x.to(_wide(dtype))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (x32 * (1.0 + weight.to(x32.dtype))).to(dtype)
    return weight * x32.to(dtype)


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    zero_centred: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim, optionally fused with the residual add before it.

    x: [T, H] fp32 / fp16 / bf16 (float64 here too); weight: [H], x.dtype; residual: [T, H].
    Without residual: returns y = weight * to_dtype(x32 * rsqrt(mean(x32^2) + eps)), [T, H].
    zero_centred: y = to_dtype(x32 * rsqrt(mean(x32^2) + eps) * (1 + weight32)) instead (the
    checkpoint stores w - 1; adding 1 in bf16 at load would round it away).
    With residual: s = x + residual in x.dtype (computed in fp32, rounded once, as transformers'
    `residual + hidden_states`), y = rms_norm(s); returns (y, s), the new residual stream s.
    """
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    assert weight.dtype == x.dtype, (x.dtype, weight.dtype)
    if residual is None:
        return _rms_normalize(x, weight, eps, zero_centred)
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    s = x + residual  # [T, H]
    return _rms_normalize(s, weight, eps, zero_centred), s


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
    store_kv(k, v, k_cache, v_cache, slot_mapping)
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
