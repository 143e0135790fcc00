"""The figures `Engine.stats()` and each request's output report: expert placement and cache
counters, recurrent checkpoint memory, per-request timings."""

from __future__ import annotations

import time

from freetoken_agent.engine.request import Request
from freetoken_agent.engine.scheduler import Scheduler


def expert_stats(bank, policy: str) -> dict:
    """Where experts live and, when offloaded, how the cache is doing."""
    cache = getattr(bank, "cache", None)
    if cache is None:
        return {"placement": "resident", "policy": policy}
    st = bank.stats
    return {
        "placement": "offloaded",
        "policy": policy,
        "slots": cache.n_slots,
        "pool_rows": bank.pool.n_rows,
        "pool_bytes": bank.pool.nbytes,
        "pool_pinned": bank.pool.pinned,
        "experts_touched": st.experts,
        "hits": st.hits,
        "fetched": st.fetched,
        "on_cpu": st.on_cpu,
        "direct": st.direct,  # misses read from the pool (direct; gpu-fill's with no slot)
        # adaptive's `split` path: fills cut between the link and the CPU worker, and hits on
        # cut slots whose other part was still on its way (split_expert.py)
        "split": st.split,
        "split_hits": st.split_hits,
        "miss_rate": st.miss_rate,
        "bytes_filled": cache.bytes_filled,
        "layers_streamed": bank.streamer.layers_streamed,
        "bytes_streamed_h2d": bank.streamer.bytes_h2d,
        # adaptive: per decode batch size, the path its last measurement kept (step_paths.py)
        "step_paths": bank.adaptive.chosen_paths() if bank.policy == "adaptive" else {},
        "cache_handoffs": cache.on_device.releases,  # device path -> host: one sync each
        # adaptive's `shared` path: the CPU worker's jobs (engine/experts/cpu_share.py)
        "cpu_share": None
        if bank.cpu_share is None
        else bank.cpu_share.stats(cache.on_device.share),
    }


def checkpoint_stats(scheduler: Scheduler) -> dict | None:
    """Recurrent state and checkpoint memory of a hybrid model (None for pure attention)."""
    rec = scheduler.recurrence
    if rec is None:
        return None
    mode = rec.mode
    return {
        "mode": mode.kind if mode.kind != "positional" else f"positional:{mode.interval}",
        "state_bytes": rec.states.nbytes,
        "state_slots_free": rec.states.n_free,
        **rec.checkpoints.stats(),
    }


def request_stats(req: Request) -> dict:
    end = req.finish_time or time.perf_counter()
    ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
    decode_s = end - req.first_token_time if req.first_token_time else 0.0
    n_out = len(req.output_ids)
    return {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": n_out,
        "reused_tokens": req.num_reused,
        "prefilled_tokens": req.num_prefilled,
        "resumed_tokens": req.num_resumed,
        "ttft_s": ttft,
        "decode_tok_s": (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else None,
        "total_s": end - req.arrival_time,
        "preempted": req.admissions - 1,
    }


def engine_stats(engine) -> dict:
    """What `Engine.stats()` returns."""
    kv, radix = engine.kv, engine.radix
    t = engine.outcomes.totals
    seen = t["prefilled"] + t["reused"]
    return {
        "model": engine.spec.arch,
        "device": str(engine.loaded.device),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "policy": engine.config.policy,
        # Decode under CUDA graphs (False on the CPU, with cuda_graphs off, or after a
        # failed capture: then graph_error says why).
        "cuda_graphs": engine.runner.graphs is not None,
        "graph_error": engine.graph_error,
        # Overlap scheduling (overlap.py): decode steps launched with the last one in flight,
        # and steps in flight completed without a successor (the batch ended, an admission, a
        # memory decision).
        "overlap": {
            "enabled": engine.overlap.enabled,
            "lagged_steps": engine.overlap.lagged_steps,
            "drains": engine.overlap.drains,
        },
        "memory": {
            "dense_bytes": engine.loaded.dense_bytes,  # on the device
            # The token embedding table in pinned host memory (layers/embedding.py), else 0.
            "host_embedding_bytes": engine.loaded.model.embed_tokens.host_nbytes,
            "expert_bytes": engine.loaded.bank.nbytes,
            "kv_bytes": kv.nbytes,
            "kv_pages": kv.allocator.capacity,
            "kv_pages_free": kv.allocator.n_free,
            "kv_pages_cached": radix.n_pages,
            "page_size": kv.page_size,
            "max_model_len": engine.max_model_len,
        },
        "experts": expert_stats(engine.loaded.bank, engine.config.policy),
        "tokens": {
            "prefilled": t["prefilled"],
            "reused": t["reused"],
            "generated": t["generated"],
            "reuse_ratio": t["reused"] / seen if seen else 0.0,
        },
        "checkpoints": checkpoint_stats(engine.scheduler),
        "elastic": None if engine.memory is None else engine.memory.stats(),
        "requests": {
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "finished": t["finished"],
            "errors": t["errors"],
            "preemptions": engine.scheduler.preemptions,
        },
        # Finished requests: queue, first-token, per-token and end-to-end latency histograms,
        # prompt and output sizes, finish reasons (request_metrics.py).
        "latency": engine.outcomes.metrics.to_json(),
    }
