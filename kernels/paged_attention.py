"""Paged attention entry points: the Triton kernel on CUDA tensors, the torch reference otherwise.

Shapes (legend of `kernels/reference.py`): q / out [T, Hq, D]; k_cache, v_cache [P, S, Hkv, D];
page_table [B, max_pages] int32; cu_q_lens [B + 1] int32; kv_lens [B] int32.
"""

from __future__ import annotations

from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.dispatch import use_triton

# store_kv is plain torch on every device (index_copy_ is graph-capturable): one implementation.
store_kv = reference.store_kv


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
    force_triton: bool = False,
    counters: Tensor | None = None,
) -> Tensor:
    """Causal (window > 0: sliding-window) attention of a varlen batch over a paged KV cache.

    See `reference.paged_attention` for the contract. CUDA tensors run the Triton kernel (no
    host synchronisation, CUDA-graph safe); CPU tensors run the reference, or, with
    force_triton, the Triton kernel under TRITON_INTERPRET=1 (tests). counters: the caller's
    own kernels/triton/paged_attention.py `new_counters` buffer for the Triton kernel (split
    launches then combine in their last programs, without a second launch).
    """
    args = (q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale, max_q_len, window, out)
    if not use_triton(q, force_triton, "paged_attention"):
        return reference.paged_attention(*args, max_kv_len)
    # Imported here so the CPU fallback works on machines without triton.
    from freetoken_agent.kernels.triton.paged_attention import paged_attention as triton_impl

    return triton_impl(*args, max_kv_len, counters)
