"""An attention layer's front at decode: the input RMSNorm (after the residual add), the stacked
q/k/v projection, the per-head q/k norms, RoPE and the KV store. One launch for decode-sized
CUDA inputs (kernels/triton/norm_qkv.py, EngineConfig.fused_norm_qkv); otherwise the three
steps it fuses, each through its own dispatcher: kernels/norm.py's rms_norm, F.linear and
kernels/rope.py's qk_norm_rope_store (the twins on the CPU).

Shapes: x, residual, s [M, H]; norm_weight [H]; w_qkv [(Hq + 2 Hkv) * D, H]; positions,
slot_mapping [M] int64; cos, sin [max_pos, R]; q/k norm weights [D] or None; k_cache, v_cache
[P, PS, Hkv, D]; q [M, Hq, D].
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from freetoken_agent.kernels.dispatch import use_triton
from freetoken_agent.kernels.gemv import MAX_M
from freetoken_agent.kernels.norm import rms_norm
from freetoken_agent.kernels.rope import qk_norm_rope_store

MAX_H = 8192  # hidden sizes the one launch takes: each program holds a row in registers


def norm_qkv_rope(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    zero_centred: bool,
    w_qkv: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    qk_eps: float,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    scratch: tuple[Tensor, Tensor] | None = None,
    force_triton: bool = False,
) -> tuple[Tensor, Tensor]:
    """(q, s): s = round(x + residual) (x itself without a residual), h = rms_norm(s) *
    norm_weight (zero_centred: * (1 + norm_weight)), then q = qk_norm_rope_store(h @ w_qkv^T,
    ...) with k and v stored in the caches. `scratch`: kernels/triton/norm_qkv.py
    new_scratch's for this layer's shape."""
    rope_args = (positions, cos, sin, n_heads, n_kv_heads, head_dim, q_norm_weight,
                 k_norm_weight, qk_eps, k_cache, v_cache, slot_mapping)  # fmt: skip
    rows, hidden = x.shape
    if 0 < rows <= MAX_M and hidden <= MAX_H and use_triton(x, force_triton, "norm_qkv"):
        from freetoken_agent.kernels.triton.norm_qkv import head_tiles
        from freetoken_agent.kernels.triton.norm_qkv import norm_qkv_rope as triton_impl

        if head_tiles(head_dim, w_qkv.shape[0], hidden) is not None:
            return triton_impl(x, residual, norm_weight, eps, zero_centred, w_qkv, *rope_args,
                               scratch=scratch)  # fmt: skip
    if residual is None:
        h, s = rms_norm(x, norm_weight, eps, None, zero_centred, force_triton=force_triton), x
    else:
        h, s = rms_norm(x, norm_weight, eps, residual, zero_centred, force_triton=force_triton)
    qkv = F.linear(h, w_qkv)
    return qk_norm_rope_store(qkv, *rope_args, force_triton=force_triton), s
