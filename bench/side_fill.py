"""Fills behind a decode step: how much a second stream's copies delay the step's own (CUDA).

    python -m freetoken_agent.bench side-fill [--layers 48] [--miss-layers 25] [--layer-mb 75]
        [--pieces 1 9] [--steps 40] [--out DIR]

The split expert (bench/results/NOTES.md, twenty-sixth session) would copy half of a missing
expert before its layer computes, the CPU worker computing the other half meanwhile, and copy
the other half behind, on a second stream, while later layers compute. Whether that pays rests
on one figure this measures: how much the copies behind delay the step's own copies and kernels
(a copy on the link is not preempted, and both share it).

The step is shaped like the 48-layer Qwen3-30B-A3B decode step and holds nothing of the engine:
each layer one matmul reading `--layer-mb` of device weights (its HBM read), and in
`--miss-layers` of them (Zipf b=1 at 48 layers fetched ~25 experts a token, twenty-seventh
session) a copy of one expert (9.44 MB) from a pinned host pool into a device slot first. Each
variant is one captured graph of a step, replayed `--steps` times, the misses' pool rows drawn
anew before each replay (the copy engines' copies excepted: their addresses are fixed at
capture). Variants:

    hit             no copies: the step's compute alone
    full            each miss copies its whole expert before its layer (gpu-fill today)
    half            half of it: the split's critical path with the CPU's half and the copy
                    behind left out, the floor the split could reach
    half+side-sm    half, and the other half on a side stream by the same SM copy kernel, in
                    `pieces` launches, forked after the layer's own copy, joined at step end
    half+side-dma   the same by the copy engines (cudaMemcpyAsync a piece)
    half+early-dma  every miss's other half by the copy engines from the step's start: the
                    host-driven variant, whose copies behind are issued after a step's sync
                    and so run from the next step's start

The step's own copies are the row-copy kernel (kernels/triton/row_copy.py): SM loads of pinned
host memory, as the engine's fill copy. Beside each variant: `serial_ms`, its compute plus its
own copies' bytes at the link's measured rate (B_P), and `floor_ms`, the larger of that and
all its bytes at B_P.

Shape legend: H hidden, W (I) expert width, E = 3 H W elements of one expert, R columns a
layer's matmul reads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken_agent.bench.cuda_graph import device_ms
from freetoken_agent.engine.experts import calibration
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.row_copy import row_copy

H, W = 2048, 768  # Qwen3-30B-A3B: hidden, expert width (I)
VARIANTS = ("hit", "full", "half", "half+side-sm", "half+side-dma", "half+early-dma")
BEHIND = VARIANTS[3:]  # the variants that copy each miss's other half behind the step
DMA = ("half+side-dma", "half+early-dma")  # the copy engines' (pool rows fixed at capture)
POOL_EXPERTS = 64  # pinned pool rows (~600 MB at the real shape): beyond the host's caches

RESULTS = Path(__file__).resolve().parent / "results"  # wherever the bench runs from


@dataclass(frozen=True)
class Layout:
    """Where an expert's pieces lie when its E elements are viewed as rows of one piece each:
    half 0 is pieces [0, pieces), half 1 [pieces, 2 pieces) of the expert's 2 * pieces."""

    expert_elems: int  # E
    pieces: int  # pieces a half is copied in

    def __post_init__(self) -> None:
        if self.pieces < 1 or self.expert_elems % (2 * self.pieces):
            raise ValueError(f"an expert of {self.expert_elems} elements does not split into "
                             f"2 x {self.pieces} equal pieces")  # fmt: skip

    @property
    def piece_elems(self) -> int:
        return self.expert_elems // (2 * self.pieces)

    def rows(self, expert: int, half: int) -> list[int]:
        """Piece rows of `expert`'s `half` (0 or 1) in the [N * 2 * pieces, piece] view."""
        first = (2 * expert + half) * self.pieces
        return list(range(first, first + self.pieces))


def miss_layers(layers: int, misses: int, rng: random.Random) -> list[int]:
    """`misses` distinct layers of `layers`, in order."""
    if not 0 <= misses <= layers:
        raise ValueError(f"--miss-layers {misses}: between 0 and the {layers} layers")
    return sorted(rng.sample(range(layers), misses))


def copy_index(layout: Layout, whole: bool, rows: list[int]) -> list[int]:
    """Miss m copies pool row rows[m] into slot m: per miss, its source piece rows then its
    destination piece rows, half 0's pieces first and, where `whole` (both halves copied, on
    the step's stream or behind it), half 1's after them."""
    index = []
    for m, row in enumerate(rows):
        for expert in (row, m):
            index += layout.rows(expert, 0) + (layout.rows(expert, 1) if whole else [])
    return index


class SideFillStep:
    """One variant's step, captured: `replay(rng)` with new pool rows; the slots then hold
    the drawn rows' copied parts (`check`)."""

    def __init__(self, variant: str, weights: list[torch.Tensor], x: torch.Tensor,
                 pool: torch.Tensor, slots: torch.Tensor, misses: list[int], layout: Layout,
                 rng: random.Random) -> None:  # fmt: skip
        """weights: per layer [H, R] on the device; x [B, H]; pool [N, E] pinned host; slots
        [M, E] device, one per miss layer."""
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r}: one of {VARIANTS}")
        self.variant, self.pool, self.slots, self.layout = variant, pool, slots, layout
        self.weights, self.x = weights, x
        self.misses = [] if variant == "hit" else misses
        p = layout.piece_elems
        self.pool_pieces, self.slot_pieces = pool.view(-1, p), slots.view(-1, p)
        # Pieces a miss copies on the step's stream, and behind it.
        self.own = 2 * layout.pieces if variant == "full" else layout.pieces
        self.side = layout.pieces if variant in BEHIND else 0
        dev = slots.device
        # Per miss: its pieces' source rows, then their destination rows (copy_index); the
        # step's own first, the SM kernel's behind after them. One upload per replay.
        n = 2 * len(self.misses) * (self.own + self.side)
        self.index = torch.zeros(n, dtype=torch.int64, device=dev)
        # Pool rows: the step's own copies' are drawn anew each replay; the copy engines' are
        # addresses in the graph, drawn once at capture.
        self.rows = [rng.randrange(pool.shape[0]) for _ in self.misses]
        dma = variant in DMA
        self.side_rows = [rng.randrange(pool.shape[0]) for _ in self.misses] if dma else None
        self.outs = [torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=dev)
                     for w in weights]  # fmt: skip
        self.side_stream = torch.cuda.Stream(dev)
        if self.side_stream == torch.cuda.current_stream(dev):
            raise RuntimeError("the side stream is the step's own: its copies would not overlap")
        self._upload()
        # Once eagerly first: Triton compiles a kernel per pointer alignment, and the index's
        # slices start at odd int64 offsets; a compile and module load inside a capture fails.
        self._step()
        torch.cuda.synchronize(dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def _step(self) -> None:
        """The step on the current stream (and, with copies behind, the side stream)."""
        main, side_stream = torch.cuda.current_stream(), self.side_stream
        early = self.variant == "half+early-dma"

        def fork() -> None:
            event = torch.cuda.Event()
            event.record(main)
            side_stream.wait_event(event)

        if early:  # every copy behind from the step's start
            fork()
            with torch.cuda.stream(side_stream):
                for m in range(len(self.misses)):
                    self._side_copies(m, None, None)
        miss_at = {layer: m for m, layer in enumerate(self.misses)}
        own, n = self.own, self.own + self.side
        for layer, w in enumerate(self.weights):
            m = miss_at.get(layer)
            if m is not None:
                src = self.index[2 * m * n : 2 * m * n + n]
                dst = self.index[2 * m * n + n : 2 * (m + 1) * n]
                row_copy(self.slot_pieces, self.pool_pieces, dst[:own], src[:own])
                if self.side and not early:
                    fork()
                    with torch.cuda.stream(side_stream):
                        self._side_copies(m, src[own:], dst[own:])
            torch.matmul(self.x, w, out=self.outs[layer])
        if self.side:  # the step ends when its copies behind have landed
            join = torch.cuda.Event()
            join.record(side_stream)
            main.wait_event(join)

    def _side_copies(self, m: int, src: torch.Tensor | None, dst: torch.Tensor | None) -> None:
        """Miss m's other half, on the current (side) stream: by the SM kernel from the index
        (src, dst: its side piece rows), or by the copy engines from `side_rows`."""
        if self.side_rows is None:
            for j in range(self.side):  # a launch a piece, as the copy engines' variant
                row_copy(self.slot_pieces, self.pool_pieces, dst[j : j + 1], src[j : j + 1])
            return
        pieces = self.layout.rows(self.side_rows[m], 1)
        for s, d in zip(pieces, self.layout.rows(m, 1), strict=True):
            self.slot_pieces[d].copy_(self.pool_pieces[s], non_blocking=True)

    def _upload(self) -> None:
        """The index for this replay's `rows` (the copy engines' side rows are not in it)."""
        whole = self.variant == "full" or self.side > 0
        index = copy_index(self.layout, whole, self.rows)
        if index:
            self.index.copy_(torch.tensor(index, dtype=torch.int64))

    def replay(self, rng: random.Random) -> float:
        """One replay with new pool rows for the step's own copies; its ms."""
        self.rows = [rng.randrange(self.pool.shape[0]) for _ in self.misses]
        self._upload()
        torch.cuda.synchronize()
        return device_ms(self.graph.replay)

    def check(self) -> None:
        """The slots hold what the last replay copied: each miss's whole expert (`full`), its
        first half, and with copies behind its second half, from its side row where the copy
        engines copied it."""
        half = self.layout.expert_elems // 2
        for m, row in enumerate(self.rows):
            got = self.slots[m].cpu()
            if not torch.equal(got[:half], self.pool[row, :half]):
                raise AssertionError(f"{self.variant}: miss {m}'s first half is not row {row}")
            if self.own + self.side < 2 * self.layout.pieces:
                continue  # `half`: the second half is never copied
            second = row if self.side_rows is None else self.side_rows[m]
            if not torch.equal(got[half:], self.pool[second, half:]):
                raise AssertionError(f"{self.variant}: miss {m}'s second half is not row "
                                     f"{second}")  # fmt: skip

    def copied_bytes(self) -> tuple[int, int]:
        """(bytes copied on the step's own stream, behind it) a step."""
        piece = self.layout.piece_elems * self.pool.element_size()
        return len(self.misses) * self.own * piece, len(self.misses) * self.side * piece


def measure(args: argparse.Namespace, dev: torch.device) -> dict:
    """Every variant at every piece count: step ms (median, p10, p90) beside its bounds."""
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    expert = 3 * args.hidden * args.inter
    cols = max(1, int(args.layer_mb * 1e6) // (2 * args.hidden))  # R
    weights = [torch.randn(args.hidden, cols, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(args.layers)]  # fmt: skip
    x = torch.randn(args.batch, args.hidden, device=dev, dtype=torch.bfloat16)
    pool = torch.randn(args.pool, expert, generator=gen).to(torch.bfloat16).pin_memory()
    misses = miss_layers(args.layers, args.miss_layers, rng)
    slots = torch.zeros(max(1, len(misses)), expert, dtype=torch.bfloat16, device=dev)
    b_p = calibration.measure_pcie(expert * 2)
    # Compile and load the copy kernel and the matmul before any capture.
    piece = Layout(expert, args.pieces[0]).piece_elems
    first = torch.zeros(1, dtype=torch.int64, device=dev)
    row_copy(slots.view(-1, piece), pool.view(-1, piece), first, first)
    torch.matmul(x, weights[0])
    torch.cuda.synchronize(dev)
    report = {"bench": "side-fill", "device": torch.cuda.get_device_name(dev),
              "layers": args.layers, "miss_layers": misses, "layer_mb": args.layer_mb,
              "batch": args.batch, "expert_mb": expert * 2 / 1e6, "b_p_gb_s": b_p / 1e9,
              "steps": args.steps, "rows": {}}  # fmt: skip
    hit_ms = None
    for pieces in args.pieces:
        layout = Layout(expert, pieces)
        for variant in VARIANTS:
            if variant in ("hit", "full", "half") and pieces != args.pieces[0]:
                continue  # no copies behind: the piece count changes nothing
            slots.zero_()
            step = SideFillStep(variant, weights, x, pool, slots, misses, layout, rng)
            for _ in range(3):
                step.replay(rng)
            times = sorted(step.replay(rng) for _ in range(args.steps))
            step.check()
            own, behind = step.copied_bytes()
            ms = statistics.median(times)
            hit_ms = ms if variant == "hit" else hit_ms
            key = variant if variant not in BEHIND else f"{variant}|pieces{pieces}"
            report["rows"][key] = {
                "step_ms": ms, "p10_ms": times[len(times) // 10],
                "p90_ms": times[(9 * len(times)) // 10],
                "own_mb": own / 1e6, "behind_mb": behind / 1e6,
                # The step's own copies and compute run one after another on its stream;
                # every byte crosses the link (B_P: the copy engines' rate; the step's own
                # copies are the SM kernel's, ~7% slower in the engine: twentieth session).
                "serial_ms": hit_ms + 1e3 * own / b_p,
                "floor_ms": max(hit_ms + 1e3 * own / b_p, 1e3 * (own + behind) / b_p),
            }  # fmt: skip
            print(key, json.dumps(report["rows"][key]), flush=True)
            del step
    rows = report["rows"]
    half = rows.get("half", {}).get("step_ms")
    for key, row in rows.items():  # what the copies behind cost the step over `half`
        if key.split("|")[0] in BEHIND and half is not None:
            row["delay_over_half_ms"] = row["step_ms"] - half
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench side-fill",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=48, help="layers a step")
    parser.add_argument(
        "--miss-layers",
        type=int,
        default=25,
        help="layers that copy one expert a step",
    )
    parser.add_argument(
        "--layer-mb",
        type=float,
        default=75.0,
        help="device weights a layer's matmul reads (75: 8 experts)",
    )
    parser.add_argument(
        "--pieces",
        type=int,
        nargs="+",
        default=[1, 9],
        help="launches (or copies) a half behind is split into",
    )
    parser.add_argument("--batch", type=int, default=1, help="rows each layer's matmul reads for")
    parser.add_argument("--steps", type=int, default=40, help="timed replays a variant")
    parser.add_argument("--hidden", type=int, default=H, help="hidden size H (Qwen3-30B-A3B's)")
    parser.add_argument("--inter", type=int, default=W, help="expert width I (Qwen3-30B-A3B's)")
    parser.add_argument("--pool", type=int, default=POOL_EXPERTS, help="pinned pool experts")
    parser.add_argument("--seed", type=int, default=0, help="miss layers and pool rows drawn")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON's folder")
    args = parser.parse_args(argv)
    for pieces in args.pieces:
        Layout(3 * args.hidden * args.inter, pieces)  # refuses a split that does not divide
    miss_layers(args.layers, args.miss_layers, random.Random(0))  # refuses a bad count
    if not torch.cuda.is_available():
        parser.error("side-fill needs CUDA")
    report = measure(args, torch.device("cuda"))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"side_fill_{args.layers}l.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0
