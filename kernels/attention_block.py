"""A one-token decode step's attention block: (h, s) = post_norm(o_proj(attention(rope(qk_norm(
in_norm(x, residual) @ w_qkv^T)))), s_in), the K/V stored: the persistent Triton kernel on CUDA
(kernels/triton/attention_block.py, EngineConfig.attention_block), its three phases as launches
in Triton's interpreter with force_triton (tests), and otherwise the decoder's five steps
(the norm, the projection, kernels/rope.py, kernels/paged_attention.py, kernels/proj_norm.py),
which the kernel's results match within the sums' order.

Shapes: x, residual [1, H]; w_qkv [(NQ + 2 NKV) D, H]; w_o [H, NQ D]; norms [H]; q/k norms [D]
or None; cos, sin [max_pos, R]; positions [1] int64; kv_lens [1] int32 (with the new token);
slot_mapping [1] int64; page_table [1, max_pages] int32; k_cache, v_cache [pages, S, NKV, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken_agent.kernels.dispatch import use_triton
from freetoken_agent.kernels.norm import rms_norm
from freetoken_agent.kernels.paged_attention import paged_attention
from freetoken_agent.kernels.proj_norm import proj_add_norm
from freetoken_agent.kernels.rope import qk_norm_rope_store

COUNT_WORDS = 4  # the kernel's counters before the kv heads' (kernels/triton/attention_block.py)
MIN_SPLIT = 128  # cached positions a split takes at least (1024 tokens: 8 splits a kv head)
MAX_SPLITS = 32  # splits a kv head at most (NKV x this <= the programs)
# The tiles measured best on the H200 (bench attention-half, thirty-ninth session): qkv 32
# rows x a quarter of H, o_proj 32 rows x a quarter of NQ D, 512-wide steps, 4 warps.
TILES = dict(BN1=32, KS1=4, BK=512, BL=64, BN3=32, KS3=4, WARPS=4)


def block_tiles(h: int, heads: int, kv_heads: int, head_dim: int,
                tiles: dict[str, int] | None = None) -> dict[str, int] | None:  # fmt: skip
    """TILES (with `tiles`' overrides) for this shape, each halved until it fits: row blocks
    dividing their dimension (down to 16, the dot's least), K slices of whole 16-wide steps,
    the step dividing both slices. None where the kernel cannot take the shape: a head dim not
    a power of two, more than 16 q heads a kv head, no fit."""
    if head_dim & (head_dim - 1) or heads % kv_heads or heads > 16 * kv_heads:
        return None
    t = {**TILES, **(tiles or {})}
    nqkv, nqd = (heads + 2 * kv_heads) * head_dim, heads * head_dim
    for key, n in (("BN1", nqkv), ("BN3", h)):
        while t[key] > 16 and n % t[key]:
            t[key] //= 2
        if n % t[key]:
            return None
    for ks, k in (("KS1", h), ("KS3", nqd)):  # slices of whole 16-wide steps
        while t[ks] > 1 and (k % t[ks] or (k // t[ks]) % 16):
            t[ks] //= 2
        if k % t[ks] or (k // t[ks]) % 16:
            return None
    while (h // t["KS1"]) % t["BK"] or (nqd // t["KS3"]) % t["BK"]:
        t["BK"] //= 2  # stops at 16 at the latest
    return t


def splits_for(kv_heads: int, programs: int) -> int:
    """Splits a kv head at most: every attention program one of the grid's (NKV x NS <= P)."""
    return max(1, min(MAX_SPLITS, programs // kv_heads))


def attention_block(
    x: Tensor,
    residual: Tensor | None,
    in_norm: Tensor,
    eps: float,
    w_qkv: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    qk_eps: float,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    kv_lens: Tensor,
    slot_mapping: Tensor,
    page_table: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    w_o: Tensor,
    post_norm: Tensor,
    heads: int,
    scale: float,
    *,
    scratch: tuple[Tensor, ...] | None = None,
    tiles: dict[str, int] | None = None,
    force_triton: bool = False,
) -> tuple[Tensor, Tensor]:
    """(h, s): the normalised row the MoE block takes and the residual stream after the
    attention block. `scratch` and `tiles`: kernels/triton/attention_block.py new_scratch's and
    block_tiles' for this layer (the kernel runs only with both; without, the five steps)."""
    if scratch is not None and tiles is not None and use_triton(x, force_triton, "attention"):
        from freetoken_agent.kernels.triton.attention_block import attention_block as triton_impl

        return triton_impl(x, residual, in_norm, eps, w_qkv, q_norm, k_norm, qk_eps, cos, sin,
                           positions, kv_lens, slot_mapping, page_table[0], k_cache, v_cache,
                           w_o, post_norm, heads, scale, scratch, tiles,
                           persistent=x.is_cuda)  # fmt: skip
    ft = dict(force_triton=force_triton)
    if residual is None:
        h, s = rms_norm(x, in_norm, eps, **ft), x
    else:
        h, s = rms_norm(x, in_norm, eps, residual, **ft)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    qkv = F.linear(h, w_qkv)
    q = qk_norm_rope_store(qkv, positions, cos, sin, heads, kv_heads, head_dim, q_norm, k_norm,
                           qk_eps, k_cache, v_cache, slot_mapping, **ft)  # fmt: skip
    cu_q_lens = torch.tensor([0, 1], dtype=torch.int32, device=x.device)
    out = paged_attention(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale, 1, **ft)
    return proj_add_norm(out.reshape(1, -1), w_o, s, post_norm, eps, **ft)
