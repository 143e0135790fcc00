"""Self-attention over the paged KV cache.

Projections and norms are the model's; the attention itself reads K/V from pages through
`kernels.paged_attention` (Triton on CUDA, the plain-torch twin on the CPU). The same call serves
prefill chunks with a cached prefix, decodes and mixed batches, so the model never branches on
the phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken_agent.engine.config import ModelSpec
from freetoken_agent.engine.l2_prefetcher import PREFETCH_ROWS, L2Prefetcher
from freetoken_agent.engine.layers.linear import Linear, ShardedLinear
from freetoken_agent.engine.layers.norm import RMSNorm
from freetoken_agent.engine.layers.recurrent import RecurrentMetadata
from freetoken_agent.engine.layers.rope import RotaryEmbedding
from freetoken_agent.kernels.attention_block import attention_block, block_tiles
from freetoken_agent.kernels.l2_prefetch import prefetch_tensor
from freetoken_agent.kernels.norm_qkv import norm_qkv_rope
from freetoken_agent.kernels.paged_attention import paged_attention, store_kv
from freetoken_agent.kernels.rope import qk_norm_rope_store

# The fused input norm + q/k/v projection + q/k norms + RoPE + KV store
# (EngineConfig.fused_norm_qkv, SelfAttention.attend_unnormed) runs steps of at most this many
# rows (the decoder layer sends it no others).
FUSED_NORM_QKV_ROWS = 1
# The attention block in one launch (EngineConfig.attention_block, SelfAttention.block) runs
# steps of exactly this many rows (one sequence's decode token).
ATTENTION_BLOCK_ROWS = 1

# T tokens in the step (all sequences, flattened), B sequences, P pages, S page size,
# Hq / Hkv query / key-value heads, D head_dim, H hidden


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of a step sits in the KV cache. Built by ModelRunner per step; read by
    every attention layer of the forward."""

    positions: torch.Tensor  # [T] int64 absolute positions
    slot_mapping: torch.Tensor  # [T] int64 page * S + offset, where each new K/V goes
    page_table: torch.Tensor  # [B, max_pages] int32
    cu_q_lens: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32, KV length including this step's tokens
    max_q_len: int
    max_kv_len: int
    # Hybrid models: what the recurrent layers read (state slots, snapshots); None otherwise.
    recurrent: RecurrentMetadata | None = None


@dataclass(slots=True, frozen=True)
class AttentionOptions:
    """What differs between families' attention blocks; chosen by the model file."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # None | "head" (per head, Qwen3) | "proj" (whole projection, OLMoE)
    clip_qkv: float | None = None  # OLMoE clamps q, k, v to [-c, c]
    # Qwen3-Next / Qwen3.5: q_proj emits [query, gate] per head (2 * D rows each); the output
    # is attn * sigmoid(gate) before o_proj.
    output_gate: bool = False
    zero_centred_norm: bool = False  # q/k norms scale by (1 + w) (see layers/norm.py)


class SelfAttention(nn.Module):
    def __init__(
        self, spec: ModelSpec, layer: int, options: AttentionOptions, rope: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        q_size, kv_size = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
        q_rows = 2 * q_size if options.output_gate else q_size  # per head [query, gate]
        self.qkv_proj = ShardedLinear(
            spec.hidden_size, {"q": q_rows, "k": kv_size, "v": kv_size}, bias=options.qkv_bias
        )
        self.o_proj = Linear(q_size, spec.hidden_size, bias=options.o_bias)
        self.options = options
        eps, zc = spec.rms_norm_eps, options.zero_centred_norm
        if options.qk_norm == "head":
            self.q_norm = RMSNorm(spec.head_dim, eps, zc)
            self.k_norm = RMSNorm(spec.head_dim, eps, zc)
        elif options.qk_norm == "proj":
            self.q_norm = RMSNorm(q_size, eps, zc)
            self.k_norm = RMSNorm(kv_size, eps, zc)
        self.rope = rope
        # Per-head norms (or none) run fused with RoPE and the KV store in one kernel. The
        # kernel handles partial rotary dims, but neither (1 + w) norms nor the gate rows
        # interleaved into q: those families take the unfused path.
        self.fused_qk = (
            options.qk_norm in (None, "head")
            and options.clip_qkv is None
            and not options.output_gate
            and not options.zero_centred_norm
        )
        self.scale = spec.head_dim**-0.5
        self.window = spec.window(layer)
        self.k_cache: torch.Tensor | None = None  # [P, S, Hkv, D], bound by the runner
        self.v_cache: torch.Tensor | None = None
        # This layer's own counters for combining split-KV partials in the attention kernel
        # (kernels/triton/paged_attention.py new_counters; made at its first CUDA call).
        self._counters: torch.Tensor | None = None
        # EngineConfig.l2_prefetch (use_l2_prefetch): the model's prefetcher, or None.
        self.l2: L2Prefetcher | None = None
        # attend_unnormed's scratch (kernels/triton/norm_qkv.py new_scratch, made at its first
        # CUDA call) for steps of up to FUSED_NORM_QKV_ROWS rows.
        self._front_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # block's scratch and tiles (kernels/triton/attention_block.py new_scratch,
        # block_tiles), made at its first CUDA call.
        self._block: tuple[tuple[torch.Tensor, ...], dict[str, int]] | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(x, meta))

    def attend(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything before o_proj: [T, Hq * D] (the decoder layer may fuse o_proj with the
        norm after it: kernels/proj_norm.py)."""
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D], or [T, (2 Hq + 2 Hkv) * D] with a gate
        prefetch = self._start_prefetch(x.shape[0])
        gate = None
        if self.fused_qk:  # q [T, Hq, D]; k and v are in the cache
            q = qk_norm_rope_store(qkv, *self._rope_args(meta))
        else:
            q, gate = self._project_unfused(qkv, meta)
        return self._attend_queries(q, gate, meta, prefetch)

    def attend_unnormed(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attend(h), s) with h, s = norm(x, residual) (s = x without a residual): the norm,
        the q/k/v projection, the q/k norms, RoPE and the KV store in one launch for
        decode-sized CUDA steps (kernels/norm_qkv.py; the decoder layer calls it where
        `fusable_front` holds)."""
        if self._front_scratch is None and x.is_cuda:
            from freetoken_agent.kernels.triton.norm_qkv import head_tiles, new_scratch

            heads, h = self.n_heads + 2 * self.n_kv_heads, x.shape[1]
            if head_tiles(self.head_dim, heads * self.head_dim, h) is not None:
                self._front_scratch = new_scratch(heads, self.head_dim, h,
                                                  FUSED_NORM_QKV_ROWS, x.device)  # fmt: skip
        scratch = self._front_scratch if x.shape[0] <= FUSED_NORM_QKV_ROWS else None
        q, s = norm_qkv_rope(x, residual, norm.weight, norm.eps, norm.zero_centred,
                             self.qkv_proj.weight, *self._rope_args(meta),
                             scratch=scratch)  # fmt: skip
        # q [T, Hq, D]; k and v are in the cache
        return self._attend_queries(q, None, meta, self._start_prefetch(x.shape[0])), s

    def block(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        in_norm: RMSNorm,
        post_norm: RMSNorm,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """post_norm(o_proj(attend(h)), s) with h, s = in_norm(x, residual): (the MoE block's
        input, the residual stream), for one-row steps (the decoder layer calls it where
        `block_fits` holds): one persistent launch on CUDA (kernels/attention_block.py), the
        five steps elsewhere."""
        assert x.shape[0] == ATTENTION_BLOCK_ROWS, x.shape
        if self._block is None and x.is_cuda:
            from freetoken_agent.kernels.triton.attention_block import new_scratch

            tiles = block_tiles(x.shape[1], self.n_heads, self.n_kv_heads, self.head_dim)
            assert tiles is not None, "block_fits let a layer through that the kernel cannot take"
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            scratch = new_scratch(x.shape[1], self.n_heads, self.n_kv_heads, self.head_dim, sms,
                                  tiles, x.dtype, x.device)  # fmt: skip
            self._block = (scratch, tiles)
        qk = self.options.qk_norm == "head"
        scratch, tiles = self._block if self._block is not None else (None, None)
        return attention_block(
            x, residual, in_norm.weight, in_norm.eps, self.qkv_proj.weight,
            self.q_norm.weight if qk else None, self.k_norm.weight if qk else None,
            self.q_norm.eps if qk else 0.0, self.rope.cos, self.rope.sin, meta.positions,
            meta.kv_lens, meta.slot_mapping, meta.page_table, self.k_cache, self.v_cache,
            self.o_proj.weight, post_norm.weight, self.n_heads, self.scale,
            scratch=scratch, tiles=tiles,
        )  # fmt: skip

    def block_fits(self) -> bool:
        """Whether `block` can serve this layer: `fusable_front`'s cases, no o_proj bias, full
        attention (no window), and a shape the kernel takes (block_tiles)."""
        fits = block_tiles(self.qkv_proj.in_features, self.n_heads, self.n_kv_heads,
                           self.head_dim) is not None  # fmt: skip
        return self.fusable_front() and self.o_proj.bias is None and not self.window and fits

    def _rope_args(self, meta: AttentionMetadata) -> tuple:
        """What the fused q/k norm + RoPE + KV store takes after the projection
        (kernels/rope.py qk_norm_rope_store; kernels/norm_qkv.py after its own)."""
        qk = self.options.qk_norm == "head"  # else none (the fused kernel's two cases)
        return (meta.positions, self.rope.cos, self.rope.sin, self.n_heads, self.n_kv_heads,
                self.head_dim, self.q_norm.weight if qk else None,
                self.k_norm.weight if qk else None, self.q_norm.eps if qk else 0.0,
                self.k_cache, self.v_cache, meta.slot_mapping)  # fmt: skip

    def fusable_front(self) -> bool:
        """Whether `attend_unnormed` can serve this layer: per-head q/k norms or none (the
        fused rope kernel's cases) and no q/k/v bias."""
        return self.fused_qk and self.qkv_proj.bias is None

    def _start_prefetch(self, t: int) -> bool:
        """o_proj's weight into L2 beside RoPE and attention (EngineConfig.l2_prefetch), for
        steps of few rows; whether it started."""
        prefetch = self.l2 is not None and t <= PREFETCH_ROWS
        if prefetch:
            self.l2.start(prefetch_tensor, self.o_proj.weight)
        return prefetch

    def _attend_queries(
        self, q: torch.Tensor, gate: torch.Tensor | None, meta: AttentionMetadata, prefetch: bool
    ) -> torch.Tensor:
        """q [T, Hq, D] over the cache (k and v stored), times the output gate if any:
        [T, Hq * D]."""
        out = self._attend(q, meta).reshape(q.shape[0], -1)  # [T, Hq * D]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        if prefetch:
            self.l2.join(out.device)
        return out

    def _project_unfused(
        self, qkv: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Norms over whole projections, clamping (OLMoE), (1 + w) norms and output gates
        (Qwen3-Next) stay plain torch ops. Returns q [T, Hq, D] and the gate [T, Hq * D]."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)  # [T, Hq*D] (or [T, Hq*2D]), [T, Hkv*D], [T, Hkv*D]
        gate = None
        if self.options.output_gate:
            q, gate = q.view(t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(t, -1)  # [T, Hq * D]
        if self.options.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.options.clip_qkv is not None:
            c = self.options.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.reshape(t, self.n_heads, self.head_dim)
        k = k.reshape(t, self.n_kv_heads, self.head_dim)
        v = v.reshape(t, self.n_kv_heads, self.head_dim)
        if self.options.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(meta.positions, q, k)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return q.contiguous(), gate

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self._counters is None and q.is_cuda:
            from freetoken_agent.kernels.triton.paged_attention import new_counters

            self._counters = new_counters(q.device)
        return paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.page_table,
            meta.cu_q_lens,
            meta.kv_lens,
            self.scale,
            meta.max_q_len,
            window=self.window,
            max_kv_len=meta.max_kv_len,
            counters=self._counters,
        )  # [T, Hq, D]
