"""A CPU smoke run of bench/elastic.py: the whole flow (three engines, a growing session, the
external allocation mid-session) on a tiny random model under a simulated budget."""

from __future__ import annotations

import importlib.util
import json

from freetoken_agent.bench import elastic

ROW_KEYS = {"turn", "context", "pressure", "slots", "kv_pages", "budget_gb", "decode_limit_tok_s"}


def test_cpu_smoke_moves_memory_and_never_fails(tmp_path, capsys):
    out = tmp_path / "elastic_memory.json"
    assert elastic.main(["--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "elastic" in printed and "fixed-first" in printed

    assert set(report["engines"]) == set(elastic.ENGINES)
    contexts = report["contexts"]
    assert len(contexts) == 4 and contexts == sorted(contexts) and contexts[0] < contexts[-1]
    for name, entry in report["engines"].items():
        assert [r["turn"] for r in entry["turns"]] == [1, 2, 3, 4], name
        for row in entry["turns"]:
            assert set(row) >= ROW_KEYS, (name, row)
            assert row["context"] == contexts[row["turn"] - 1]

    el = report["engines"]["elastic"]["turns"]
    assert all("failed" not in r for r in el)
    assert all(r["decoded"] == 8 and r["decode_tok_s"] > 0 for r in el)
    assert el[-1]["reused_tokens"] > 0  # the history was served from the prefix cache
    # The split moved: pages grew with the context, slots gave way.
    assert el[-1]["kv_pages"] > el[0]["kv_pages"] and el[-1]["slots"] < el[0]["slots"]
    records = report["memory_trace"]["records"]
    assert len(records) > 1
    assert len({(r["pages"], r["slots"]) for r in records}) > 1
    # The external allocation: the budget dropped on turn 3 only, and came back.
    assert [r["pressure"] for r in el] == [False, False, True, False]
    assert report["engines"]["elastic"]["pressure_bytes"] > 0
    budgets = [r["budget"] for r in records]
    assert min(budgets) < budgets[0] == budgets[-1]
    assert el[2]["budget_gb"] < el[1]["budget_gb"] == el[3]["budget_gb"]

    # The split tuned for turn 1 cannot hold the later turns: failed, not crashed.
    first = report["engines"]["fixed-first"]["turns"]
    assert "failed" not in first[0] and all("failed" in r for r in first[1:])
    s = report["summary"]
    assert s["elastic_never_failed"] is True
    assert s["fixed_failed_turns"]["fixed-first"] == [2, 3, 4]
    assert s["pressure_turns"] == [3]
    assert len(s["elastic_vs_best_fixed"]) == 4
    assert isinstance(s["last_within_12pct_of_first"], bool)
    assert report["turns_tok_s"] and report["limits"]["b_p_gb_s"] is None  # CPU: no limits
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0
