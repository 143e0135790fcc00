"""The decoder-only MoE transformer that the supported families share.

A family file (qwen3_moe.py, mixtral.py, ...) states what is particular to it: how its config
reads, its attention and router options (a `Blueprint`), and its checkpoint-name table. Hybrid
families (qwen3_next, ...) also name the token mixer of each layer (attention or a recurrent
layer, per `spec.layer_types`) and their norm. This file reads top to bottom like the
architecture figure: decoder layer, model, head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from freetoken_agent.engine.config import ModelSpec
from freetoken_agent.engine.layers.attention import (
    ATTENTION_BLOCK_ROWS,
    FUSED_NORM_QKV_ROWS,
    AttentionMetadata,
    AttentionOptions,
    SelfAttention,
)
from freetoken_agent.engine.layers.embedding import TokenEmbedding
from freetoken_agent.engine.layers.linear import Linear
from freetoken_agent.engine.layers.mlp import SwiGLU
from freetoken_agent.engine.layers.moe import ExpertBank, RouterOptions, SparseMoeBlock
from freetoken_agent.engine.layers.norm import RMSNorm
from freetoken_agent.engine.layers.recurrent import RecurrentStateView
from freetoken_agent.engine.layers.rope import RotaryEmbedding
from freetoken_agent.kernels.proj_norm import proj_add_norm

# T tokens of the step (flattened over sequences), H hidden, V vocab, N rows to score


# (spec, decoder layer, shared rope table) -> the layer's token mixer, called as mixer(x, meta)
MixerFactory = Callable[[ModelSpec, int, RotaryEmbedding], nn.Module]
NormFactory = Callable[[int, float], nn.Module]  # (size, eps) -> a norm with RMSNorm's call


@dataclass(slots=True, frozen=True)
class Blueprint:
    """The per-family choices inside the shared skeleton."""

    attention: AttentionOptions
    router: RouterOptions
    # None: every layer's mixer is SelfAttention(attention). Hybrids build attention for the
    # layers in spec.attention_layers and their recurrent layer for spec.recurrent_layers.
    mixer: MixerFactory | None = None
    norm: NormFactory = RMSNorm  # decoder and final norms (zero-centred for Qwen3-Next)


# The fused o_proj + add + norm (EngineConfig.fused_proj_norm) runs steps of at most this many
# rows: on the H200 host, 48 layers all resident, b=1 decode gained 2.6% with it, b=4 lost 2.4%.
FUSED_PROJ_NORM_ROWS = 1


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is attention or a recurrent layer,
    mlp the MoE block or a dense SwiGLU. The residual adds are fused into the following norms."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        blueprint: Blueprint,
        bank: ExpertBank,
        rope: RotaryEmbedding,
    ) -> None:
        super().__init__()
        norm = blueprint.norm
        self.input_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        if blueprint.mixer is None:
            mixer = SelfAttention(spec, layer, blueprint.attention, rope)
        else:
            mixer = blueprint.mixer(spec, layer, rope)
        # Named as the checkpoints name them: self_attn, or linear_attn for recurrent layers.
        self.recurrent = layer in spec.recurrent_layers
        if self.recurrent:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        # EngineConfig.fused_proj_norm (use_fused_proj_norm): o_proj and this norm in one
        # launch at decode; its partials' scratch is made at the first CUDA step.
        self.fused_proj_norm = False
        self._proj_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # EngineConfig.fused_norm_qkv (use_fused_norm_qkv): this norm inside attention's
        # first launch at decode (SelfAttention.attend_unnormed).
        self.fused_norm_qkv = False
        # EngineConfig.attention_block (use_attention_block): both norms and everything
        # between them in one launch at decode (SelfAttention.block).
        self.attention_block = False
        if layer in spec.moe_layers:
            self.mlp: nn.Module = SparseMoeBlock(
                spec.hidden_size,
                spec.n_experts,
                spec.moe_index(layer),
                bank,
                blueprint.router,
                spec.shared_expert_intermediate_size,
            )
        else:
            self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the add is
        fused into this layer's first norm). Returns (this layer's output, residual stream)."""
        rows = x.shape[0]
        if self.attention_block and rows == ATTENTION_BLOCK_ROWS:  # norm to norm, one launch
            h, residual = self.self_attn.block(x, residual, self.input_layernorm,
                                               self.post_attention_layernorm, meta)  # fmt: skip
            return self.mlp(h), residual
        if self.fused_norm_qkv and rows <= FUSED_NORM_QKV_ROWS:  # the norm inside attention
            out, residual = self.self_attn.attend_unnormed(x, residual, self.input_layernorm,
                                                           meta)  # fmt: skip
        else:
            if residual is None:
                residual, h = x, self.input_layernorm(x)
            else:
                h, residual = self.input_layernorm(x, residual)
            if self.recurrent:
                h, residual = self.post_attention_layernorm(self.linear_attn(h, meta), residual)
                return self.mlp(h), residual
            out = self.self_attn.attend(h, meta)  # [T, Hq * D], before o_proj
        if self.fused_proj_norm and rows <= FUSED_PROJ_NORM_ROWS:  # o_proj, add, norm
            h, residual = self._proj_norm(out, residual)
        else:
            h, residual = self.post_attention_layernorm(self.self_attn.o_proj(out), residual)
        return self.mlp(h), residual

    def _proj_norm(
        self, out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """post_attention_layernorm(o_proj(out), residual) through kernels/proj_norm.py (one
        launch for decode-sized CUDA steps), with this layer's own scratch."""
        norm, weight = self.post_attention_layernorm, self.self_attn.o_proj.weight
        if self._proj_scratch is None and out.is_cuda:
            from freetoken_agent.kernels.triton.proj_norm import new_scratch

            self._proj_scratch = new_scratch(weight.shape[0], weight.shape[1], out.device)
        return proj_add_norm(out, weight, residual, norm.weight, norm.eps, norm.zero_centred,
                             scratch=self._proj_scratch)  # fmt: skip


def use_fused_proj_norm(model: nn.Module, on: bool = True) -> None:
    """EngineConfig.fused_proj_norm: every attention layer whose o_proj has no bias and whose
    post-attention norm is an RMSNorm fuses the two (kernels/proj_norm.py); `on` False
    switches them back (captured graphs keep the kernels they were captured with)."""
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and not layer.recurrent:
            attn, norm = layer.self_attn, layer.post_attention_layernorm
            fusable = attn.o_proj.bias is None and isinstance(norm, RMSNorm)
            layer.fused_proj_norm = on and fusable


def use_fused_norm_qkv(model: nn.Module, on: bool = True) -> None:
    """EngineConfig.fused_norm_qkv: every attention layer whose input norm is an RMSNorm and
    whose front the fused kernel serves (SelfAttention.fusable_front) runs its input norm,
    q/k/v projection, q/k norms, RoPE and KV store in one launch at decode
    (kernels/norm_qkv.py); `on` False switches them back (captured graphs keep the kernels they
    were captured with)."""
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and not layer.recurrent:
            fusable = isinstance(layer.input_layernorm, RMSNorm) and layer.self_attn.fusable_front()
            layer.fused_norm_qkv = on and fusable


def use_attention_block(model: nn.Module, on: bool = True) -> None:
    """EngineConfig.attention_block: every attention layer whose norms are RMSNorms (not
    zero-centred) and whose block the kernel serves (SelfAttention.block_fits) runs its
    one-row decode steps from the input norm to the post-attention norm in one launch
    (kernels/attention_block.py); `on` False switches them back (captured graphs keep the
    kernels they were captured with)."""
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and not layer.recurrent:
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            plain = all(isinstance(n, RMSNorm) and not n.zero_centred for n in norms)
            layer.attention_block = on and plain and layer.self_attn.block_fits()


class MoeCausalLM(nn.Module):
    """token ids [T] -> hidden [T, H]; `compute_logits` turns chosen rows into [N, V] fp32."""

    def __init__(
        self,
        spec: ModelSpec,
        blueprint: Blueprint,
        bank: ExpertBank | None,
        max_positions: int,
        dtype: torch.dtype,
        embed_on_host: bool = False,
    ) -> None:
        """`embed_on_host`: the token embedding table lives in host memory
        (layers/embedding.py; untied tables only)."""
        super().__init__()
        self.spec = spec
        assert not (embed_on_host and spec.tie_word_embeddings), "a tied table is the LM head"
        self.embed_tokens = TokenEmbedding(spec.vocab_size, spec.hidden_size, embed_on_host)
        # One table shared by every layer: built once, not per layer.
        self.rope = RotaryEmbedding(spec, max_positions, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, blueprint, bank, self.rope) for i in range(spec.n_layers)
        )
        self.expert_bank = bank
        self.norm = blueprint.norm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def set_expert_bank(self, bank: ExpertBank) -> None:
        """Point every MoE block at `bank` (chosen after the dense weights are allocated, since
        the budget left for experts depends on them)."""
        self.expert_bank = bank
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp._bank = bank

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Point every attention layer at its slice of the pool ([L, P, S, Hkv, D] each, L the
        attention layers: slice j belongs to decoder layer spec.attention_layers[j])."""
        layers = self.spec.attention_layers
        assert k_cache.shape[0] == v_cache.shape[0] == len(layers), (k_cache.shape, layers)
        for j, i in enumerate(layers):
            self.layers[i].self_attn.k_cache = k_cache[j]
            self.layers[i].self_attn.v_cache = v_cache[j]

    def bind_recurrent_state(self, views: list[RecurrentStateView]) -> None:
        """Point every recurrent layer at its state and checkpoint slices: views[j] belongs to
        decoder layer spec.recurrent_layers[j]."""
        layers = self.spec.recurrent_layers
        if len(views) != len(layers):
            raise ValueError(f"{len(views)} state views for {len(layers)} recurrent layers")
        for i, view in zip(layers, views, strict=True):
            self.layers[i].linear_attn.state = view

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [N, V]
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
