"""Real-shaped models with random weights, built directly on the device (no checkpoint files:
a 58 GB random checkpoint would take longer to write than the benchmark takes to run).

Shapes follow the published config.json of each model; weights are N(0, std) with norms at 1,
which is enough for the router to spread tokens near-uniformly over experts: the worst case
for an expert cache and the usual one for a resident baseline.
"""

from __future__ import annotations

import torch

from freetoken_agent.engine.config import EngineConfig
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.loading import assemble, build_model
from freetoken_agent.engine.models.registry import spec_from_config

# Qwen3-30B-A3B's config.json, as published (the fields we read).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 151645,
}


def peer_slice(cfg: dict, n_layers: int = 12) -> dict:
    """The first n layers of a model: the slice used to compare engines on one GPU."""
    return {**cfg, "num_hidden_layers": n_layers}


def _draw_normal(t: torch.Tensor, rows: int, std: float, gen: torch.Generator,
                 dev: torch.device) -> None:  # fmt: skip
    """N(0, std) into `t`, `rows` rows at a time, drawn on `dev`: a host tensor gets each
    chunk copied (drawing gigabytes on the CPU would take minutes)."""
    for chunk in t.split(rows):
        if chunk.device == dev:
            chunk.normal_(0.0, std, generator=gen)
        else:
            drawn = torch.empty(chunk.shape, dtype=chunk.dtype, device=dev)
            chunk.copy_(drawn.normal_(0.0, std, generator=gen))


@torch.no_grad()
def random_engine(
    cfg: dict,
    device: str = "cuda",
    std: float = 0.02,
    seed: int = 0,
    policy: str = "resident",
    pool: ExpertPool | None = None,
    **options,
) -> Engine:
    """An engine over random weights. Offloading policies keep the experts in a host pool:
    they are drawn on the device in chunks and copied there (drawing 58 GB on the CPU would
    take minutes). `pool`: the host pool of an engine built before from the same `cfg`, `std`
    and `seed` (`engine.loaded.bank.pool`): reused as is, so a benchmark comparing engines
    draws and pins it once (about a minute at 58 GB on the device)."""
    spec = spec_from_config(cfg)
    dev = torch.device(device)
    dtype = spec.dtype
    config = EngineConfig(device=str(dev), dtype=dtype, policy=policy, **options)
    model, bank, max_len = build_model(spec, config, dev, dtype, pool)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:  # whole on the device; a table in host memory (layers/embedding.py) in chunks
            _draw_normal(p, p.shape[0] if p.device == dev else 16384, std, gen, dev)
    drawn_before = pool is not None and getattr(bank, "pool", None) is pool
    for bank_tensor in () if drawn_before else (bank.w13, bank.w2):
        _draw_normal(bank_tensor, 256, std, gen, dev)  # bounded temporaries
    if hasattr(bank, "ready"):
        bank.ready()  # pin the pool, place static experts
    loaded = assemble(spec, config, model, bank, dev, dtype, max_len, tokenizer=None)
    return Engine(loaded)
