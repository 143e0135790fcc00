"""Mixtral (8x7B, 8x22B).

Attention: plain GQA, no biases, no qk-norm; an optional sliding window on every layer.
MoE (`block_sparse_moe`; `mlp` in transformers 5's own saves): softmax over all experts,
top-k, always renormalised, and the weights stay fp32 (Mixtral does not round them to the
model dtype). Experts are w1 (gate), w3 (up), w2 (down). Every layer is MoE.
"""

from __future__ import annotations

from freetoken_agent.engine.config import ConfigDefaults, ModelSpec, base_spec_fields, require
from freetoken_agent.engine.layers.attention import AttentionOptions
from freetoken_agent.engine.layers.moe import RouterOptions
from freetoken_agent.engine.models.base import Blueprint
from freetoken_agent.engine.weights.names import COMMON_NAMES, routed_expert_names

CHECKPOINT_NAMES = (
    *COMMON_NAMES,
    *routed_expert_names("block_sparse_moe", gate="w1", up="w3", down="w2"),
    # transformers 5's own layout (save_pretrained(save_original_format=False)): the block
    # renamed `mlp`, its experts fused
    *routed_expert_names("mlp", gate="w1", up="w3", down="w2"),
)

# MixtralConfig's values for absent fields (default_theta, rms_norm_eps).
DEFAULTS = ConfigDefaults(rope_theta=1e6, rms_norm_eps=1e-5, partial_rotary_factor=None)


def spec_from_config(cfg: dict) -> ModelSpec:
    base = base_spec_fields(cfg, DEFAULTS)
    window = int(cfg.get("sliding_window") or 0)
    return ModelSpec(
        **base,
        n_experts=int(require(cfg, "num_local_experts", "num_experts")),
        top_k=int(require(cfg, "num_experts_per_tok")),
        moe_intermediate_size=int(require(cfg, "intermediate_size")),
        moe_layers=tuple(range(base["n_layers"])),
        norm_topk_prob=True,
        sliding_windows=(window,) * base["n_layers"],
    )


def blueprint(spec: ModelSpec) -> Blueprint:
    return Blueprint(
        attention=AttentionOptions(),
        router=RouterOptions(top_k=spec.top_k, norm_topk_prob=True, weights_in_model_dtype=False),
    )
