"""Checkpoint-name tables: how a family's HF tensor names map onto our parameters and banks.

A model file lists `(hf_template, target)` rows; `{L}` stands for the decoder layer and `{E}` for
the expert; `{*}` (Ignore rows only) for any rest of the name. Targets say where the tensor goes:
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


def shared_expert_names(prefix: str = "mlp") -> NameTable:
    """A shared expert (SwiGLU) and its scalar sigmoid gate, as Qwen2-MoE and Qwen3-Next name
    them under `model.layers.{L}.<prefix>`."""
    return (
        *dense_mlp_names(f"{prefix}.shared_expert"),
        (
            f"model.layers.{{L}}.{prefix}.shared_expert_gate.weight",
            Dense(f"layers.{{L}}.{prefix}.shared_expert_gate.weight"),
        ),
    )


def gated_delta_net_names(grouped: bool) -> NameTable:
    """A gated-DeltaNet layer under `model.layers.{L}.linear_attn` (engine/layers/
    gated_delta_net.py). grouped: Qwen3-Next's in_proj_qkvz / in_proj_ba (rows grouped per key
    head); else Qwen3.5's separate in_proj_qkv / _z / _b / _a. Either goes into our stacked
    in_proj, one shard per checkpoint tensor; the layer reads the layout it was built for."""
    hf, ours = "model.layers.{L}.linear_attn", "layers.{L}.linear_attn"
    parts = ("qkvz", "ba") if grouped else ("qkv", "z", "b", "a")
    return (
        *((f"{hf}.in_proj_{p}.weight", Dense(f"{ours}.in_proj.weight", p)) for p in parts),
        (f"{hf}.conv1d.weight", Dense(f"{ours}.conv1d.weight")),
        (f"{hf}.A_log", Dense(f"{ours}.A_log")),
        (f"{hf}.dt_bias", Dense(f"{ours}.dt_bias")),
        (f"{hf}.norm.weight", Dense(f"{ours}.norm.weight")),
        (f"{hf}.out_proj.weight", Dense(f"{ours}.out_proj.weight")),
    )


def renamed_prefix(table: NameTable, old: str, new: str) -> NameTable:
    """The rows whose checkpoint name starts with `old`, renamed to start with `new` (e.g.
    Qwen3.5's `model.language_model.` for the text model inside a multimodal checkpoint)."""
    return tuple(
        (new + template[len(old) :], target)
        for template, target in table
        if template.startswith(old)
    )
