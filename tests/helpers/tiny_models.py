"""Tiny random checkpoints of every supported family, made with transformers' own classes and
`save_pretrained`, for parity tests. Nothing is downloaded.

Weights use a larger init std than transformers' default so that logits are spread out and
greedy decoding does not sit on near-ties, where float noise would decide the token.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

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
    else:
        raise KeyError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny(family: str, folder: Path, seed: int, dtype=torch.float32, **overrides):
    """Save a random tiny model of `family` in `folder`; returns the transformers model."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
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
