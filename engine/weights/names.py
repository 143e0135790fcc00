"""Checkpoint-name tables: how a family's HF tensor names map onto our parameters and banks.

A model file lists `(hf_template, target)` rows; `{L}` stands for the decoder layer and `{E}` for
the expert. Targets say where the tensor goes:
- `Dense(param, shard)`: a module parameter (or one shard of a stacked one, e.g. q of qkv);
- `Expert(proj)`: one expert's projection ("gate", "up" or "down") in the expert bank;
- `FusedExperts(proj)`: all experts of a layer in one 3-D tensor ("gate_up" [E, 2I, H],
  "down" [E, H, I]), as transformers 5 and some releases store them;
- `Ignore()`: a tensor the checkpoint may carry that we do not need (e.g. rotary tables).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Dense:
    param: str  # our parameter name, may contain {L}
    shard: str | None = None


@dataclass(slots=True, frozen=True)
class Expert:
    proj: str  # gate | up | down


@dataclass(slots=True, frozen=True)
class FusedExperts:
    proj: str  # gate_up | gate | up | down


@dataclass(slots=True, frozen=True)
class Ignore:
    pass


Target = Dense | Expert | FusedExperts | Ignore
NameTable = tuple[tuple[str, Target], ...]

# The attention, norm, embedding and head names are the same in every supported family.
COMMON_NAMES: NameTable = (
    ("model.embed_tokens.weight", Dense("embed_tokens.weight")),
    ("model.norm.weight", Dense("norm.weight")),
    ("lm_head.weight", Dense("lm_head.weight")),
    ("model.layers.{L}.input_layernorm.weight", Dense("layers.{L}.input_layernorm.weight")),
    (
        "model.layers.{L}.post_attention_layernorm.weight",
        Dense("layers.{L}.post_attention_layernorm.weight"),
    ),
    (
        "model.layers.{L}.self_attn.q_proj.weight",
        Dense("layers.{L}.self_attn.qkv_proj.weight", "q"),
    ),
    (
        "model.layers.{L}.self_attn.k_proj.weight",
        Dense("layers.{L}.self_attn.qkv_proj.weight", "k"),
    ),
    (
        "model.layers.{L}.self_attn.v_proj.weight",
        Dense("layers.{L}.self_attn.qkv_proj.weight", "v"),
    ),
    ("model.layers.{L}.self_attn.q_proj.bias", Dense("layers.{L}.self_attn.qkv_proj.bias", "q")),
    ("model.layers.{L}.self_attn.k_proj.bias", Dense("layers.{L}.self_attn.qkv_proj.bias", "k")),
    ("model.layers.{L}.self_attn.v_proj.bias", Dense("layers.{L}.self_attn.qkv_proj.bias", "v")),
    ("model.layers.{L}.self_attn.o_proj.weight", Dense("layers.{L}.self_attn.o_proj.weight")),
    ("model.layers.{L}.self_attn.o_proj.bias", Dense("layers.{L}.self_attn.o_proj.bias")),
    ("model.layers.{L}.self_attn.q_norm.weight", Dense("layers.{L}.self_attn.q_norm.weight")),
    ("model.layers.{L}.self_attn.k_norm.weight", Dense("layers.{L}.self_attn.k_norm.weight")),
    ("model.layers.{L}.self_attn.rotary_emb.inv_freq", Ignore()),
)


def dense_mlp_names(prefix: str) -> NameTable:
    """A SwiGLU MLP stored as gate_proj / up_proj / down_proj under `model.layers.{L}.<prefix>`
    (dense layers, Qwen2-MoE's shared expert); ours has the same path with gate/up stacked."""
    gate_up = Dense(f"layers.{{L}}.{prefix}.gate_up_proj.weight", "gate")
    return (
        (f"model.layers.{{L}}.{prefix}.gate_proj.weight", gate_up),
        (f"model.layers.{{L}}.{prefix}.up_proj.weight", Dense(gate_up.param, "up")),
        (
            f"model.layers.{{L}}.{prefix}.down_proj.weight",
            Dense(f"layers.{{L}}.{prefix}.down_proj.weight"),
        ),
    )


def routed_expert_names(prefix: str, gate: str, up: str, down: str) -> NameTable:
    """The router and routed experts under `model.layers.{L}.<prefix>` (our module is always
    `mlp`): per-expert tensors named gate/up/down, or the fused 3-D layout of transformers 5."""
    return (
        (f"model.layers.{{L}}.{prefix}.gate.weight", Dense("layers.{L}.mlp.gate.weight")),
        (f"model.layers.{{L}}.{prefix}.experts.{{E}}.{gate}.weight", Expert("gate")),
        (f"model.layers.{{L}}.{prefix}.experts.{{E}}.{up}.weight", Expert("up")),
        (f"model.layers.{{L}}.{prefix}.experts.{{E}}.{down}.weight", Expert("down")),
        (f"model.layers.{{L}}.{prefix}.experts.gate_up_proj", FusedExperts("gate_up")),
        (f"model.layers.{{L}}.{prefix}.experts.down_proj", FusedExperts("down")),
    )
