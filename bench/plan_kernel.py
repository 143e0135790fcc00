"""The in-graph fill's plan kernel alone (kernels/triton/expert_fills.py): device time per
layer's plan against the misses it fills and the slots it scans, beside the launch floor.

    freetoken bench plan-kernel [--slots 687 3022 18000] [--misses 0 1 2 4 8 16]
        [--tokens 1 4] [--share 0 0.25] [--kernel-file OLD.py] [--out DIR]

Each row captures L plans (one a layer, each with its own routing of P distinct experts) in a
CUDA graph, the way a decode step replays them, and times replays of it from the same saved
cache state: every plan hits P - m resident experts and misses m, which it fills (or, with a CPU
share, posts that share to a mailbox no worker reads: the plan does not wait). Residents that
no layer routes to get random stamps, older than the hits', so the victims are spread over the
slots as uniform routing leaves them. The floor is the same graph of L empty Triton kernels:
what a plan cannot go below. `--kernel-file` times another version of the kernels' module (its
`plan_fills`) in the same rows, e.g. the one before a change (`git show
REV:kernels/triton/expert_fills.py`): the versions' replays alternate, and their states and
rows must agree after each row.
Shapes: L layers of E experts, T tokens, K top-k, P = T * K pairs, H hidden.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
from pathlib import Path
from types import ModuleType

import torch
import triton

from freetoken_agent.bench.cuda_graph import captured, device_ms
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels import reference_fills as ref
from freetoken_agent.kernels.cpu.worker import Mailbox
from freetoken_agent.kernels.triton import expert_fills

E, K, H = 128, 8, 2048  # Qwen3-30B-A3B's experts a layer, top-k, hidden

RESULTS = Path(__file__).resolve().parent / "results"  # wherever the bench runs from


@triton.jit
def _empty(x):
    pass


def _load(path: Path | None) -> ModuleType:
    if path is None:
        return expert_fills
    spec = importlib.util.spec_from_file_location("plan_variant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cache(rng: random.Random, layers: int, slots: int, tokens: int, misses: int):
    """The saved state and each of the first `layers` layers' ids [T, K]: P - m lids resident
    with the newest stamps, m absent; the other slots hold lids no plan routes to (of these
    layers or of the model's later ones), with older stamps."""
    p = tokens * K
    if misses > p:
        raise ValueError(f"{misses} misses of {p} pairs")
    n = max(layers, -(-2 * slots // E)) * E  # the model's lids: twice the slots at least
    routed = [rng.sample(range(layer * E, (layer + 1) * E), p) for layer in range(layers)]
    hits = [lid for lids in routed for lid in lids[misses:]]
    if len(hits) + layers * misses > slots:
        raise ValueError(f"{slots} slots: the layers' hits and fills need more")
    routed_set = {lid for lids in routed for lid in lids}
    others = rng.sample([lid for lid in range(n) if lid not in routed_set], slots - len(hits))
    slot_of = torch.full((n,), -1, dtype=torch.int32)
    lid_of = torch.empty(slots, dtype=torch.int32)
    stamp = torch.empty(slots, dtype=torch.int64)
    order = rng.sample(range(slots), slots)
    ages = rng.sample(range(len(others)), len(others))  # older than every hit's stamp
    for i, lid in enumerate(others + hits):
        slot = order[i]
        slot_of[lid], lid_of[slot] = slot, lid
        stamp[slot] = ages[i] if i < len(others) else len(others) + i
    state = torch.zeros(ref.STATE, dtype=torch.int64)
    state[ref.CLOCK] = 2 * slots
    state[ref.LIVE_PAIRS] = p
    ids = [torch.tensor(lids, dtype=torch.int32).view(tokens, K) - layer * E
           for layer, lids in enumerate(routed)]  # fmt: skip
    return (slot_of, lid_of, stamp, state), ids


def _replay_us(replay, restore) -> float:
    """Device time of one replay, from the restored state."""
    restore()
    return device_ms(replay) * 1e3


class _Plans:
    """One kernel module's graph of L plans over its own copy of the saved state."""

    def __init__(self, module: ModuleType, saved, ids, post) -> None:
        dev = torch.device("cuda")
        self.saved = tuple(t.to(dev) for t in saved)
        self.live = tuple(t.clone() for t in self.saved)
        self.moves = torch.zeros(ids[0].numel(), 2, dtype=torch.int64, device=dev)
        self.module, self.ids, self.post = module, ids, post
        self.rows = []
        self.replay = captured(self.step)
        self.restore()

    def step(self) -> None:
        plan = self.module.plan_fills
        self.rows = [plan(x.view(-1), layer * E, *self.live, self.moves, None, self.post)
                     for layer, x in enumerate(self.ids)]  # fmt: skip

    def restore(self) -> None:
        for x, y in zip(self.live, self.saved, strict=True):
            x.copy_(y)

    def replay_us(self) -> float:
        return _replay_us(self.replay, self.restore)

    def once(self) -> tuple:
        """The state and rows after one pass from the saved state (on the host)."""
        self.restore()
        self.step()
        return tuple(t.cpu() for t in (*self.live, *self.rows))


def measure_row(modules: dict[str, ModuleType], slots: int, tokens: int, misses: int,
                share: float, layers: int, reps: int, seed: int) -> dict:  # fmt: skip
    """Every module's plans from the same state, their replays alternated (a clock or a
    neighbour that drifts meets them all); their states and rows must agree after."""
    dev = torch.device("cuda")
    saved, ids = _cache(random.Random(seed), layers, slots, tokens, misses)
    saved[3][ref.CPU_SHARE] = round(share * ref.SHARE_ONE)
    ids = [x.to(dev) for x in ids]
    post = None
    if share > 0:
        box = Mailbox.allocate(tokens, K, H, torch.bfloat16, pin=True)
        hidden = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
        weights = torch.rand(tokens, K, device=dev)
        post = ref.CpuPost(box, hidden, weights)
    plans = {name: _Plans(module, saved, ids, post) for name, module in modules.items()}
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(reps):
        for name, plan in plans.items():
            times[name].append(plan.replay_us())
    after = {name: plan.once() for name, plan in plans.items()}
    first = next(iter(after.values()))
    for name, got in after.items():
        if not all(torch.equal(x, y) for x, y in zip(first, got, strict=True)):
            raise RuntimeError(f"{name}'s plans left another state than {next(iter(after))}'s")
    state = first[3]
    fills, hits = int(state[ref.FILLS]), int(state[ref.HITS])
    on_cpu = int(state[ref.CPU_EXPERTS])
    p = tokens * K
    if hits != layers * (p - misses) or fills + on_cpu != layers * misses:
        raise RuntimeError(f"plans hit {hits} and filled {fills} (+{on_cpu} on the CPU), not "
                           f"{layers * (p - misses)} and {layers * misses}")  # fmt: skip
    row = dict(slots=slots, tokens=tokens, misses=misses, share=share,
               fills_per_plan=fills / layers, cpu_per_plan=on_cpu / layers)  # fmt: skip
    for name, ts in times.items():
        row[f"us_{name}"] = round(statistics.median(ts) / layers, 2)
    return row


def floor_us(layers: int, reps: int) -> float:
    """A graph of `layers` empty Triton kernels, per kernel."""
    x = torch.zeros(1, device="cuda")
    replay = captured(lambda: [_empty[(1,)](x) for _ in range(layers)])
    return statistics.median(_replay_us(replay, lambda: None) for _ in range(reps)) / layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench plan-kernel",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--slots", type=int, nargs="+", default=[687, 3022, 18000],
                        help="cache slots (S) a row's plans scan")  # fmt: skip
    parser.add_argument("--misses", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16],
                        help="misses a plan fills (at most T * K)")  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4],
                        help="tokens (T) a plan routes, K = 8 each")  # fmt: skip
    parser.add_argument("--share", type=float, nargs="+", default=[0.0, 0.25],
                        help="the CPU's share of the misses (posted, never answered)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=16, help="plans a graph")
    parser.add_argument("--reps", type=int, default=30, help="timed replays a row")
    parser.add_argument("--kernel-file", type=Path, default=None,
                        help="another version of the kernels' module to time too")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the cache and routings drawn")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON's folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("plan-kernel needs CUDA")
    kernels = {"current": _load(None)}
    if args.kernel_file is not None:
        kernels[args.kernel_file.stem] = _load(args.kernel_file)
    floor = floor_us(args.layers, args.reps)
    rows = []
    for slots in args.slots:
        for tokens in args.tokens:
            for misses in [m for m in args.misses if m <= tokens * K]:
                for share in args.share:
                    row = measure_row(kernels, slots, tokens, misses, share, args.layers,
                                      args.reps, args.seed)  # fmt: skip
                    row["floor_us"] = round(floor, 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "plan_kernel.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
