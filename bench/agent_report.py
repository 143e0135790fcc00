"""The reporting side of `freetoken bench agent`: the engine's documented reuse rules as a model
of what each request should re-prefill, per-mode summaries, the anchors-vs-positional comparison
of edited turns, and the printed table.

    model = CacheModel("positional:1024", hybrid=True, markers=frozenset())
    expected = len(ids) - model.resume(ids)  # tokens the next request should re-prefill
    model.add(ids, anchors, out.token_ids)  # what that request left in the cache
"""

from __future__ import annotations

from freetoken_agent.chat_format import common_prefix


class CacheModel:
    """What the engine's documented rules say it holds: each sent sequence (the tokens it
    computed) with the boundaries its requests checkpointed (engine/kv/checkpoint_mode.py)."""

    def __init__(self, mode: str, hybrid: bool, markers: frozenset[int]) -> None:
        kind, _, n = mode.partition(":")
        self.kind, self.every, self.hybrid, self.markers = kind, int(n or 0), hybrid, markers
        self.sent: list[tuple[list[int], set[int]]] = []

    def add(self, prompt: list[int], anchors: list[int], output: list[int]) -> None:
        seq = prompt + output[:-1]  # the last sampled token is never computed
        n = len(prompt)
        if self.kind == "anchors":
            bounds = {a for a in anchors if 0 < a <= n} | {n}
            bounds |= {n + i for i, t in enumerate(output[:-1]) if t in self.markers}
        elif self.kind == "positional":
            bounds = set(range(self.every, len(seq) + 1, self.every))
        else:
            bounds = set()
        self.sent.append((seq, bounds))

    def resume(self, ids: list[int]) -> int:
        """Tokens of `ids` the next request should reuse (all but the last at most)."""
        best = 0
        for seq, bounds in self.sent:
            shared = common_prefix(seq, ids[:-1])
            if not self.hybrid:
                best = max(best, shared)
            else:
                best = max([best, *(b for b in bounds if b <= shared)])
        return best


def summarize(rows: list[dict]) -> dict:
    worst = max(rows, key=lambda r: r["ttft_s"])
    decode = [r["decode_tok_s"] for r in rows if r["decode_tok_s"]]
    return {
        "worst_ttft_s": worst["ttft_s"],
        "worst_ttft_turn": worst["turn"],
        "worst_ttft_limit_s": worst["ttft_limit_s"],
        "total_prefilled": sum(r["prefilled_tokens"] for r in rows),
        "total_reused": sum(r["reused_tokens"] for r in rows),
        "total_expected_prefill": sum(r["expected_prefill"] for r in rows),
        "turns_off_expected": [
            r["turn"] for r in rows if r["prefilled_tokens"] != r["expected_prefill"]
        ],
        "preempted_turns": [r["turn"] for r in rows if r["preempted"]],
        "mean_decode_tok_s": sum(decode) / len(decode) if decode else None,
        "min_decode_tok_s": min(decode) if decode else None,
    }


def compare(modes: dict) -> dict | None:
    """Edited turns: prefilled tokens per mode, and whether anchors beat positional."""
    positional = next((m for m in modes if m.startswith("positional")), None)
    if "anchors" not in modes or positional is None:
        return None
    by_mode = {m: {r["turn"]: r for r in modes[m]["turns"]} for m in modes}
    rows = []
    for turn, a in by_mode["anchors"].items():
        p = by_mode[positional].get(turn)
        if a["edit"] == "none" or p is None:
            continue
        row = {"turn": turn, "edit": a["edit"]}
        row |= {m: by_mode[m][turn]["prefilled_tokens"] for m in modes if turn in by_mode[m]}
        row["anchors_fewer"] = a["prefilled_tokens"] < p["prefilled_tokens"]
        rows.append(row)
    return {
        "positional": positional,
        "edited": rows,
        "all_anchors_fewer": all(r["anchors_fewer"] for r in rows),
    }


def print_header(mode: str, entry: dict) -> None:
    p = entry["probe"]
    print(
        f"\n[{mode}] {entry['engine']}, built in {entry['build_s']:.1f} s; probe {p['tokens']} "
        f"tokens: prefill {p['prefill_tok_s']:.0f} tok/s, decode {p['decode_tok_s'] or 0:.1f} tok/s"
    )
    columns = ("prompt", "reused", "prefill", "expect", "ttft_s", "limit_s", "of_lim", "dec/s")
    print(f"{'turn':>4} {'edit':<22}" + "".join(f"{c:>9}" for c in columns), flush=True)


def print_row(r: dict) -> None:
    print(
        f"{r['turn']:4d} {r['edit']:<22}{r['prompt_tokens']:9d}{r['reused_tokens']:9d}"
        f"{r['prefilled_tokens']:9d}{r['expected_prefill']:9d}{r['ttft_s']:9.3f}"
        f"{r['ttft_limit_s']:9.3f}{r['ttft_of_limit']:9.2f}{r['decode_tok_s'] or 0:9.1f}",
        flush=True,
    )


def print_summary(s: dict) -> None:
    print(
        f"worst TTFT {s['worst_ttft_s']:.3f} s (turn {s['worst_ttft_turn']}, limit "
        f"{s['worst_ttft_limit_s']:.3f} s); prefilled {s['total_prefilled']} tokens "
        f"(expected {s['total_expected_prefill']}), reused {s['total_reused']}; turns off "
        f"the expected count {s['turns_off_expected']}, preempted {s['preempted_turns']}"
    )


def print_comparison(c: dict, modes: list[str]) -> None:
    print(f"\nedited turns, prefilled tokens (anchors < {c['positional']}?)")
    for r in c["edited"]:
        figures = "  ".join(f"{m} {r[m]}" for m in modes if m in r)
        verdict = "yes" if r["anchors_fewer"] else "NO"
        print(f"{r['turn']:4d} {r['edit']:<22} {figures}  {verdict}")
    print(f"all edited turns: {'yes' if c['all_anchors_fewer'] else 'NO'}")
