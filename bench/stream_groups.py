"""The prefill streamer alone, per ring group size: its time beside the link's limit, and the
host's enqueue time beside the device's, from an empty cache and from a partly full one.

    python -m freetoken_agent.bench stream-groups [--layers 8] [--tokens 4096 8192 16384]
        [--groups 16 32 64 128] [--resident 0.0 0.44] [--attention] [--out DIR]

A pool of `--layers` layers of Qwen3-30B-A3B-shaped experts (128 of 2048 x 768, bf16, random
on the GPU, copied to pinned host memory), a cache of 400 slots, and one chunk of `--tokens`
tokens routed uniformly at random (top-8) through `LayerStreamer.moe`, layer after layer, with
the ring's group size set to each of `--groups` (streaming.STREAM_GROUP, the streamer's own
choice per chunk pinned to it). `--attention` puts a
matmul of 2 * T^2 * 4096 flops between layers, about a causal attention's, so the compute
stream stalls on something besides the MoE as in a real model. Per row: tok/s; the limit, the
bytes that crossed the link over B_P measured in 16-expert copies; the host's enqueue time (the
loop without its final sync) and the device's (with it): enqueue near the device time means the
host, not the link, sets the pace. JSON to `<out>/stream_groups.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from freetoken_agent.engine.experts import calibration, streaming
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.streaming import LayerStreamer
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"
E, H, I, K = 128, 2048, 768, 8  # noqa: E741 - Qwen3-30B-A3B's experts
SLOTS = 400  # room for a lent ring of two 128-expert groups and a layer in service


def make_pool(layers: int) -> ExpertPool:
    n = layers * E
    pool = ExpertPool(torch.empty(n, 2 * I, H, dtype=torch.bfloat16),
                      torch.empty(n, H, I, dtype=torch.bfloat16))  # fmt: skip
    for lo in range(0, n, E):  # random on the GPU, a layer at a time
        pool.w13[lo : lo + E].copy_(torch.randn(E, 2 * I, H, device="cuda").bfloat16() * 0.03)
        pool.w2[lo : lo + E].copy_(torch.randn(E, H, I, device="cuda").bfloat16() * 0.03)
    assert pool.pin(), "the pool could not be pinned"
    return pool


def run_chunk(streamer, layers, inputs, attention) -> tuple[float, float]:
    """(host enqueue seconds, device seconds) of one chunk through every layer."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for layer in range(layers):
        hidden, ids, weights = inputs
        if attention is not None:
            q, kt = attention
            torch.mm(q, kt)  # [T, T]: a causal attention's flops, about
        streamer.moe(layer, hidden, ids, weights)
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    return enqueued, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench stream-groups",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=8, help="pool layers")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384],
                        help="chunk lengths")  # fmt: skip
    parser.add_argument("--groups", type=int, nargs="+", default=[16, 32, 64, 128],
                        help="ring group sizes, experts")  # fmt: skip
    parser.add_argument(
        "--resident",
        type=float,
        nargs="+",
        default=[0.0, 0.44],
        help="shares of the pool resident before the chunk",
    )
    parser.add_argument("--single", action="store_true", help="one ring buffer, not two")
    parser.add_argument("--attention", action="store_true",
                        help="a causal attention's matmul between layers")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed chunks per row (median)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON folder")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    pool = make_pool(args.layers)
    b_p = calibration.measure_pcie(16 * pool.expert_bytes, n=4)
    g = torch.Generator(device="cuda").manual_seed(int(time.time()))
    rows = []
    # Each row's group size as asked: the streamer's own choice per chunk (chunk_group's growth
    # with tokens, widest_group's whole layers where the lend evicts little) pinned to it.
    streaming.STREAM_GROUP_TOKENS = 1 << 40
    streaming.widest_group = lambda least, *_: least
    for share in args.resident:
        for group in args.groups:
            streaming.STREAM_GROUP = group
            for tokens in args.tokens:
                cache = ExpertCache(pool, SLOTS, dev, lids_per_layer=E)
                n_res = int(share * pool.n_rows)
                resident = torch.randperm(pool.n_rows, generator=g, device=dev)[:n_res]
                streamer = LayerStreamer(pool, cache, E, args.layers, dev, not args.single, True)
                hidden = torch.randn(tokens, H, device=dev, generator=g).bfloat16()
                ids = torch.rand(tokens, E, device=dev, generator=g).topk(K, dim=1).indices.int()
                weights = torch.softmax(torch.randn(tokens, K, device=dev, generator=g), dim=1)
                attention = None
                if args.attention:
                    q = torch.randn(tokens, 4096, device=dev, generator=g).bfloat16()
                    attention = (q, torch.randn(4096, tokens, device=dev, generator=g).bfloat16())
                times = []
                for rep in range(args.repeats + 1):  # the first compiles
                    cache.reset()
                    if n_res:  # at most the slots but one
                        cache.fill(sorted(resident.tolist())[: SLOTS - 1], set(), race=False)
                    resident_before = len(cache._lru)
                    torch.cuda.synchronize()
                    before = streamer.bytes_h2d
                    enq, dev_s = run_chunk(streamer, args.layers, (hidden, ids, weights), attention)
                    moved = streamer.bytes_h2d - before
                    if rep:
                        times.append((dev_s, enq, moved, resident_before))
                times.sort()
                dev_s, enq, moved, resident_before = times[len(times) // 2]
                limit = moved / b_p
                assert streamer.group == min(group, E), (streamer.group, group)
                row = dict(resident=share, resident_before=resident_before, group=group,
                           tokens=tokens, double=not args.single, attention=args.attention,
                           tok_s=tokens / dev_s, limit_tok_s=tokens / limit, of_limit=limit / dev_s,
                           enqueue_s=enq, device_s=dev_s, moved_gb=moved / 1e9)  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
                del cache, streamer
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "stream_groups.json"
    report = dict(bench="stream-groups", device=torch.cuda.get_device_name(), b_p_gb_s=b_p / 1e9,
                  layers=args.layers, rows=rows)  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
