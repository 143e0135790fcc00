"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Attention: GQA with q/k/v biases, no qk-norm. MoE: softmax top-k router (`norm_topk_prob`
optional) plus a shared expert whose output is scaled by sigmoid(shared_expert_gate(x)).
Sliding-window layers follow `layer_types` (or Qwen2's rule when it is absent).
"""

from __future__ import annotations

from freetoken_agent.engine.config import ConfigDefaults, ModelSpec, base_spec_fields, require
from freetoken_agent.engine.layers.attention import AttentionOptions
from freetoken_agent.engine.layers.moe import RouterOptions
from freetoken_agent.engine.models.base import Blueprint
from freetoken_agent.engine.models.qwen3_moe import moe_layers
from freetoken_agent.engine.weights.names import (
    COMMON_NAMES,
    Dense,
    dense_mlp_names,
    routed_expert_names,
)

CHECKPOINT_NAMES = (
    *COMMON_NAMES,
    *routed_expert_names("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    *dense_mlp_names("mlp.shared_expert"),
    (
        "model.layers.{L}.mlp.shared_expert_gate.weight",
        Dense("layers.{L}.mlp.shared_expert_gate.weight"),
    ),
    *dense_mlp_names("mlp"),
)

# Qwen2MoeConfig's values for absent fields (and below: sliding_window 4096, max_window_layers 28).
DEFAULTS = ConfigDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, partial_rotary_factor=None)


def sliding_windows(cfg: dict, n_layers: int) -> tuple[int, ...]:
    if not cfg.get("use_sliding_window"):
        return (0,) * n_layers
    window = int(cfg.get("sliding_window", 4096) or 0)
    types = cfg.get("layer_types") or [
        "sliding_attention"
        if (i + 1) % 2 and i < int(cfg.get("max_window_layers", 28))
        else "full_attention"
        for i in range(n_layers)
    ]
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def spec_from_config(cfg: dict) -> ModelSpec:
    base = base_spec_fields(cfg, DEFAULTS)
    n_experts = int(require(cfg, "num_experts", "num_local_experts"))
    return ModelSpec(
        **base,
        n_experts=n_experts,
        top_k=int(require(cfg, "num_experts_per_tok")),
        moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
        moe_layers=moe_layers(cfg, base["n_layers"], n_experts),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        shared_expert_intermediate_size=int(require(cfg, "shared_expert_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        attention_bias=bool(cfg.get("qkv_bias", True)),
        sliding_windows=sliding_windows(cfg, base["n_layers"]),
    )


def blueprint(spec: ModelSpec) -> Blueprint:
    return Blueprint(
        attention=AttentionOptions(qkv_bias=spec.attention_bias),
        router=RouterOptions(top_k=spec.top_k, norm_topk_prob=spec.norm_topk_prob),
    )
