"""Plain-torch twins of the kernels: the test oracle and the CPU fallback.

Every function here is the specification of a kernel in `kernels/triton/`: same signature, same
results within float tolerance. They favour clarity over speed, may synchronise with the host
(`.tolist()`), and must never be used on a hot GPU path.
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

# Query rows processed at once per sequence: bounds the [Hq, rows, L] fp32 score tensor
# (a 32k-token prefill would otherwise need 32 * 32k * 32k * 4 bytes).
_REF_Q_CHUNK = 256


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write new tokens' K/V into their cache slots, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [P, S, Hkv, D], contiguous; slot_mapping: [T] int64,
    slot = page * S + offset. Serves the CPU and CUDA alike: `index_copy_` on a flat view has no
    host synchronisation, so it can be captured in a CUDA graph.
    """
    P, S, Hkv, D = k_cache.shape
    assert v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert k.shape == v.shape and k.shape[1:] == (Hkv, D), (k.shape, v.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    # view() (not reshape()) so a non-contiguous cache fails loudly instead of writing a copy.
    k_cache.view(P * S, Hkv, D).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(P * S, Hkv, D).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
    positions j <= p, and with window > 0 only to p - window < j <= p. Softmax in fp32, output
    in q.dtype, written into `out` ([T, Hq, D]) when given. max_q_len and max_kv_len are launch
    hints of the Triton kernel, unused here.
    """
    T, Hq, D = q.shape
    P, S, Hkv, Dk = k_cache.shape
    B = page_table.shape[0]
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, (q.shape, k_cache.shape)
    assert cu_q_lens.shape == (B + 1,) and kv_lens.shape == (B,), (cu_q_lens.shape, kv_lens.shape)
    G = Hq // Hkv
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
        k = k_cache[pages].reshape(-1, Hkv, D)[:L].float().permute(1, 2, 0)  # [Hkv, D, L]
        v = v_cache[pages].reshape(-1, Hkv, D)[:L].float().permute(1, 0, 2)  # [Hkv, L, D]
        j = torch.arange(L, device=q.device)  # kv positions
        for c0 in range(0, n, _REF_Q_CHUNK):
            c1 = min(n, c0 + _REF_Q_CHUNK)
            qc = q[q0 + c0 : q0 + c1].float().view(c1 - c0, Hkv, G, D).permute(1, 2, 0, 3)
            s = (qc @ k[:, None]) * scale  # [Hkv, G, c, L]
            pos = (L - n + torch.arange(c0, c1, device=q.device))[:, None]  # [c, 1]
            allowed = j[None, :] <= pos  # [c, L]
            if window > 0:
                allowed &= j[None, :] > pos - window
            s = s.masked_fill(~allowed, float("-inf"))
            o = torch.softmax(s, dim=-1) @ v[:, None]  # [Hkv, G, c, D]
            out[q0 + c0 : q0 + c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, Hq, D).to(out.dtype)
    return out
