"""Fused per-head q/k RMSNorm + RoPE + KV-cache store entry point: the Triton kernel on CUDA
tensors, the plain-torch twin otherwise.

Shapes (legend of `kernels/reference.py`): qkv [T, (Hq + 2 * Hkv) * D]; positions,
slot_mapping [T] int64; cos, sin [max_pos, R]; q_norm_weight, k_norm_weight [D] or None;
k_cache, v_cache [P, S, Hkv, D]; returns q [T, Hq, D].
"""

from __future__ import annotations

from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.dispatch import use_triton


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
    *,
    force_triton: bool = False,
) -> Tensor:
    """Norm (optional) and rotate q and k per head, store k and v at slot_mapping, return q.

    See `reference.qk_norm_rope_store` for the contract. CUDA tensors run the Triton
    kernel (no host synchronisation, CUDA-graph safe); CPU tensors run the twin, or, with
    force_triton, the Triton kernel under TRITON_INTERPRET=1 (tests).
    """
    args = (qkv, positions, cos, sin, n_heads, n_kv_heads, head_dim, q_norm_weight,
            k_norm_weight, eps, k_cache, v_cache, slot_mapping)  # fmt: skip
    if not use_triton(qkv, force_triton, "qk_norm_rope_store"):
        return reference.qk_norm_rope_store(*args)
    # Imported here so the CPU fallback works on machines without triton.
    from freetoken_agent.kernels.triton.rope import qk_norm_rope_store as triton_impl

    return triton_impl(*args)
