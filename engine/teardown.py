"""Giving an engine's memory back at once (`Engine.close`).

Without it an engine's memory goes when the garbage collector reaches the engine's reference
cycles, which may be much later: a notebook or a server that loads another model meanwhile
finds the device memory (dense weights, KV pages, expert slots, decode graphs) and the host
pool's page-locked registration still taken, and the new engine's budget (which follows free
device memory) comes out smaller.
"""

from __future__ import annotations

import gc

import torch

# What the engine holds that leads to device or page-locked memory.
HOLDERS = (
    "loaded",
    "kv",
    "radix",
    "scheduler",
    "runner",
    "memory",
    "grammars",
    "overlap",
    "outcomes",
)


def release(engine) -> None:
    """End every unfinished request with "abort", then drop what holds memory and collect."""
    for rid in list(engine._requests):
        engine.abort(rid)
    engine.overlap.drain()  # a step in flight: its rows are all finished now
    device = engine.loaded.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # nothing queued may still read what is freed
    engine.runner.graphs = None  # graphs hold their memory pool
    if hasattr(engine.loaded.bank, "close"):  # (no local: a bound method holds the bank)
        engine.loaded.bank.close()  # threads that read the pool (the CPU worker) stop first
    pool = getattr(engine.loaded.bank, "pool", None)
    if pool is not None:
        pool.unpin()
    for name in HOLDERS:
        setattr(engine, name, None)
    gc.collect()  # what sits in reference cycles (the decode graphs call into the bank)
    if device.type == "cuda":
        torch.cuda.empty_cache()
