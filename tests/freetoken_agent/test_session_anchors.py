"""Agent-history edits on a hybrid model (CPU): each edited turn prefills exactly the tokens
after the deepest checkpointed anchor before its divergence, and generates what a cold full
prefill of the same history generates.

The four edits of issue 5: reasoning stripped from earlier turns (a new user message makes the
template drop it), a tool output truncated, an interrupted turn followed by a steering message,
and two sessions branching from one system prompt and tool list."""

from __future__ import annotations

import random

import pytest
from hybrid_chat import make_hybrid_chat
from scripted_engine import record_requests

from freetoken_agent import Engine, SamplingParams, Session
from freetoken_agent.chat_format import common_prefix
from freetoken_agent.messages import AssistantMessage, ToolCall, ToolResult, UserMessage
from freetoken_agent.service import EngineService
from freetoken_agent.session import Usage

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "file",
    "open",
    "read",
    "write",
    "parse",
    "token",
    "cache",
    "layer",
    "state",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class Tracker:
    """What the engine's tree should hold: every sequence computed so far and the boundaries
    it checkpointed (prompt anchors, prompt end, before generated marker tokens)."""

    def __init__(self, markers: set[int]) -> None:
        self.markers = markers
        self.sent: list[tuple[list[int], set[int]]] = []

    def record(self, prompt, out_ids: list[int]) -> None:
        n = len(prompt.token_ids)
        taken = {a.offset for a in prompt.anchors if 0 < a.offset <= n} | {n}
        # A checkpoint before a generated marker covers the tokens before it, so the last
        # generated token's counts too (scheduler.checkpoint_decode, at its sampling).
        taken |= {n + i for i, t in enumerate(out_ids) if i and t in self.markers}
        # The KV of the last generated token is never computed.
        self.sent.append((prompt.token_ids + out_ids[:-1], taken))

    def resume(self, ids: list[int]) -> int:
        best = 0
        for seq, taken in self.sent:
            limit = min(common_prefix(seq, ids), len(ids) - 1)
            best = max([best, *(b for b in taken if b <= limit)])
        return best


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture
def chat(tmp_path, rng_seed, request):
    ids = make_hybrid_chat(tmp_path, rng_seed, getattr(request, "param", "demo") == "qwen3_5")
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=8192)
    cold = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=8192, checkpoints="none")
    markers = {ids[m] for m in ("<tool_call>", "</think>", "<|im_end|>")}
    return engine, cold, Tracker(markers), random.Random(rng_seed)


def _turn(session: Session, tracker: Tracker, cold: Engine, history, stop_after=None):
    """One request; checks prefilled == len - deepest checkpointed boundary and the cold
    output. Returns (diff, usage, generated ids)."""
    diff = session.diff(history)
    expected = tracker.resume(diff.prompt.token_ids)
    events = session.send(history, SP)
    if stop_after is not None:  # a user interrupt: close the stream mid-generation
        for _, _ in zip(range(stop_after), events, strict=False):
            pass
        events.close()
        usage = None
    else:
        usage = [e for e in events if isinstance(e, Usage)][-1]
    out = list(session.last_output_ids)
    tracker.record(diff.prompt, out)
    if stop_after is None:  # (a closed turn never gets the engine's figures back)
        stats = session.turn_stats[-1]
        assert stats["source"] == "engine"
        assert stats["prefilled_tokens"] == len(diff.prompt) - expected, (expected, diff.anchor)
        assert usage.prefilled_tokens == len(diff.prompt) - expected
        assert cold.generate(diff.prompt.token_ids, SP).token_ids == out
    session.engine.check_integrity()
    return diff, expected, out


def _assistant_with_call(rng, i: int) -> AssistantMessage:
    call = ToolCall(f"call{i}", "read_file", {"path": f"src/{rng.choice(WORDS)}.py"})
    return AssistantMessage("", reasoning=_text(rng, 30), tool_calls=[call])


def test_reasoning_stripped_and_tool_output_truncated(chat):
    engine, cold, tracker, rng = chat
    session = Session(engine, system=_text(rng, 60), tools=TOOLS)
    history = [UserMessage(_text(rng, 12))]
    _turn(session, tracker, cold, history)
    for i in range(2):
        history += [_assistant_with_call(rng, i), ToolResult(f"call{i}", _text(rng, 120))]
        _turn(session, tracker, cold, history)
    # A new user message: the template now drops the reasoning of the earlier turns.
    history.append(UserMessage(_text(rng, 10)))
    diff, resume, _ = _turn(session, tracker, cold, history)
    assistant_at = diff.prompt.find("turn_start", 2)
    assert diff.first_divergence < len(session.last_prompt) - 10, "the edit is not early"
    assert resume == diff.resume_offset  # the deepest anchor before the divergence
    assert resume >= assistant_at.offset
    # The agent truncates the first tool output to save context.
    first_output = history[2]
    history[2] = ToolResult(first_output.tool_call_id, first_output.content[:40])
    diff, resume, _ = _turn(session, tracker, cold, history)
    assert resume == diff.resume_offset
    assert diff.anchor.kind in ("tool_output", "turn_start")


def test_interrupted_turn_then_steering(chat):
    engine, cold, tracker, rng = chat
    session = Session(engine, system=_text(rng, 40), tools=TOOLS)
    history = [UserMessage(_text(rng, 12))]
    _turn(session, tracker, cold, history, stop_after=2)
    partial = session.last_output_text
    history += [AssistantMessage(partial), UserMessage("stop, " + _text(rng, 8))]
    diff, resume, _ = _turn(session, tracker, cold, history)
    assert resume == diff.resume_offset or resume > diff.resume_offset  # never behind it
    assert resume >= diff.prompt.find("turn_start", 1).offset


@pytest.mark.parametrize("chat", ["demo", "qwen3_5"], indirect=True)
def test_two_sessions_branch_from_one_prefix(chat):
    """Two sessions sharing system prompt and tools resume after them. Also under the Qwen3.5
    template, which refuses [system] alone: the first user turn's anchor is found another way."""
    engine, cold, tracker, rng = chat
    system = _text(rng, 80)
    a = Session(engine, system=system, tools=TOOLS)
    b = Session(engine, system=system, tools=TOOLS)
    _turn(a, tracker, cold, [UserMessage(_text(rng, 9))])
    diff, resume, _ = _turn(b, tracker, cold, [UserMessage("other " + _text(rng, 9))])
    user_turn = diff.prompt.find("turn_start", 1)
    assert resume == user_turn.offset > 0  # the shared system prompt and tools, not re-run


def _edited_turns(target, engine: Engine, rng: random.Random) -> list:
    """Two sessions on `target` (`engine` or a service of it) send a turn each, then each the
    same turn with its end edited: (the diff predicted before the edited turn, its engine
    request) per session."""
    system = _text(rng, 50)
    sessions = [Session(target, system=system, tools=TOOLS) for _ in range(2)]
    histories = [[UserMessage(_text(rng, 30))] for _ in sessions]
    for s, h in zip(sessions, histories, strict=True):
        list(s.send(h, SP))
    requests = record_requests(engine)
    turns = []
    for s, h in zip(sessions, histories, strict=True):
        h[0] = UserMessage(h[0].content + " " + _text(rng, rng.randint(1, 3)))  # edit its end
        diff = s.diff(h)
        list(s.send(h, SP))
        turns.append((diff, requests[-1]))
    return turns


def test_the_predicted_reuse_of_a_hybrid_is_where_the_engine_resumes(chat):
    """What the Session predicts a turn reuses (its Usage when the engine's own figures cannot
    be told apart from another session's: overlapping turns, exact False) is, for a hybrid
    model, the deepest anchor at or before the divergence, where the engine resumes: not the
    divergence itself."""
    engine, _, _, rng = chat
    for diff, request in _edited_turns(engine, engine, rng):
        assert diff.resume_offset < diff.first_divergence  # the edit is past the anchor
        assert diff.reused_tokens == diff.resume_offset == request.num_reused
        assert diff.prefill_tokens == len(diff.prompt) - diff.resume_offset


def test_the_predicted_reuse_follows_the_engines_checkpoint_mode(chat, tmp_path):
    """The same prediction under the other checkpoint modes: positional:N resumes at the last
    multiple of N, none reuses nothing (the Session predicted the anchor's offset for both,
    through an EngineService too)."""
    _, _, _, rng = chat
    mode = rng.choice(["none", f"positional:{rng.randint(8, 64)}"])
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=8192, checkpoints=mode)
    target = rng.choice([engine, EngineService(engine)])
    for diff, request in _edited_turns(target, engine, rng):
        assert diff.reused_tokens == request.num_reused, mode
    if target is not engine:
        target.close()
