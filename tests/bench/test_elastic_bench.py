"""A CPU smoke run of bench/elastic.py: the whole flow (three engines, a growing session, another
program taking memory mid-session on a simulated device) on a tiny random model under a
simulated budget; and the decode-only synthetic routing its --routing installs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random

import numpy as np
import torch

from freetoken_agent.bench import elastic, elastic_engines
from freetoken_agent.bench.routing_traces import Regime, TracedRouting, TraceGenerator

ROW_KEYS = {"turn", "context", "pressure", "slots", "kv_pages", "budget_gb", "decode_limit_tok_s"}
ROW_KEYS |= {"mapped_gb", "free_gb", "compiles"}


def test_cpu_smoke_moves_memory_and_never_fails(tmp_path, capsys, rng_seed):
    out = tmp_path / "elastic_memory.json"
    # A fresh session (its tokens, and so the routing) each run; the weights are seed 0.
    assert elastic.main(["--cpu-smoke", "--seed", str(rng_seed), "--out", str(out)]) == 0
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
    # Another program took memory before turn 3 and gave it back before turn 4. Nobody set the
    # elastic budget: it dropped because free memory did, the arena unmapped at least what the
    # take needed beyond what was free, the take got all it asked, and the budget came back.
    assert [r["pressure"] for r in el] == [False, False, True, False]
    p = report["engines"]["elastic"]["pressure"]
    assert p["asked"] > 0 and p["complete"] is True and p["got"] == p["asked"]
    assert p["got"] > p["leave"] == p["free_after_ballast"]  # more than was free at the start
    st = report["engines"]["elastic"]["stats"]["elastic"]
    assert st["user_budget"] == min(report["args"]["budget"], st["max_budget"])  # as loaded
    assert st["released_bytes"] > 0
    # Free memory dropped under the take (read as the take landed: by the pressure turn's own
    # start the engine has yielded, and now that a split never holds a slot beyond its budget,
    # the free memory it leaves there can match the calm turns'), and came back.
    calm_free = min(el[1]["free_gb"], el[3]["free_gb"]) * 1e9
    assert p["free"] < calm_free and p["recovery"]["back"] is True
    assert el[3]["free_gb"] * 1e9 >= p["free"]
    assert el[2]["budget_gb"] < el[1]["budget_gb"] == el[3]["budget_gb"]
    unmapped = round((el[1]["mapped_gb"] - el[2]["mapped_gb"]) * 1e9)
    assert unmapped >= p["asked"] - p["leave"]
    assert p["budget_under"] < p["budget_before"] == p["recovery"]["budget"]
    assert p["recovery"]["back"] is True
    budgets = [r["budget"] for r in records]
    assert min(budgets) < budgets[0] == budgets[-1]
    # The fixed splits cannot give memory back: the other program got only what was free.
    for name in ("fixed-first", "fixed-last"):
        fp = report["engines"][name]["pressure"]
        assert fp["asked"] == p["asked"] and fp["complete"] is False
        assert fp["got"] == fp["free_after_ballast"] < fp["asked"], name
        assert all(r["mapped_gb"] is None for r in report["engines"][name]["turns"])

    # The split tuned for turn 1 cannot hold the later turns: failed, not crashed.
    first = report["engines"]["fixed-first"]["turns"]
    assert "failed" not in first[0] and all("failed" in r for r in first[1:])
    s = report["summary"]
    assert s["elastic_never_failed"] is True
    assert s["fixed_failed_turns"]["fixed-first"] == [2, 3, 4]
    assert s["pressure_turns"] == [3]
    assert s["absorbed"] is True and s["budget_back_after_release"] is True
    got, asked = s["other_process_got_gb"], s["other_process_asked_gb"]
    assert got["elastic"] == asked["elastic"] > max(got["fixed-first"], got["fixed-last"])
    assert len(s["elastic_vs_best_fixed"]) == 4
    assert isinstance(s["last_within_12pct_of_first"], bool)
    assert report["turns_tok_s"] and report["limits"]["b_p_gb_s"] is None  # CPU: no limits
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0


def test_traced_routing_replays_decode_and_passes_prefill_through(rng_seed):
    rng = random.Random(rng_seed)
    layers, experts, k = rng.randrange(1, 5), rng.randrange(8, 64), 2
    max_tokens = rng.randrange(1, 8)
    regime = Regime(skew=rng.uniform(0, 1.5), locality=rng.uniform(0, 0.9))
    seen = []
    bank = lambda layer, hidden, ids, weights: seen.append(ids) or hidden  # noqa: E731
    routing = TracedRouting(bank, TraceGenerator(layers, experts, k, regime, rng_seed), max_tokens)
    twin = TraceGenerator(layers, experts, k, regime, rng_seed)  # the same draws, in order
    for _ in range(20):
        layer = rng.randrange(layers)
        n = rng.choice([rng.randrange(1, max_tokens + 1), rng.randrange(max_tokens + 1, 64)])
        router_ids = torch.randint(experts, (n, k))
        routing(layer, torch.zeros(n, 4), router_ids, torch.ones(n, k))
        if n <= max_tokens:  # decode: the regime's draws replace the router's
            assert np.array_equal(seen[-1].numpy(), twin.draw(layer, n))
        else:  # a prefill chunk keeps the router's own ids, and draws nothing
            assert seen[-1] is router_ids


def test_cpu_smoke_with_synthetic_decode_routing(tmp_path, rng_seed, monkeypatch):
    traced = []

    class Counting(TracedRouting):
        def __call__(self, layer, hidden, topk_ids, topk_weights):
            if topk_ids.shape[0] <= self.max_tokens:
                traced.append(topk_ids.shape[0])
            return super().__call__(layer, hidden, topk_ids, topk_weights)

    monkeypatch.setattr(elastic_engines, "TracedRouting", Counting)
    out = tmp_path / "elastic.json"
    argv = ["--cpu-smoke", "--engines", "elastic", "--routing", "zipf:1.0,loc:0.5"]
    assert elastic.main([*argv, "--seed", str(rng_seed % 10_000), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    el = report["engines"]["elastic"]["turns"]
    assert all("failed" not in r and r["decoded"] == 8 for r in el)
    # Every decode step of every turn (and of the warm-up) went through the regime.
    steps = sum(r["decoded"] - 1 for r in el) + 1
    assert len(traced) >= steps * report["model"]["num_hidden_layers"]


def test_summary_never_counts_a_failed_elastic_turn_as_a_win(rng_seed):
    rng = random.Random(rng_seed)
    n = rng.randrange(1, 6)
    failed = [{"turn": t + 1, "failed": "refused"} for t in range(n)]
    report = {"engines": {name: {"turns": list(failed)} for name in elastic.ENGINES}}
    args = argparse.Namespace(noise=0.03)
    s = elastic.summarize(report, args)
    assert s["elastic_at_least_fixed_every_turn"] is False and s["elastic_never_failed"] is False
    assert s["absorbed"] is False and s["other_process_got_gb"]["elastic"] is None
    # Only the fixed splits failed: elastic wins those turns.
    ok = [{"turn": t + 1, "decode_tok_s": rng.uniform(1, 100)} for t in range(n)]
    report["engines"]["elastic"]["turns"] = ok
    s = elastic.summarize(report, args)
    assert s["elastic_at_least_fixed_every_turn"] is True and s["elastic_never_failed"] is True


def test_summary_gives_elastic_over_fixed_last_beside_fixed_last_noise(rng_seed):
    """One figure for elastic against fixed-last (the geometric mean outside pressure turns)
    and the noise to read it against (fixed-last's median turn-to-turn change)."""
    rng = random.Random(rng_seed)
    n, ratio, swing = rng.randrange(6, 12), rng.uniform(0.8, 1.2), rng.uniform(1.01, 1.3)
    fixed = [50 * swing ** (t % 2) for t in range(n)]  # alternates: every change is log(swing)
    pressed = rng.randrange(n)
    el = [{"turn": t + 1, "decode_tok_s": f * ratio, "pressure": t == pressed}
          for t, f in enumerate(fixed)]  # fmt: skip
    el[pressed]["decode_tok_s"] = 1.0  # a pressure turn does not count
    fl = [{"decode_tok_s": f} for f in fixed]
    report = {"engines": {"elastic": {"turns": el}, "fixed-last": {"turns": fl}}}
    s = elastic.summarize(report, argparse.Namespace(noise=0.03))
    assert abs(s["elastic_over_fixed_last_geomean"] - ratio) < 1e-9
    assert abs(s["fixed_last_turn_to_turn_change"] - math.log(swing)) < 1e-9


def test_merge_joins_engines_run_separately(tmp_path, rng_seed):
    """--engines split across runs (device commands have a time limit) and --merge: one
    report with every engine, the elastic trace, and the summary over all of them."""
    seed = ["--cpu-smoke", "--seed", str(rng_seed)]
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    assert elastic.main([*seed, "--engines", "elastic", "--out", str(a)]) == 0
    assert elastic.main([*seed, "--engines", "fixed-first", "fixed-last", "--out", str(b)]) == 0
    assert elastic.main(["--merge", str(b), str(a), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["engines"]) == list(elastic.ENGINES)
    assert report["memory_trace"] == json.loads(a.read_text())["memory_trace"]
    s = report["summary"]
    assert len(s["elastic_vs_best_fixed"]) == 4 and s["fixed_failed_turns"]["fixed-first"]
    assert s["fixed_failed_turns"] == {
        n: [r["turn"] for r in json.loads(b.read_text())["engines"][n]["turns"] if "failed" in r]
        for n in ("fixed-first", "fixed-last")
    }
    # Another session (other seed) does not merge.
    c = tmp_path / "c.json"
    other = ["--cpu-smoke", "--seed", str(rng_seed + 1), "--engines", "elastic", "--out", str(c)]
    assert elastic.main(other) == 0
    assert elastic.main(["--merge", str(a), str(c), "--out", str(tmp_path / "x.json")]) == 2


def test_cpu_smoke_on_the_hybrid_shape_resumes_from_anchors(tmp_path, rng_seed):
    """--shape qwen3.6-35b-a3b (gated DeltaNet with every 4th layer full attention): each
    turn resumes from the checkpoint at the previous prompt's end, the elastic engine never
    fails and absorbs the other program, as on the attention-only shape."""
    out = tmp_path / "hybrid.json"
    argv = ["--cpu-smoke", "--shape", "qwen3.6-35b-a3b", "--seed", str(rng_seed)]
    assert elastic.main([*argv, "--engines", "elastic", "fixed-last", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"]["model_type"] == "qwen3_5_moe_text"
    el = report["engines"]["elastic"]["turns"]
    contexts = report["contexts"]
    assert all("failed" not in r for r in el)
    for prev, row in zip(el, el[1:], strict=False):  # the previous prompt, from its checkpoint
        assert row["reused_tokens"] == prev["context"]
        assert row["prefilled_tokens"] == row["context"] - prev["context"]
    assert [r["context"] for r in el] == contexts
    p = report["engines"]["elastic"]["pressure"]
    assert p["complete"] is True and p["got"] == p["asked"]
    assert report["summary"]["absorbed"] is True
    # The split never asks the arena for more than it holds: the checkpoint tier shrinking
    # below its load-time size once left budget the arena could not take, and the policy's
    # pages squeezed the slots to one (miss rate 1.0).
    fixed_slots = report["engines"]["fixed-last"]["turns"][0]["slots"]
    assert min(r["slots"] for r in el) > fixed_slots // 2


def test_turn_watch_reports_each_turns_progress(tmp_path, capsys, rng_seed):
    """--heartbeat-s 0: a line before every step of every turn, naming the turn, the request's
    progress and the split, so a device log shows whether a long turn crawls, loops or stalls."""
    import re

    out = tmp_path / "watch.json"
    argv = ["--cpu-smoke", "--seed", str(rng_seed), "--engines", "elastic", "--out", str(out)]
    assert elastic.main([*argv, "--heartbeat-s", "0", "--stall-s", "0"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("watch turn")]
    pat = re.compile(r"watch turn (\d+) .*computed (\d+)/(\d+) out (\d+) .*step (\d+) budget")
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for line in lines:
        m = pat.search(line)
        assert m, line
        turn, computed, total, n_out, step = map(int, m.groups())
        assert computed <= total
        seen.setdefault(turn, []).append((step, computed, n_out))
    report = json.loads(out.read_text())
    rows = report["engines"]["elastic"]["turns"]
    assert sorted(seen) == [r["turn"] for r in rows]
    for turn, beats in seen.items():
        steps = [s for s, _, _ in beats]
        assert steps == sorted(steps) and len(set(steps)) == len(steps), turn
        outs = [o for _, _, o in beats]
        assert outs == sorted(outs), turn  # the answer only grows within a turn
        # one beat per step: the last one comes before the step that finished the answer
        assert outs[-1] == rows[turn - 1]["decoded"] - 1, turn


def test_cpu_smoke_interleaved_runs_each_turn_on_every_engine_in_alternating_order(
    tmp_path, capsys, rng_seed
):
    out = tmp_path / "elastic.json"
    names = ["elastic", "fixed-last"]
    argv = ["--cpu-smoke", "--interleave", "--engines", *names, "--profile-top", "0"]
    assert elastic.main([*argv, "--seed", str(rng_seed % 10_000), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    printed = [line.split()[:2] for line in capsys.readouterr().out.splitlines()
               if line.split()[:1] in (["elastic"], ["fixed-last"])]  # fmt: skip
    rows = [(name, int(turn)) for name, turn in printed if turn.isdigit()]
    # Turn by turn, every engine, forward on odd turns and backward on even ones.
    expect = [(n, t) for t in range(1, 5) for n in (names if t % 2 else names[::-1])]
    assert rows == expect, rows
    el, fl = (report["engines"][n]["turns"] for n in names)
    assert all("failed" not in r for r in el + fl)
    assert [r["pressure"] for r in el] == [r["pressure"] for r in fl] == [False, False, True, False]
    # The other program's take is polled on the elastic engine, which gives it all it asks.
    p = report["engines"]["elastic"]["pressure"]
    assert p["complete"] is True and p["got"] == p["asked"] > 0
    assert report["engines"]["fixed-last"]["pressure"] == {"shared_with": "elastic"}
    assert report["memory_trace"]["records"]
    assert len(report["summary"]["elastic_vs_best_fixed"]) == 4


def test_interleaved_decode_alternates_blocks_with_the_first_engine_rotating(rng_seed):
    from freetoken_agent.bench.elastic_session import _decode_in_blocks

    r = random.Random(rng_seed)
    log: list[tuple[str, int]] = []

    class Run:  # a turn with `left` decode steps
        def __init__(self, name: str, left: int) -> None:
            self.name, self.left = name, left

        @property
        def done(self) -> bool:
            return self.left == 0

        def decode(self, steps):
            k = self.left if steps is None else min(steps, self.left)
            self.left -= k
            log.append((self.name, k))

    block = r.randrange(2, 6)
    runs = [Run(n, r.randrange(1, 40)) for n in ("a", "b", "c")]
    want = {run.name: run.left for run in runs}
    _decode_in_blocks(runs, block)
    assert all(run.done for run in runs)
    assert {n: sum(k for m, k in log if m == n) for n in want} == want
    assert all(0 < k <= block for _, k in log)
    rounds, i = [], 0  # the log cut into rounds: each engine at most once, in rotated order
    while i < len(log):
        names = []
        while i < len(log) and log[i][0] not in names:
            names.append(log[i][0])
            i += 1
        rounds.append(names)
    for k, names in enumerate(rounds[:3]):
        if len(names) == 3:  # every run still decoding: the first one rotates
            assert names == ["abc"[(k + j) % 3] for j in range(3)], rounds
    log.clear()
    runs = [Run(n, r.randrange(1, 40)) for n in ("a", "b")]
    _decode_in_blocks(runs, None)  # whole: one call each
    assert [n for n, _ in log] == ["a", "b"]


def test_a_turn_on_an_engine_that_could_not_be_built_is_a_failed_row():
    from types import SimpleNamespace

    from freetoken_agent.bench.elastic_session import SessionTurn

    reason = f"OutOfMemoryError: {random.randrange(10**6)} bytes"
    turn = SessionTurn(SimpleNamespace(), 3, [1, 2, 3], None, {"build_error": reason}, None, True)
    assert turn.done
    turn.decode(None)  # nothing to decode, and no error
    row = turn.finish(limits=None)
    assert row == {"turn": 3, "context": 3, "pressure": False, "failed": f"not built: {reason}"}
