"""Qwen3.5-MoE / Qwen3.6-MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B): Qwen3-Next's hybrid layout.

The text model is Qwen3-Next's (engine/models/qwen3_next.py): gated DeltaNet and gated full
attention per `layer_types`, zero-centred norms, softmax top-k routing (always renormalised)
plus a sigmoid-gated shared expert on every layer. Differences:
- the DeltaNet input projections are stored apart (in_proj_qkv, in_proj_z, in_proj_b,
  in_proj_a), not grouped per key head;
- the released repos are multimodal (model_type "qwen3_5_moe"): the text config sits under
  `text_config`, the text weights under `model.language_model.`, beside a vision tower
  (`model.visual.`) and a multi-token-prediction head (`mtp.`), both ignored here. The
  text-only class (model_type "qwen3_5_moe_text") saves `model.layers.`; both load.
- RoPE is multimodal (`mrope_section`, interleaved): transformers tabulates cos/sin for the
  temporal, height and width position ids and, per frequency index i, takes height's for
  i % 3 == 1 and width's for i % 3 == 2 (i < 3 * section), temporal's otherwise
  (Qwen3_5MoeTextRotaryEmbedding.recomposition_frequencies). For text, the three ids are the
  same position (Qwen3_5MoeTextModel.forward expands one arange to all of them), so every
  index reads the same table: ordinary RoPE on the rotary dims, which is what we run.
"""

from __future__ import annotations

from freetoken_agent.engine.config import ConfigDefaults, ModelSpec, base_spec_fields, require
from freetoken_agent.engine.layers.gated_delta_net import DeltaNetOptions
from freetoken_agent.engine.models.base import Blueprint
from freetoken_agent.engine.models.qwen3_next import hybrid_blueprint, layer_types, linear_spec
from freetoken_agent.engine.weights.names import (
    COMMON_NAMES,
    Ignore,
    gated_delta_net_names,
    renamed_prefix,
    routed_expert_names,
    shared_expert_names,
)

_TEXT_NAMES = (
    *COMMON_NAMES,
    *gated_delta_net_names(grouped=False),
    *routed_expert_names("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    *shared_expert_names("mlp"),
)
CHECKPOINT_NAMES = (
    *_TEXT_NAMES,  # text-only checkpoints: model.layers.{L}...
    *renamed_prefix(_TEXT_NAMES, "model.", "model.language_model."),  # multimodal ones
    ("model.visual.{*}", Ignore()),  # the vision tower: text-only serving
    ("mtp.{*}", Ignore()),  # the multi-token-prediction head (speculative decoding): unused
)

# Settings of the multimodal wrapper that apply to its text model (transformers reads them from
# the top-level config: e.g. tie_word_embeddings decides whether lm_head is tied).
_WRAPPER_KEYS = ("tie_word_embeddings", "dtype", "torch_dtype")
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")

# Qwen3_5MoeTextConfig's values for absent fields (its __post_init__ sets partial_rotary_factor
# 0.25).
DEFAULTS = ConfigDefaults(
    rope_theta=10000.0, rms_norm_eps=1e-6, partial_rotary_factor=0.25, head_dim=256
)


def text_config(cfg: dict) -> dict:
    """The text model's config: `text_config` of a multimodal config, else cfg itself, with
    the multimodal RoPE keys dropped (text positions make it ordinary RoPE; module docstring)."""
    if "text_config" in cfg:
        text = dict(cfg["text_config"])
        text.update({k: cfg[k] for k in _WRAPPER_KEYS if cfg.get(k) is not None})
        text.setdefault("model_type", "qwen3_5_moe_text")
    else:
        text = dict(cfg)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(text.get(key), dict):
            text[key] = {k: v for k, v in text[key].items() if k not in _MROPE_KEYS}
    return text


def spec_from_config(cfg: dict) -> ModelSpec:
    cfg = text_config(cfg)
    base = base_spec_fields(cfg, DEFAULTS)
    n_layers, n_experts = base["n_layers"], int(require(cfg, "num_experts"))
    return ModelSpec(
        **base,
        n_experts=n_experts,
        top_k=int(require(cfg, "num_experts_per_tok")),
        moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
        moe_layers=tuple(range(n_layers)),  # every layer is MoE
        shared_expert_intermediate_size=int(require(cfg, "shared_expert_intermediate_size")),
        norm_topk_prob=True,  # Qwen3_5MoeTopKRouter always renormalises
        attention_bias=bool(cfg.get("attention_bias", False)),
        layer_types=layer_types(cfg, n_layers),
        linear=linear_spec(cfg),
    )


def blueprint(spec: ModelSpec) -> Blueprint:
    return hybrid_blueprint(spec, DeltaNetOptions(grouped=False))
