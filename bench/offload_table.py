"""`bench offload`'s decode figures as one short table (its last lines), so a device run's
output tail holds them whole: the JSON lines before it run to several hundred characters."""

from __future__ import annotations

HEADER = "decode key | tok/s | limit | of limit | miss | on CPU/tok | path (ms/tok of each)"


def decode_table(decode: dict[str, dict]) -> list[str]:
    """One line per decode key ("regime|bN|policy"): tok/s, the limit beside it, the miss rate,
    experts a token on the CPU, and adaptive's kept step path with what each path measured."""
    lines = [HEADER]
    for key, row in decode.items():
        paths = row.get("path_ms_per_token") or {}
        measured = " ".join(f"{p} {ms:.2f}" for p, ms in paths.items())
        path = row.get("step_path") or "-"
        lines.append(
            f"{key} | {row['tok_s']:.1f} | {row.get('limit_tok_s', float('nan')):.1f} | "
            f"{row.get('of_limit', float('nan')):.0%} | {row['miss_rate']:.3f} | "
            f"{row.get('on_cpu_per_token', 0.0):.2f} | {path}{f' ({measured})' if measured else ''}"
        )
    return lines
