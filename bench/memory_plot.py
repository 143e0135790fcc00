"""A PNG of the GPU budget's split over a session (DESIGN section 5): stacked areas of fixed
bytes, KV pages, recurrent checkpoints and expert slots against time or step, the budget as a
line, a marker at each budget change, and tok/s per turn on a second axis when given.

    python -m freetoken_agent.bench.memory_plot TRACE.json OUT.png [--x step] [--title ...]

TRACE.json is `MemoryTrace.to_json()` (or its `records` list, or an object with a `memory_trace`
key holding either). Records are written at changes only, so each value holds until the next
record: the areas are drawn as steps. Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

GIB = 1 << 30
LAYERS = (  # (record key, label, colour): bottom to top
    ("fixed_bytes", "fixed (dense, workspace, states)", "#9e9e9e"),
    ("kv_bytes", "KV pages", "#4c78a8"),
    ("checkpoint_bytes", "checkpoints", "#72b7b2"),
    ("slot_bytes", "expert slots", "#f58518"),
)


def _records(trace: object) -> list[dict]:
    if isinstance(trace, (str, Path)):
        trace = json.loads(Path(trace).read_text())
    if isinstance(trace, dict):
        trace = trace.get("memory_trace", trace)
    if isinstance(trace, dict):
        trace = trace["records"]
    return [r if isinstance(r, dict) else _as_dict(r) for r in trace]  # type: ignore[union-attr]


def _as_dict(record: object) -> dict:
    return {k: getattr(record, k) for k in record.__slots__}  # type: ignore[attr-defined]


def plot_split(
    trace_json_or_records: object,
    png_path: str | Path,
    title: str = "GPU memory split",
    x: str = "time",
    turns: Sequence[tuple[float, float]] | None = None,
) -> Path:
    """Write the PNG; `x` is "time" (seconds) or "step"; `turns` is [(x, tok/s)] per turn,
    on the same x axis. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    recs = _records(trace_json_or_records)
    if not recs:
        raise ValueError("the memory trace has no records")
    xs = [float(r[x]) for r in recs]
    end = xs[-1] + max((xs[-1] - xs[0]) * 0.02, 1.0)  # the last split holds a little further
    if turns:
        end = max(end, max(t for t, _ in turns))
    xs_ext = xs + [end]

    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    bottom = [0.0] * len(xs_ext)
    for key, label, colour in LAYERS:
        vals = [r.get(key, 0) / GIB for r in recs]
        vals.append(vals[-1])
        top = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.fill_between(xs_ext, bottom, top, step="post", label=label, color=colour, lw=0)
        bottom = top
    budget = [r["budget"] / GIB for r in recs]
    ax.step(xs_ext, budget + budget[-1:], where="post", color="black", lw=1.6, label="budget")
    changes = [i for i in range(1, len(recs)) if recs[i]["budget"] != recs[i - 1]["budget"]]
    if changes:
        ax.plot(
            [xs[i] for i in changes],
            [budget[i] for i in changes],
            "v",
            color="crimson",
            ms=8,
            label="budget change",
        )
    ax.set_xlabel("time (s)" if x == "time" else "scheduler step")
    ax.set_ylabel("GiB")
    ax.set_ylim(0, max(max(budget), max(bottom)) * 1.08)
    ax.set_xlim(xs[0], end)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if turns:
        ax2 = ax.twinx()
        ax2.plot([t for t, _ in turns], [v for _, v in turns], "o-", color="#54a24b", label="tok/s")
        ax2.set_ylabel("decode tok/s per turn")
        ax2.set_ylim(0, max(v for _, v in turns) * 1.2)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="lower left", fontsize=8, framealpha=0.85)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="MemoryTrace JSON")
    ap.add_argument("png", help="output PNG path")
    ap.add_argument("--x", choices=("time", "step"), default="time")
    ap.add_argument("--title", default="GPU memory split")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.trace).read_text())
    turns = data.get("turns_tok_s") if isinstance(data, dict) else None  # [(x, tok/s)] if any
    print(plot_split(data, args.png, title=args.title, x=args.x, turns=turns))


if __name__ == "__main__":
    main()
