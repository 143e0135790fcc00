"""Where a decode step's sampling goes: engine/layers/sampler.py per configuration and path.

    freetoken bench sampler [--vocab 151936] [--out DIR]

Per configuration (greedy; Qwen3's T 0.6 / top-k 20 / top-p 0.95; the CLI's T 0.7 / top-p 0.95
with no top-k; a flat row) and b = 1 and 4, three paths: `kernel` (`sample`: the Triton kernel,
one launch), `torch` (torch's ops, reading back top-p's candidate check) and `torch_nowait`
(torch's ops sorting every top-p row instead):
- host_us: the host's time per call with nothing queued before it (launches and any wait);
- behind_us: the host's time per call queued behind 2 ms of device work (a decode step just
  launched): a call that waits for the device shows it here;
- total_us: the call plus the device finishing it (synchronised);
- kernels: CUDA kernels (and copies) a call launches, from torch.profiler;
- limit_us: the physical limit beside them, the rows' logits read once at the HBM bandwidth
  measured in the same run (bench/limits.py), and greedy's total_us, one argmax launch, as
  the floor a call's launch and synchronisation set.
JSON: `sampler_profile.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

from freetoken_agent.bench.limits import hbm_copy_bandwidth
from freetoken_agent.engine.layers.sampler import sample, sample_with_torch
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.help_format import DefaultsHelpFormatter

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "qwen3": dict(temperature=0.6, top_k=20, top_p=0.95),
    "cli": dict(temperature=0.7, top_p=0.95),
    # A flat row (logits * 0.1): the nucleus runs past the candidates, so the kernel bisects.
    "flat": dict(temperature=0.7, top_p=0.95),
}
REPEATS = 50


def _sleep_device(ms: float) -> None:
    """Queue ~`ms` of device work (a spin kernel) so the host runs ahead of it."""
    torch.cuda._sleep(int(ms * 1e-3 * 1.98e9))  # cycles at the H200's ~1.98 GHz boost clock


def _time(call, behind: bool) -> float:
    torch.cuda.synchronize()
    spent = 0.0
    for _ in range(REPEATS):
        if behind:
            _sleep_device(2.0)
        start = time.perf_counter()
        call()
        spent += time.perf_counter() - start
        torch.cuda.synchronize()
    return spent / REPEATS * 1e6


def _total(call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPEATS):
        call()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPEATS * 1e6


def _kernels(call) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench sampler", formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=151936, help="logits a row (Qwen3's)")
    parser.add_argument("--out", type=Path, default=None, help="folder for sampler_profile.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    b_hbm = hbm_copy_bandwidth(torch.device("cuda"))
    rows = []
    for b in (1, 4):
        # Logits as a model gives them: bf16 values widened to fp32, a few large ones.
        peaked = (torch.randn(b, args.vocab, device="cuda") * 3).bfloat16().float()
        for name, options in CONFIGS.items():
            logits = peaked * 0.1 if name == "flat" else peaked
            params = [SamplingParams(**options) for _ in range(b)]
            gens = [None] * b
            inputs = (logits, params, gens)
            paths = {
                "kernel": partial(sample, *inputs),
                "torch": partial(sample_with_torch, *inputs),
                "torch_nowait": partial(sample_with_torch, *inputs, None, False),
            }
            for path, call in paths.items():
                call()
                row = {"b": b, "config": name, "path": path}
                row["limit_us"] = round(logits.numel() * 4 / b_hbm * 1e6, 2)
                row["host_us"] = round(_time(call, behind=False), 1)
                row["behind_us"] = round(_time(call, behind=True), 1)
                row["total_us"] = round(_total(call), 1)
                row["kernels"] = _kernels(call)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sampler_profile.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
