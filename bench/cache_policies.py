"""Expert cache replacement policies replayed on routing traces: the miss rate of the engine's
LRU beside what other policies would give, and the offline optimum (any CPU, no model).

    python -m freetoken_agent.bench cache-policies [--layers 48] [--slots 2686] [--tokens 1500]

The engine's cache is one global LRU over (layer, expert) slots (experts/cache.py; the device
path's plan evicts the smallest stamp). Under skewed routing, LRU keeps every recent expert and
so lets popular ones go; frequency-aware policies keep them. Rows (miss rate of the steps after
`--warm`, one token a step, every layer):
- lru: the engine's policy;
- w-tinylfu: a 5% LRU window in front of an LRU main segment that admits the window's victim
  only when it was used more often than the main segment's (counts halved every 100k uses);
- popular-F: the engine's EngineConfig.popular_pins (engine/experts/popular_pins.py): every
  64 steps each layer's most used residents pinned, F of the slots in all, the rest LRU;
- pinned-N: the N most popular experts of each layer pinned (the trace's own popularity: an
  oracle), LRU in the other slots;
- belady: the offline optimum (evict the expert used furthest in the future): a bound.
The twenty-second session's run (48 layers, 2686 slots: the 32 GB budget; Zipf 1.0 / locality
0.7): lru 0.0788, w-tinylfu 0.0644, pinned-54 0.0564, belady 0.0327. JSON:
`cache_policies_{layers}l.json`.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from freetoken_agent.bench.routing_traces import Regime, TraceGenerator
from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"


def trace_lids(regime: Regime, layers: int, experts: int, k: int, tokens: int, seed: int):
    """(lids [tokens * layers * k] in use order, each expert's popularity rank [layers, E])."""
    gen = TraceGenerator(layers, experts, k, regime, seed)
    ids = np.stack([gen.draw(layer, tokens) for layer in range(layers)], axis=1)  # [T, L, K]
    lids = (ids + np.arange(layers)[None, :, None] * experts).reshape(-1)
    return lids.tolist(), np.argsort(gen.order, axis=1)


def _lru_use(cache: OrderedDict[int, None], lid: int, room: int) -> bool:
    """One use of `lid` in an LRU of `room` entries (least recent first): whether it missed
    (it is then filled, the least recent one evicted when full)."""
    if lid in cache:
        cache.move_to_end(lid)
        return False
    if len(cache) >= room:
        cache.popitem(last=False)
    cache[lid] = None
    return True


def lru(lids: list[int], slots: int, first: int, pinned: frozenset = frozenset()) -> float:
    """Miss rate over uses `first`.. of an LRU cache of `slots` beside `pinned` lids."""
    cache: OrderedDict[int, None] = OrderedDict()
    room = slots - len(pinned)
    misses = 0
    for i, lid in enumerate(lids):
        if lid not in pinned:
            misses += _lru_use(cache, lid, room) and i >= first
    return misses / (len(lids) - first)


def w_tinylfu(lids: list[int], slots: int, first: int, window: float = 0.05,
              halve_every: int = 100_000) -> float:  # fmt: skip
    win_room = max(1, int(slots * window))
    main_room = slots - win_room
    win: OrderedDict[int, None] = OrderedDict()
    main: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}
    misses = 0
    for i, lid in enumerate(lids):
        freq[lid] = freq.get(lid, 0) + 1
        if (i + 1) % halve_every == 0:
            freq = {key: n // 2 for key, n in freq.items() if n > 1}
        if lid in win:
            win.move_to_end(lid)
            continue
        if lid in main:
            main.move_to_end(lid)
            continue
        misses += i >= first
        win[lid] = None
        if len(win) > win_room:
            candidate, _ = win.popitem(last=False)
            if len(main) < main_room:
                main[candidate] = None
            elif freq.get(candidate, 0) > freq.get(next(iter(main)), 0):
                main.popitem(last=False)
                main[candidate] = None
    return misses / (len(lids) - first)


def popular_pins(
    lids: list[int], slots: int, first: int, lids_per_layer: int, layers: int, top_k: int,
    fraction: float, every: int = 64, half_life: int = 512,
) -> float:  # fmt: skip
    """The engine's EngineConfig.popular_pins (engine/experts/popular_pins.py): every `every`
    steps (a step: one token through every layer) each layer's int(fraction * slots / layers)
    most used resident lids are pinned, the rest LRU; counts halve every `half_life` steps."""
    per_step, per_layer = layers * top_k, int(fraction * slots / layers)
    cache: OrderedDict[int, None] = OrderedDict()  # unpinned residents, least recent first
    pinned: set[int] = set()
    uses = np.zeros(layers * lids_per_layer, dtype=np.int64)
    misses = 0
    for i, lid in enumerate(lids):
        step = i // per_step
        if i % per_step == 0 and step:
            if step % half_life == 0:
                uses >>= 1
            if step % every == 0:
                score = np.full(uses.shape, -1)
                resident = list(cache) + list(pinned)
                score[resident] = uses[resident]
                top = np.argsort(-score.reshape(layers, lids_per_layer), axis=1, kind="stable")
                top = top[:, :per_layer] + np.arange(layers)[:, None] * lids_per_layer
                chosen = {int(x) for x in top.reshape(-1) if score[x] > 0}
                for old in pinned - chosen:  # back to the LRU as just used
                    cache[old] = None
                for new in chosen - pinned:
                    del cache[new]
                pinned = chosen
        uses[lid] += 1
        if lid not in pinned:
            misses += _lru_use(cache, lid, slots - len(pinned)) and i >= first
    return misses / (len(lids) - first)


def belady(lids: list[int], slots: int, first: int) -> float:
    n = len(lids)
    next_use, seen = [0] * n, {}
    for i in range(n - 1, -1, -1):
        next_use[i] = seen.get(lids[i], n + i)
        seen[lids[i]] = i
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, lid), stale entries skipped
    misses = 0
    for i, lid in enumerate(lids):
        if lid not in cache:
            misses += i >= first
            if len(cache) >= slots:
                while True:
                    far, victim = heapq.heappop(heap)
                    if cache.get(victim) == -far:
                        del cache[victim]
                        break
        cache[lid] = next_use[i]
        heapq.heappush(heap, (-next_use[i], lid))
    return misses / (len(lids) - first)


def add_trace_options(parser: argparse.ArgumentParser, slots: int) -> None:
    """The traces' shape and routing, and the cache's `slots` (the replay benches')."""
    parser.add_argument("--layers", type=int, default=48, help="MoE layers (12: peer slice)")
    parser.add_argument("--experts", type=int, default=128, help="experts a layer")
    parser.add_argument("--top-k", type=int, default=8, help="experts a token uses a layer")
    parser.add_argument("--slots", type=int, default=slots,
                        help=f"cache slots ({slots}: 48 layers, the 32 GB budget)")  # fmt: skip
    parser.add_argument("--regime", default="zipf:1.0,loc:0.7",
                        help="routing: uniform or zipf:S,loc:P (routing_traces.py)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench cache-policies",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    add_trace_options(parser, slots=2686)
    parser.add_argument("--tokens", type=int, default=1500, help="decode steps replayed")
    parser.add_argument("--warm", type=int, default=300, help="steps before misses count")
    parser.add_argument("--pinned", type=int, nargs="+", default=[48, 54],
                        help="oracle rows: each layer's N most popular experts pinned")  # fmt: skip
    parser.add_argument("--popular-pins", type=float, nargs="*", default=[0.5, 0.8],
                        help="rows for EngineConfig.popular_pins at these fractions")  # fmt: skip
    args = parser.parse_args(argv)
    regime = Regime.parse(args.regime)
    lids, rank = trace_lids(regime, args.layers, args.experts, args.top_k, args.tokens, args.seed)
    first = args.warm * args.layers * args.top_k
    rows = {"lru": lru(lids, args.slots, first),
            "w-tinylfu": w_tinylfu(lids, args.slots, first)}  # fmt: skip
    for fraction in args.popular_pins:
        rows[f"popular-{fraction}"] = popular_pins(lids, args.slots, first, args.experts,
                                                   args.layers, args.top_k, fraction)  # fmt: skip
    for n in args.pinned:
        popular = np.argwhere(rank < n)  # [layers * n, 2] (layer, expert)
        pinned = frozenset((popular[:, 0] * args.experts + popular[:, 1]).tolist())
        rows[f"pinned-{n}"] = lru(lids, args.slots, first, pinned)
    rows["belady"] = belady(lids, args.slots, first)
    for name, rate in rows.items():
        print(f"{name:12s} miss rate {rate:.4f}  ({rate / rows['lru']:.2f} of lru's)")
    report = {"bench": "cache-policies", **{k: v for k, v in vars(args).items() if k != "out"},
              "miss_rate": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cache_policies_{args.layers}l.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
