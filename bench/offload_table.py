"""`bench offload`'s decode figures as one short table (its last lines), so a device run's
output tail holds them whole: the JSON lines before it run to several hundred characters."""

from __future__ import annotations

HEADER = (
    "decode key | tok/s (all sequences) | limit tok/s | of limit | "
    "of the limit with hits beside misses | miss rate | "
    "experts on CPU per token | step path (ms per token each path's trials took) | "
    "mean ms per step outside trials (trials' share of the time)"
)


def decode_table(decode: dict[str, dict]) -> list[str]:
    """One line per decode key ("regime|bN|policy"): tok/s of the batch's sequences together,
    the limit beside it (DESIGN section 7's, and limits.decode_floor_overlapped_s'), the miss
    rate, experts run on the CPU per decoded token (a step of
    batch N makes N tokens: offload_decode.decode_window), and adaptive's kept step path with
    the ms per token each path measured; then the mean step (all N tokens) outside the
    trials."""
    lines = [HEADER]
    for key, row in decode.items():
        paths = row.get("path_ms_per_token") or {}
        measured = " ".join(f"{p} {ms:.2f}" for p, ms in paths.items())
        path = row.get("step_path") or "-"
        lines.append(
            f"{key} | {row['tok_s']:.1f} | {row.get('limit_tok_s', float('nan')):.1f} | "
            f"{row.get('of_limit', float('nan')):.0%} | "
            f"{row.get('of_overlap_limit', float('nan')):.0%} | {row['miss_rate']:.3f} | "
            f"{row.get('on_cpu_per_token', 0.0):.2f} | {path}{f' ({measured})' if measured else ''}"
            f" | {_steps(row.get('step_ms') or {})}"
        )
    return lines


def _steps(step_ms: dict[str, dict]) -> str:
    """The mean step outside adaptive's trials (labels without `~`:
    offload_summaries.step_times_summary) and the trials' share of the window: whether a row
    sits at its kept path's pace or pays for measuring."""
    steady = [s for label, s in step_ms.items() if not label.endswith("~")]
    n = sum(s["n"] for s in steady)
    if not n:
        return "-"
    mean = sum(s["mean_ms"] * s["n"] for s in steady) / n
    trials = sum(s["time_share"] for label, s in step_ms.items() if label.endswith("~"))
    return f"{mean:.2f} ({trials:.0%})"
