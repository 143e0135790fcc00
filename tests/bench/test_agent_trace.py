"""bench/agent_trace.py (the agent-session generator) and a CPU smoke run of bench/agent.py.

The default sessions (20 turns, past 40k tokens, about 2 s each) are generated once per module:
the coding one at seed 0, the tools one at a fresh seed (printed).
"""

from __future__ import annotations

import json
import math
import os
import random
import time

import pytest

from freetoken_agent.bench import agent
from freetoken_agent.bench.agent_trace import (
    EDITS,
    AgentTrace,
    SessionShape,
    TraceTurn,
    demo_tokenizer,
    generate_session,
)
from freetoken_agent.chat_format import common_prefix


@pytest.fixture(scope="module")
def coding() -> AgentTrace:
    return generate_session("coding", 0)


@pytest.fixture(scope="module")
def tools() -> AgentTrace:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"tools session seed={seed}")
    return generate_session("tools", seed)


@pytest.fixture(params=["coding", "tools"])
def session(request) -> AgentTrace:
    return request.getfixturevalue(request.param)


def sent(turn: TraceTurn) -> list[int]:
    return turn.prompt_ids + turn.generated_ids


def text(ids: list[int]) -> str:
    return demo_tokenizer().decode(ids, skip_special_tokens=False)


def test_same_seed_same_tokens_other_seed_others(rng_seed: int, coding: AgentTrace) -> None:
    small = SessionShape.small()
    a, b = (generate_session("tools", rng_seed, 6, small) for _ in range(2))
    c = generate_session("tools", rng_seed + 1, 6, small)
    assert [t.prompt_ids for t in a.turns] == [t.prompt_ids for t in b.turns]
    assert [t.generated_ids for t in a.turns] == [t.generated_ids for t in b.turns]
    assert a.to_json() == b.to_json() | {"render_s": a.render_s}
    assert a.turns[0].prompt_ids != c.turns[0].prompt_ids
    again = generate_session("coding", 0)
    assert [t.prompt_ids for t in again.turns] == [t.prompt_ids for t in coding.turns]
    assert again.turns[-1].generated_ids == coding.turns[-1].generated_ids


def test_sizes(session: AgentTrace) -> None:
    turns = session.turns
    assert len(turns) == 20 and session.final_context > 40_000
    first = text(turns[0].prompt_ids)
    system = first[: first.index("<|im_end|>") + len("<|im_end|>\n")]
    assert 2700 <= len(demo_tokenizer().encode(system)) <= 3300
    n_tools = first.count('{"type": "function"')
    assert 8 <= n_tools <= 12 and n_tools == len(session.tools)
    for turn, after in zip(turns, turns[1:], strict=False):
        assert 100 <= turn.reasoning_tokens <= 700 or turn.cut
        if turn.cut:
            continue
        # The newest tool response of the next request is this turn's output, as rendered.
        rendered = text(after.prompt_ids).rsplit("<tool_response>\n", 1)[1]
        output = rendered.split("\n</tool_response>", 1)[0]
        n = len(demo_tokenizer().encode(output))
        assert 200 <= n <= 4000 and n == turn.tool_output_tokens


def test_every_edit_kind_and_where_it_diverges(session: AgentTrace) -> None:
    turns = session.turns
    assert {t.edit for t in turns} == set(EDITS)
    think = demo_tokenizer().token_to_id("<think>")
    for turn in turns[1:]:
        ids, at = turn.prompt_ids, turn.diverge_at
        # diverge_at is the longest prefix shared with anything sent before, and it is shared.
        shared = [common_prefix(sent(t), ids) for t in turns[: turn.index]]
        assert max(shared) == at == shared[turn.diverge_from]
        earlier = sent(turns[turn.diverge_from])
        assert earlier[:at] == ids[:at] and (at == len(earlier) or earlier[at] != ids[at])
        assert 0 < turn.deepest_anchor <= at
        before = text(earlier[:at])
        if turn.edit == "none":  # the history only grew: everything sent before is kept
            assert at == len(sent(turns[turn.index - 1]))
        elif turn.edit in ("reasoning_stripped", "interrupted"):
            # Inside an earlier assistant turn: its reasoning was sent, now it is gone.
            assert before.endswith("<|im_start|>assistant\n") and earlier[at] == think
            assert ids[at] != think and at - turn.deepest_anchor < 8
            assert "<|im_start|>user\n" in text(ids[at:])
        else:  # inside an earlier tool output, now shortened
            assert before.rfind("<tool_response>") > before.rfind("</tool_response>")
            assert "truncated to save context" in text(ids[at:])
            # It resumes where that output starts: its tool_output anchor.
            resume = text(ids[: turn.deepest_anchor]).rstrip("\n")
            assert resume.endswith("<tool_response>")
    for turn in turns:
        if turn.edit == "interrupted":
            cut = turns[turn.index - 1]
            assert cut.cut and cut.tool is None and "</think>" not in text(cut.generated_ids)
            assert "Stop, wait." in text(turn.prompt_ids[turn.diverge_at :])


def test_anchors_sorted_inside_and_shared(session: AgentTrace) -> None:
    seen: set[int] = set()
    for turn in session.turns:
        a = turn.anchors
        assert a == sorted(set(a)) and a[0] >= 0 and a[-1] <= len(turn.prompt_ids)
        assert len(a) >= 3 * (turn.index + 1)  # turn starts at least, reasoning, calls...
        if turn.index:
            assert turn.deepest_anchor in a and turn.deepest_anchor in seen
        seen |= set(a)


def test_cpu_smoke_replay(tmp_path, rng_seed: int, one_cpu_thread) -> None:
    out = tmp_path / "agent.json"
    start = time.perf_counter()
    assert agent.main(["--cpu-smoke", "--seed", str(rng_seed % 1000), "--out", str(out)]) == 0
    assert time.perf_counter() - start < 60
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert list(modes) == ["anchors", "positional:256", "none"]
    hybrid = "qwen3_5_moe_text" in modes["anchors"]["engine"]
    for mode, entry in modes.items():
        rows = entry["turns"]
        assert [r["turn"] for r in rows] == [0, 1, 2, 3]
        for r in rows:
            assert r["reused_tokens"] + r["prefilled_tokens"] == r["prompt_tokens"]
            assert r["prefilled_tokens"] >= r["min_prefill"] and r["ttft_s"] > 0
            assert r["prefilled_tokens"] == r["expected_prefill"] and not r["preempted"], (mode, r)
        assert entry["summary"]["total_prefilled"] == sum(r["prefilled_tokens"] for r in rows)
        if hybrid and mode == "anchors":  # resumes within the anchor bound of the trace
            assert all(r["prefilled_tokens"] <= r["anchor_prefill"] for r in rows)
    comparison = report["comparison"]
    assert [r["turn"] for r in comparison["edited"]] == [
        r["turn"] for r in modes["anchors"]["turns"] if r["edit"] != "none"
    ]
    if hybrid:
        total = {m: e["summary"]["total_prefilled"] for m, e in modes.items()}
        assert total["anchors"] < total["none"] and modes["none"]["turns"][1]["reused_tokens"] == 0
        assert "checkpoints" in modes["anchors"]["engine_stats"]


def test_cpu_smoke_without_the_anchor_api(tmp_path, monkeypatch, one_cpu_thread) -> None:
    """An engine without checkpoints= and anchors= (before they landed) still replays."""
    bare = agent.Support(False, frozenset())
    monkeypatch.setattr(agent.Support, "detect", staticmethod(lambda: bare))
    out = tmp_path / "agent.json"
    argv = ["--cpu-smoke", "--turns", "3", "--modes", "anchors", "--out", str(out)]
    assert agent.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["support"] == {"checkpoints": False, "submit": []}
    assert len(report["modes"]["anchors"]["turns"]) == 3 and report["comparison"] is None


def test_the_ttft_reference_counts_streamed_chunks_not_tokens(rng_seed):
    """bench agent's TTFT reference on an offloaded engine: a chunk streams every layer's
    experts whatever its length, so re-prefills that stream as many chunks get the same
    reference, the probe's time per chunk (it was tokens / the probe's rate: a 300-token
    re-prefill was rated at a twentieth of its chunk's time); one too short to stream, and a
    resident engine's, scale by tokens."""
    from types import SimpleNamespace

    from freetoken_agent.bench.agent import ttft_reference_s

    rng = random.Random(rng_seed)
    chunk, stream_min = rng.choice([1024, 2048, 8192]), rng.choice([128, 512])
    probe_tokens = rng.randint(1, 4) * chunk
    probe = {"tokens": probe_tokens, "ttft_s": rng.uniform(0.1, 3)}
    probe["prefill_tok_s"] = probe_tokens / probe["ttft_s"]

    def engine(bank: object) -> SimpleNamespace:  # (no recurrent layers: whole chunks)
        config = SimpleNamespace(max_batched_tokens=chunk)
        scheduler = SimpleNamespace(recurrence=None)
        return SimpleNamespace(loaded=SimpleNamespace(bank=bank), config=config,
                               scheduler=scheduler)  # fmt: skip

    offloaded = engine(SimpleNamespace(stream_min_tokens=stream_min))
    per_chunk = probe["ttft_s"] / (probe_tokens // chunk)
    k = rng.randint(1, 3)
    short, long = (k - 1) * chunk + stream_min, k * chunk  # both stream k chunks
    for tokens in (short, long):
        got = ttft_reference_s(offloaded, tokens, probe)
        assert math.isclose(got, k * per_chunk), (tokens, chunk, stream_min)
    tiny = rng.randint(1, stream_min - 1)
    assert math.isclose(ttft_reference_s(offloaded, tiny, probe), tiny / probe["prefill_tok_s"])
    resident = engine(SimpleNamespace())
    assert math.isclose(ttft_reference_s(resident, short, probe), short / probe["prefill_tok_s"])
