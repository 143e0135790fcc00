"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B).

Attention: GQA with RMSNorm on each head of q and k (before RoPE), no biases by default.
MoE: softmax router over all experts, top-k, renormalised when `norm_topk_prob`; routing weights
rounded to the model dtype. Layers outside `mlp_only_layers` on the `decoder_sparse_step` grid are
MoE; the rest are dense SwiGLU.
"""

from __future__ import annotations

from freetoken_agent.engine.config import ConfigDefaults, ModelSpec, base_spec_fields, require
from freetoken_agent.engine.layers.attention import AttentionOptions
from freetoken_agent.engine.layers.moe import RouterOptions
from freetoken_agent.engine.models.base import Blueprint
from freetoken_agent.engine.weights.names import COMMON_NAMES, dense_mlp_names, routed_expert_names

CHECKPOINT_NAMES = (
    *COMMON_NAMES,
    *routed_expert_names("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    *dense_mlp_names("mlp"),
)

# Qwen3MoeConfig's values for absent fields (and below: sliding_window 4096).
DEFAULTS = ConfigDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, partial_rotary_factor=None)


def moe_layers(cfg: dict, n_layers: int, n_experts: int) -> tuple[int, ...]:
    """Qwen's rule: MoE where (layer + 1) is a multiple of decoder_sparse_step, unless listed in
    mlp_only_layers."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    if n_experts == 0:
        return ()
    return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)


def spec_from_config(cfg: dict) -> ModelSpec:
    base = base_spec_fields(cfg, DEFAULTS)
    n_experts = int(require(cfg, "num_experts", "num_local_experts"))
    window = int(cfg.get("sliding_window", 4096) or 0) if cfg.get("use_sliding_window") else 0
    return ModelSpec(
        **base,
        n_experts=n_experts,
        top_k=int(require(cfg, "num_experts_per_tok")),
        moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
        moe_layers=moe_layers(cfg, base["n_layers"], n_experts),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_windows=(window,) * base["n_layers"],
    )


def blueprint(spec: ModelSpec) -> Blueprint:
    bias = spec.attention_bias
    return Blueprint(
        attention=AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm="head"),
        router=RouterOptions(top_k=spec.top_k, norm_topk_prob=spec.norm_topk_prob),
    )
