"""Tiny random checkpoints of every supported family, made with transformers' own classes and
`save_pretrained`, for parity tests. Nothing is downloaded.

Weights use a larger init std than transformers' default so that logits are spread out and
greedy decoding does not sit on near-ties, where float noise would decide the token.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
# Hybrid (gated DeltaNet + attention) families: tested model-side in test_hybrid_model.py until
# the engine's recurrent-state plumbing lets them join FAMILIES. "qwen3_5_moe_vl" (not listed)
# is the multimodal Qwen3.5 class with a tiny vision tower: its checkpoint nests the text model.
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(family: str, **overrides):
    import transformers as tf

    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **_COMMON,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # one dense layer, to cover that path
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
    elif family == "mixtral":
        cfg = tf.MixtralConfig(
            **_COMMON,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=24,  # small, so tests cross the window
        )
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(
            **_COMMON,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            clip_qkv=4.0,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        )
    elif family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(
            **{**_COMMON, **_HYBRID},
            intermediate_size=96,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],  # one dense layer, to cover that path
        )
    elif family == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(**{**_COMMON, **_HYBRID})
    elif family == "qwen3_5_moe_vl":
        cfg = tf.Qwen3_5MoeConfig(
            text_config={**_COMMON, **_HYBRID, **overrides},
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=_COMMON["hidden_size"],
                patch_size=4,
                temporal_patch_size=2,
                spatial_merge_size=2,
                num_position_embeddings=16,
            ),
            tie_word_embeddings=False,
        )
        return cfg
    else:
        raise KeyError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


# Shared by the hybrid families: 4 layers, three gated-DeltaNet then one attention layer;
# Hv = 2 Hk linear heads of 16 dims; partial RoPE (a quarter of the head dims) as released.
_HYBRID = dict(
    num_hidden_layers=4,
    head_dim=16,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def _randomize_norms(model, seed: int) -> None:
    """Zero-centred norms start at w = 0 and the gated norm and dt_bias at 1: random values
    instead, so a missing (1 + w) or a wrong weight cannot pass unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and (name.endswith("norm.weight") or name.endswith("dt_bias")):
                p.add_((0.3 * torch.randn(p.shape, generator=gen)).to(p.dtype))


def make_tiny(family: str, folder: Path, seed: int, dtype=torch.float32, **overrides):
    """Save a random tiny model of `family` in `folder`; returns the transformers model."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    cfg._attn_implementation = "eager"
    if family == "qwen3_5_moe_vl":
        model = tf.Qwen3_5MoeForConditionalGeneration._from_config(cfg, dtype=dtype)
    else:
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if family in (*HYBRID_FAMILIES, "qwen3_5_moe_vl"):
        _randomize_norms(model, seed)
    model.eval()
    model.save_pretrained(folder)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decode of n tokens, EOS not special (our side uses ignore_eos).
    min_new_tokens would not do: it masks EOS out of the logits, changing the argmax."""
    ids = torch.tensor([prompt], device=model.device)
    model.generation_config.eos_token_id = None
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == n
    return tokens


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).abs().max() / ref.abs().max()).item()
