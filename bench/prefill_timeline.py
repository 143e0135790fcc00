"""Where a streamed prefill's time goes on the link: one prompt profiled from an emptied cache
and from a full one, its copies' busy time and idle gaps classed (bench/link_timeline.py).

    python -m freetoken_agent.bench prefill-timeline [--layers 12] [--tokens 4096] [--out DIR]

The engine is `bench offload`'s (the Qwen3-30B-A3B shape cut to `--layers`, random weights,
experts in a pinned host pool; 12 layers under 8 GiB, the peer slice, else 32 GB). Per case
(`cold`: the cache emptied; `warm`: every slot holding a random expert, as decoding leaves
it), after an untimed prompt per case (the kernels compile): the prompt's tok/s unprofiled
beside its limit (`prefill_row`, with Python's cyclic collections during it: `gc`), then the
same case again under torch.profiler (CUDA activity only, so the host's own pace is barely
touched), whose link report says where the time beyond the limit went: before the first
copy, copies slower than B_P, gaps the host left (the next copy not yet queued) or the
device made (the copy waiting for compute), after the last copy. JSON to
`<out>/prefill_timeline_<L>l.json`, each trace to `<out>/prefill_timeline_<L>l_<case>.json.gz`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from freetoken_agent.bench.link_timeline import link_report, trace_events
from freetoken_agent.bench.offload import (
    PEER_BUDGET_GB,
    PEER_LAYERS,
    STREAM_PROBE_EXPERTS,
    offload_engine,
)
from freetoken_agent.bench.offload_decode import sync_device
from freetoken_agent.bench.offload_limits import fill_every_slot, prefill_row, timed_prefill
from freetoken_agent.engine.experts import calibration
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def gc_watch(record: dict):
    """Python's cyclic collections while the block runs: count and milliseconds per
    generation into `record` (a collection stalls the host that queues the device's work)."""
    started = {}

    def watch(phase: str, info: dict) -> None:
        gen = str(info.get("generation"))
        if phase == "start":
            started[gen] = time.perf_counter()
        elif gen in started:
            entry = record.setdefault(gen, {"count": 0, "ms": 0.0})
            entry["count"] += 1
            entry["ms"] += (time.perf_counter() - started.pop(gen)) * 1e3

    gc.callbacks.append(watch)
    try:
        yield record
    finally:
        gc.callbacks.remove(watch)


def profiled(engine, n: int, rng) -> dict:
    """The chrome trace of one n-token prompt's prefill (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    sync_device()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_prefill(engine, n, rng)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench prefill-timeline",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=PEER_LAYERS, help="model depth")
    parser.add_argument("--budget-gb", type=float, default=None,
                        help="GPU budget in GB; default 8 GiB at 12 layers, else 32")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens (one chunk)")
    parser.add_argument("--cases", nargs="+", default=["cold", "warm"],
                        choices=["cold", "warm"], help="cache states profiled")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON folder")
    args = parser.parse_args(argv)
    budget = args.budget_gb or (PEER_BUDGET_GB if args.layers == PEER_LAYERS else 32.0)
    engine, b_p, _ = offload_engine(args.layers, budget, max(args.tokens, 512))
    bank = engine.loaded.bank
    b_p = max(b_p, calibration.measure_pcie(STREAM_PROBE_EXPERTS * bank.pool.expert_bytes, n=4))
    rng = random.Random()
    for case in args.cases:  # compile every kernel the prompt meets in each case
        bank.cache.reset()
        if case == "warm":
            fill_every_slot(bank, rng)
        timed_prefill(engine, args.tokens, rng)
    report = {"bench": "prefill-timeline", "device": torch.cuda.get_device_name(),
              "layers": args.layers, "budget_gb": budget, "tokens": args.tokens,
              "b_p_gb_s": b_p / 1e9, "cases": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"prefill_timeline_{args.layers}l"
    for case in args.cases:
        rows = {}
        for run in ("plain", "profiled"):
            bank.cache.reset()
            resident = fill_every_slot(bank, rng) if case == "warm" else 0
            if run == "plain":
                with gc_watch({}) as collections:
                    rows["plain"] = prefill_row(engine, args.tokens, args.tokens, b_p, rng)
                rows["plain"]["resident_before"] = resident
                # (fewer when the prompt's workspace evicted some: EngineConfig.lend_workspace)
                rows["plain"]["resident_at_start"] = bank.streamer.resident_at_plan
                rows["plain"]["gc"] = collections
                continue
            trace = profiled(engine, args.tokens, rng)
            with gzip.open(args.out / f"{stem}_{case}.json.gz", "wt") as f:
                json.dump(trace, f)
            rows["link"] = link_report(trace_events(trace), b_p)
        report["cases"][case] = rows
        print(case, json.dumps(rows, indent=1), flush=True)
    bank.cache.reset()
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
