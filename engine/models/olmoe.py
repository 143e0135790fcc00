"""OLMoE (OLMoE-1B-7B).

Attention: GQA with RMSNorm over the whole q and k projections (not per head) before the head
split, optional clamping of q/k/v to [-clip_qkv, clip_qkv], then RoPE. MoE: softmax top-k router,
renormalised when `norm_topk_prob`, weights rounded to the model dtype. Every layer is MoE.
"""

from __future__ import annotations

from freetoken_agent.engine.config import ConfigDefaults, ModelSpec, base_spec_fields, require
from freetoken_agent.engine.layers.attention import AttentionOptions
from freetoken_agent.engine.layers.moe import RouterOptions
from freetoken_agent.engine.models.base import Blueprint
from freetoken_agent.engine.weights.names import COMMON_NAMES, routed_expert_names

CHECKPOINT_NAMES = (
    *COMMON_NAMES,
    *routed_expert_names("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
)

# OlmoeConfig's values for absent fields.
DEFAULTS = ConfigDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, partial_rotary_factor=None)


def spec_from_config(cfg: dict) -> ModelSpec:
    base = base_spec_fields(cfg, DEFAULTS)
    clip = cfg.get("clip_qkv")
    return ModelSpec(
        **base,
        n_experts=int(require(cfg, "num_experts", "num_local_experts")),
        top_k=int(require(cfg, "num_experts_per_tok")),
        moe_intermediate_size=int(require(cfg, "intermediate_size")),
        moe_layers=tuple(range(base["n_layers"])),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        extra=(("clip_qkv", None if clip is None else float(clip)),),
    )


def blueprint(spec: ModelSpec) -> Blueprint:
    bias = spec.attention_bias
    return Blueprint(
        attention=AttentionOptions(
            qkv_bias=bias, o_bias=bias, qk_norm="proj", clip_qkv=spec.get("clip_qkv")
        ),
        router=RouterOptions(top_k=spec.top_k, norm_topk_prob=spec.norm_topk_prob),
    )
