"""Qwen3-Next (Qwen3-Next-80B-A3B): gated DeltaNet layers interleaved with gated attention.

Layers follow `layer_types` ("linear_attention" | "full_attention"; older configs give
`full_attention_interval` instead, default 4: three DeltaNet layers, then one attention layer).
Linear attention: gated DeltaNet (engine/layers/gated_delta_net.py) whose checkpoint packs the
input projections per key head (in_proj_qkvz, in_proj_ba). Full attention: GQA whose q_proj
also emits a per-head output gate (attn * sigmoid(gate) before o_proj), zero-centred RMSNorm on
q and k heads, RoPE on the first `partial_rotary_factor` (0.25) of each head's dims.
MoE: softmax top-k (`norm_topk_prob`) plus a shared expert scaled by
sigmoid(shared_expert_gate(x)); dense layers per `mlp_only_layers` / `decoder_sparse_step`.
Every RMSNorm of the decoder is zero-centred: n * (1 + w) in fp32 (see layers/norm.py).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from freetoken_agent.engine.config import (
    ConfigDefaults,
    ConfigError,
    LinearAttentionSpec,
    ModelSpec,
    base_spec_fields,
    require,
)
from freetoken_agent.engine.layers.attention import AttentionOptions, SelfAttention
from freetoken_agent.engine.layers.gated_delta_net import DeltaNetOptions, GatedDeltaNet
from freetoken_agent.engine.layers.moe import RouterOptions
from freetoken_agent.engine.layers.norm import RMSNorm
from freetoken_agent.engine.layers.rope import RotaryEmbedding
from freetoken_agent.engine.models.base import Blueprint, MixerFactory
from freetoken_agent.engine.models.qwen3_moe import moe_layers
from freetoken_agent.engine.weights.names import (
    COMMON_NAMES,
    Ignore,
    dense_mlp_names,
    gated_delta_net_names,
    routed_expert_names,
    shared_expert_names,
)

CHECKPOINT_NAMES = (
    *COMMON_NAMES,
    *gated_delta_net_names(grouped=True),
    *routed_expert_names("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    *shared_expert_names("mlp"),
    *dense_mlp_names("mlp"),
    ("mtp.{*}", Ignore()),  # the multi-token-prediction head (speculative decoding): unused
)

LAYER_TYPES = ("linear_attention", "full_attention")

# Qwen3NextConfig's values for absent fields (its __post_init__ sets partial_rotary_factor 0.25).
DEFAULTS = ConfigDefaults(
    rope_theta=10000.0, rms_norm_eps=1e-6, partial_rotary_factor=0.25, head_dim=256
)


def layer_types(cfg: dict, n_layers: int) -> tuple[str, ...]:
    """`layer_types` as given, or transformers' rule from `full_attention_interval`."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [LAYER_TYPES[(i + 1) % interval == 0] for i in range(n_layers)]
    if len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"layer_types must list {n_layers} entries, each one of {', '.join(LAYER_TYPES)}; "
            f"got {types!r}"
        )
    return tuple(types)


def linear_spec(cfg: dict) -> LinearAttentionSpec:
    spec = LinearAttentionSpec(
        n_key_heads=int(require(cfg, "linear_num_key_heads")),
        n_value_heads=int(require(cfg, "linear_num_value_heads")),
        key_head_dim=int(require(cfg, "linear_key_head_dim")),
        value_head_dim=int(require(cfg, "linear_value_head_dim")),
        conv_kernel=int(require(cfg, "linear_conv_kernel_dim")),
    )
    if spec.n_value_heads % spec.n_key_heads or spec.conv_kernel < 2:
        raise ConfigError(
            "linear_num_value_heads must be a multiple of linear_num_key_heads and "
            f"linear_conv_kernel_dim at least 2; got {spec}"
        )
    return spec


def spec_from_config(cfg: dict) -> ModelSpec:
    base = base_spec_fields(cfg, DEFAULTS)
    n_experts = int(require(cfg, "num_experts"))
    return ModelSpec(
        **base,
        n_experts=n_experts,
        top_k=int(require(cfg, "num_experts_per_tok")),
        moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
        moe_layers=moe_layers(cfg, base["n_layers"], n_experts),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        shared_expert_intermediate_size=int(require(cfg, "shared_expert_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        layer_types=layer_types(cfg, base["n_layers"]),
        linear=linear_spec(cfg),
    )


def hybrid_mixer(attention: AttentionOptions, deltanet: DeltaNetOptions) -> MixerFactory:
    """Gated DeltaNet on the recurrent layers, attention on the others."""

    def mixer(spec: ModelSpec, layer: int, rope: RotaryEmbedding) -> nn.Module:
        if layer in spec.recurrent_layers:
            return GatedDeltaNet(spec, deltanet)
        return SelfAttention(spec, layer, attention, rope)

    return mixer


def hybrid_blueprint(spec: ModelSpec, deltanet: DeltaNetOptions) -> Blueprint:
    """What Qwen3-Next and Qwen3.5-MoE share: gated attention with zero-centred per-head
    norms, zero-centred decoder norms, Qwen's router."""
    bias = spec.attention_bias
    attention = AttentionOptions(
        qkv_bias=bias, o_bias=bias, qk_norm="head", output_gate=True, zero_centred_norm=True
    )
    return Blueprint(
        attention=attention,
        router=RouterOptions(top_k=spec.top_k, norm_topk_prob=spec.norm_topk_prob),
        mixer=hybrid_mixer(attention, deltanet),
        norm=partial(RMSNorm, zero_centred=True),
    )


def blueprint(spec: ModelSpec) -> Blueprint:
    return hybrid_blueprint(spec, DeltaNetOptions(grouped=True))
