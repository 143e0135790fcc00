"""The report side of bench/elastic.py: the summary against issue 6's acceptance, the PNG of
the elastic split, and --merge (engines run in separate device commands joined into one
report)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

ENGINES = ("elastic", "fixed-first", "fixed-last")
WITHIN = 0.12  # the paper: decode within 12% of the single-turn rate as sessions grow


def _gb(takes: dict, key: str) -> dict:
    return {n: None if p.get(key) is None else p[key] / 1e9 for n, p in takes.items()}


def _against_fixed_last(rows: dict, pressure: list[int]) -> dict:
    """Elastic over fixed-last as one figure (the geometric mean of the turns outside pressure
    where both decoded), beside the noise to read it against: fixed-last's median change from
    one turn to the next (|log| ratio; its split never moves, so that is the machine's)."""
    el, fl = rows.get("elastic", []), rows.get("fixed-last", [])

    def rate(r: dict) -> float | None:
        return r.get("decode_tok_s") if "failed" not in r else None

    pairs = [(rate(a), rate(b)) for i, (a, b) in enumerate(zip(el, fl, strict=False))
             if i not in pressure]  # fmt: skip
    logs = [math.log(a / b) for a, b in pairs if a and b]
    own = [rate(r) for r in fl]
    steps = [abs(math.log(b / a)) for a, b in itertools.pairwise(own) if a and b]
    return {
        "elastic_over_fixed_last_geomean": math.exp(statistics.fmean(logs)) if logs else None,
        "fixed_last_turn_to_turn_change": statistics.median(steps) if steps else None,
    }


def summarize(report: dict, args) -> dict:
    """Elastic against both fixed splits per turn, never failed, last turn within 12%."""
    rows = {n: report["engines"][n]["turns"] for n in ENGINES if n in report["engines"]}
    takes = {n: e.get("pressure") or {} for n, e in report["engines"].items()}
    el = rows.get("elastic", [])
    ratios, pressure = [], []
    for i, r in enumerate(el):
        fixed = [rows[n][i] for n in ENGINES[1:] if n in rows and i < len(rows[n])]
        rates = [f["decode_tok_s"] for f in fixed if "failed" not in f and f.get("decode_tok_s")]
        mine = r.get("decode_tok_s") if "failed" not in r else None
        ratio = None if not rates or mine is None else mine / max(rates)
        # Every fixed split failed: elastic wins, unless it failed too.
        ratios.append(ratio if rates or mine is None else float("inf"))
        if r.get("pressure"):
            pressure.append(i)
    ok = [x is not None and x >= 1 - args.noise for x in ratios]
    first = el[0].get("decode_tok_s") if el and "failed" not in el[0] else None
    last = el[-1].get("decode_tok_s") if el and "failed" not in el[-1] else None
    before = el[pressure[0] - 1].get("decode_tok_s") if pressure and pressure[0] > 0 else None
    return {
        "elastic_vs_best_fixed": [None if x in (None, float("inf")) else x for x in ratios],
        "elastic_at_least_fixed_every_turn": bool(el) and all(ok),
        "elastic_at_least_fixed_outside_pressure": bool(el)
        and all(o for i, o in enumerate(ok) if i not in pressure),
        "elastic_never_failed": bool(el) and all("failed" not in r for r in el),
        "fixed_failed_turns": {
            n: [r["turn"] for r in rows[n] if "failed" in r] for n in ENGINES[1:] if n in rows
        },  # fmt: skip
        "last_over_first_decode": last / first if first and last else None,
        "last_within_12pct_of_first": bool(first and last and last >= (1 - WITHIN) * first),
        "pressure_turns": [el[i]["turn"] for i in pressure],
        "other_process_asked_gb": _gb(takes, "asked"),
        "other_process_got_gb": _gb(takes, "got"),
        "absorbed": takes.get("elastic", {}).get("complete") is True,
        "budget_back_after_release": takes.get("elastic", {}).get("recovery", {}).get("back"),
        **_against_fixed_last(rows, pressure),
        "tok_s_over_pre_pressure": None
        if not before
        else [(r["turn"], (r.get("decode_tok_s") or 0) / before) for r in el[pressure[0] :]],
    }


def plot(report: dict, out: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib missing: no PNG; re-plot from {out} with bench/memory_plot.py --x step")
        return
    from freetoken_agent.bench.memory_plot import plot_split

    png = plot_split(report["memory_trace"], out.with_suffix(".png"), x="step",
                     title=report["title"], turns=report["turns_tok_s"])  # fmt: skip
    print(f"wrote {png}")


def merge(args) -> int:
    """--merge: one report from several runs of the same session (same contexts and args but
    --engines); engines in ENGINES order, the elastic memory trace kept."""
    reports = [json.loads(p.read_text()) for p in args.merge]
    first = reports[0]
    for path, r in zip(args.merge[1:], reports[1:], strict=True):
        same = (r["contexts"], r["model"], r["args"]["seed"], r["args"]["routing"])
        if same != (first["contexts"], first["model"], first["args"]["seed"],
                    first["args"]["routing"]):  # fmt: skip
            return print(f"{path}: not the same session as {args.merge[0]}") or 2
    report = {**first, "engines": {}, "merged_from": [str(p) for p in args.merge]}
    for r in reports:
        report["engines"].update(r["engines"])
        for key in ("memory_trace", "turns_tok_s"):
            if key in r:
                report[key] = r[key]
    report["engines"] = {n: report["engines"][n] for n in ENGINES if n in report["engines"]}
    report["summary"] = summary = summarize(report, args)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))
    if "memory_trace" in report:
        plot(report, args.out)
    print(f"wrote {args.out}")
    return 0
