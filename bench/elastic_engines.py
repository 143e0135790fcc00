"""The engines of bench/elastic.py's session (and of bench/decode_profile.py): the model shape,
each engine built on one shared host pool, the CPU smoke's simulated budget, the synthetic
routing of decode."""

from __future__ import annotations

import torch

from freetoken_agent.bench.random_model import QWEN3_30B_A3B, peer_slice, random_engine
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator
from freetoken_agent.engine.engine import Engine
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.recurrence import recurrent_device_bytes
from freetoken_agent.engine.loading import dense_nbytes

# The same family at toy size for --cpu-smoke (fp32): 4 MoE layers x 16 experts = 64 pool rows.
TINY_QWEN3_MOE = {
    **QWEN3_30B_A3B,
    **dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4),
    **dict(num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32),
    **dict(num_experts=16, num_experts_per_tok=2, torch_dtype="float32", eos_token_id=2),
    "max_position_embeddings": 4096,
}
SMOKE_SLOTS = 40  # slots the simulated budget holds beside the first turn's KV


def shape_config(args) -> tuple[dict, int]:
    """(model config, stream_min_tokens) of --shape at --layers (device) or toy size."""
    from freetoken_agent.bench import agent  # the Qwen3.6 shape lives with its first bench

    if args.shape == "qwen3.6-35b-a3b":
        # 128 tokens of a 256-expert top-8 layer touch ~98% of its experts: stream from there.
        cfg = agent.TINY_HYBRID if args.cpu_smoke else agent.device_config(args.layers or 40)
        return dict(cfg), 128
    cfg = TINY_QWEN3_MOE if args.cpu_smoke else peer_slice(QWEN3_30B_A3B, args.layers or 48)
    return dict(cfg), 512


def build(args, name: str, turns) -> Engine:
    first, last = turns[0][0], turns[-1][0]
    common = dict(max_model_len=last + args.decode_tokens + 16, max_batched_tokens=args.chunk)
    options = dict(common, max_num_seqs=4, gpu_budget=args.budget)
    if name != "elastic":
        ctx = first if name == "fixed-first" else last
        options.update(elastic=False, kv_tokens=ctx + args.decode_tokens)
    elif args.cpu_smoke:  # the default 64k-token arena start does not fit a toy budget
        options.update(kv_tokens=first + args.decode_tokens)
        # Moves of the split and of the budget in the toy arena's scale (64 MiB is a GPU's).
        options.update(elastic_group_bytes=args.smoke_group)
        # The workspace kept whole: a toy model's lendable part is ~10x its arena, so the
        # other program's take (a quarter of the arena) would come out of it, never the split.
        options.update(lend_workspace=False)
    if args.cpu_smoke:
        options.update(device="cpu", std=0.1, policy="transfer", stream_min_tokens=args.stream_min)
    else:
        options.update(policy=args.policy, stream_min_tokens=args.stream_min)
        options.update(hybrid_run_ahead=getattr(args, "hybrid_run_ahead", False))
    engine = random_engine(args.cfg, pool=args.pool, **options)
    # One host pool for every engine of the run: drawn and pinned once (a minute at 58 GB).
    args.pool = getattr(engine.loaded.bank, "pool", None) or args.pool
    return engine


def smoke_budget(cfg: dict, args) -> tuple[int, int]:
    """A simulated budget on the CPU: dense weights, workspace, staging buffers, turn 1's KV
    and SMOKE_SLOTS slots (as tests/engine/test_elastic_memory.py builds one); and the arena
    (the KV and the slots)."""
    probe = random_engine(cfg, device="cpu", policy="resident", max_batched_tokens=args.chunk)
    spec, config = probe.spec, probe.config
    s = config.page_size
    page = KVPool.page_bytes(
        len(spec.attention_layers), s, spec.n_kv_heads, spec.head_dim, spec.dtype
    )
    pages = -(-(args.start_tokens + args.decode_tokens) // s) + 1
    staging = 2 * spec.n_experts * spec.expert_bytes
    arena = pages * page + (SMOKE_SLOTS + 1) * spec.expert_bytes
    recurrent = recurrent_device_bytes(spec, config, torch.device("cpu"), spec.dtype, 0)
    workspace = workspace_bytes(spec, config, offloaded=True)
    fixed = dense_nbytes(probe.loaded.model) + workspace + staging + recurrent
    return fixed + arena, arena


def install_routing(engine: Engine, args) -> None:
    """--routing: a synthetic regime for decode (routing_traces.py), as bench/offload.py does."""
    if args.routing == "native":
        return
    spec, bank = engine.spec, engine.loaded.bank
    regime = Regime.parse(args.routing)
    gen = TraceGenerator(spec.n_moe_layers, spec.n_experts, spec.top_k, regime, args.seed)
    traced = TracedRouting(bank, gen, max_tokens=engine.config.max_num_seqs)
    engine.loaded.model.set_expert_bank(traced)
    if engine.runner.graphs is not None:
        engine.capture_graphs()  # graphs call the bank object they were captured with
