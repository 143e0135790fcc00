"""Session: diffs against what was last sent, per-turn reuse, and send() on a real tiny engine.

Diff tests drive the Session with `ScriptedEngine`, which answers with chosen tokens (canonical
tokenizations, so the expected divergence is known exactly) and reuses KV like the real
engine's radix cache: the prompt and every generated token but the last stay cached. The send
tests run the real demo engine and compare with figures computed independently from the
tokenizer and the raw chat template.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from freetoken_agent import Engine
from freetoken_agent import session as session_module
from freetoken_agent.chat_format import ChatFormat, common_prefix
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError, TokenEvent
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.engine.text.detokenizer import IncrementalDetokenizer
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    to_template_messages,
)
from freetoken_agent.parsers import ContentDelta, ReasoningDelta, ToolCallEnd
from freetoken_agent.service import EngineService
from freetoken_agent.session import Session, TextDelta, Usage

WORDS = ["alpha", "beta", "gamma", "café", "你好", "🙂", "x,", "{a:", "1}", "!?"]
_serial = itertools.count()


def rand_text(rng: random.Random, max_words: int = 6) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, max_words))]
    return " ".join([f"w{next(_serial)}", *words, "end"])


def tool_round(rng: random.Random, reasoning: bool = False) -> list:
    calls = [
        ToolCall(f"c{next(_serial)}", "search", {"q": rand_text(rng, 2), "n": rng.randint(0, 99)})
        for _ in range(rng.randint(1, 3))
    ]
    think = rand_text(rng) if reasoning else None
    return [AssistantMessage(rand_text(rng), think, calls)] + [
        ToolResult(c.id, rand_text(rng), name=c.name) for c in calls
    ]


class ScriptedEngine:
    """Engine.stream / stats() as the real engine defines them, answering with given tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.spec = SimpleNamespace(arch="qwen3_moe", is_hybrid=False)  # the demo's
        self.replies: list[list[int]] = []
        self.cached: list[int] = []  # what the radix tree would hold
        self.totals = {"reused": 0, "prefilled": 0, "finished": 0}
        self.prompts: list[list[int]] = []

    def stream(self, prompt: list[int], sampling: SamplingParams) -> Iterator[TokenEvent]:
        self.prompts.append(list(prompt))
        reply = self.replies.pop(0)
        reused = min(common_prefix(self.cached, prompt), len(prompt) - 1)
        detok = IncrementalDetokenizer(self.tokenizer)
        for i, token in enumerate(reply):
            last = i == len(reply) - 1
            yield TokenEvent("r", token, detok.push(token), i, last, "stop" if last else None)
        self.cached = list(prompt) + reply[:-1]
        self.totals["reused"] += reused
        self.totals["prefilled"] += len(prompt) - reused
        self.totals["finished"] += 1

    def stats(self) -> dict:
        t = self.totals
        return {
            "tokens": {"reused": t["reused"], "prefilled": t["prefilled"]},
            "requests": {"finished": t["finished"]},
        }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def scripted_turn(session: Session, history: list, rng: random.Random) -> AssistantMessage:
    """One turn answered with a random canonical reply; returns it as the history's message."""
    text = rand_text(rng)
    end = session.engine.tokenizer.token_to_id("<|im_end|>")
    session.engine.replies.append(session.engine.tokenizer.encode(text) + [end])
    events = list(session.send(history))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
    return AssistantMessage(text)


def independent_ids(tok: Tokenizer, history: list, system: str | None = None) -> list[int]:
    dicts = to_template_messages(([SystemMessage(system)] if system else []) + history)
    return tok.encode(tok.apply_chat_template(dicts))


def test_diff_after_appending_a_turn(tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    session = Session(ScriptedEngine(tok), system=rand_text(rng), parser_factory=None)
    history: list = [UserMessage(rand_text(rng))]
    for _ in range(rng.randint(2, 4)):
        if rng.random() < 0.5:
            history += tool_round(rng)
        sent = session.diff(history).prompt
        assert sent.token_ids == independent_ids(tok, history, session.system)
        reply = scripted_turn(session, history, rng)
        assert session.last_prompt == sent
        assert session.last_sent == sent.token_ids + session.last_output_ids
        history += [reply, UserMessage(rand_text(rng))]
        diff = session.diff(history)
        old = session.last_sent
        # The new prompt extends everything sent (prompt + reply) token for token...
        assert diff.first_divergence == len(old) and diff.prompt.token_ids[: len(old)] == old
        # ...and the engine holds all of it but the reply's last token.
        assert diff.reused_tokens == len(old) - 1
        assert diff.prefill_tokens == len(diff.prompt) - len(old) + 1
        # Deepest anchor: the reply's turn, which starts where the old generation prefix was.
        reply_index = len(history) - 2 + 1  # + the session's system message
        assert diff.anchor == diff.prompt.find("turn_start", reply_index)
        assert diff.anchor.offset == sent.find("generation_prefix", reply_index).offset


def test_generation_prefix_dropped_by_the_template(tok: Tokenizer, rng_seed: int) -> None:
    """With thinking off the generation prompt is "<|im_start|>assistant\n<think>\n\n</think>
    \n\n", but past assistant turns render without the empty block: the next prompt keeps the
    old generation prefix only up to "<|im_start|>assistant\n"."""
    rng = random.Random(rng_seed)
    session = Session(
        ScriptedEngine(tok), chat_format=ChatFormat(tok, enable_thinking=False), parser_factory=None
    )
    history: list = [UserMessage(rand_text(rng))]
    reply = scripted_turn(session, history, rng)
    sent = session.last_prompt
    gen = sent.find("generation_prefix", 1)
    assert sent.generation_prefix == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    history += [reply, UserMessage(rand_text(rng))]
    diff = session.diff(history)
    kept = len(tok.encode("<|im_start|>assistant\n"))
    assert diff.first_divergence == gen.offset + kept
    assert diff.anchor == diff.prompt.find("turn_start", 1) and diff.anchor.offset == gen.offset
    assert diff.reused_tokens == diff.first_divergence


def test_diff_after_editing_a_tool_output(tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    session = Session(ScriptedEngine(tok), parser_factory=None)
    history: list = [UserMessage(rand_text(rng))]
    for _ in range(rng.randint(2, 3)):
        history += tool_round(rng, reasoning=rng.random() < 0.5)
    history.append(AssistantMessage(rand_text(rng)))
    history.append(UserMessage(rand_text(rng)))
    scripted_turn(session, history, rng)
    sent = session.last_sent
    results = [i for i, m in enumerate(history) if isinstance(m, ToolResult)]
    k = rng.choice(results)
    edited = list(history)
    old = history[k]
    truncated = old.content[: rng.randint(1, len(old.content) - 1)]
    cut = "Z" + truncated if rng.random() < 0.5 else truncated + " [truncated]"
    edited[k] = ToolResult(old.tool_call_id, cut, name=old.name)
    diff = session.diff(edited)
    prompt = diff.prompt
    start, out = prompt.find("turn_start", k), prompt.find("tool_output", k)
    following = prompt.find("turn_start", k + 1)
    # The divergence lies inside the edited message, at or after its output's start.
    assert out.offset <= diff.first_divergence < following.offset
    assert diff.anchor.message_index == k and diff.anchor.kind in ("tool_output", "turn_start")
    assert diff.anchor == prompt.deepest_anchor(diff.first_divergence)
    assert start.offset <= diff.anchor.offset <= diff.first_divergence
    # Nothing before the divergence is re-prefilled, everything after it is.
    assert diff.first_divergence == common_prefix(sent, prompt.token_ids)
    assert diff.reused_tokens == diff.first_divergence
    assert diff.prefill_tokens == len(prompt) - diff.first_divergence
    assert diff.resume_offset == diff.anchor.offset


def test_reasoning_stripped_by_the_next_user_message(tok: Tokenizer, rng_seed: int) -> None:
    """Reasoning of a tool round after the last user query is sent; once a new user message
    arrives the template drops it: re-prefill starts at that assistant turn."""
    rng = random.Random(rng_seed)
    session = Session(ScriptedEngine(tok), parser_factory=None)
    history: list = [UserMessage(rand_text(rng))]
    rounds = tool_round(rng, reasoning=True)
    history += rounds
    scripted_turn(session, history, rng)
    first = session.last_prompt
    assistant = 1
    assert first.find("reasoning_start", assistant) is not None
    assert rounds[0].reasoning in first.text
    history += [AssistantMessage(rand_text(rng)), UserMessage(rand_text(rng))]
    diff = session.diff(history)
    assert rounds[0].reasoning not in diff.prompt.text
    assert diff.prompt.find("reasoning_start", assistant) is None
    assert diff.anchor == diff.prompt.find("turn_start", assistant)
    assert diff.first_divergence < first.find("reasoning_start", assistant).offset
    assert diff.reused_tokens == diff.first_divergence


def test_usage_and_turn_stats_come_from_the_engine(tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    engine = ScriptedEngine(tok)
    session = Session(engine, max_tokens=5, parser_factory=None)
    history: list = [UserMessage(rand_text(rng))]
    reply = scripted_turn(session, history, rng)
    history += [reply, UserMessage(rand_text(rng))]
    predicted = session.diff(history)
    engine.replies.append(tok.encode("ok") + [tok.token_to_id("<|im_end|>")])
    events = list(session.send(history))
    usage = events[-1]
    assert isinstance(usage, Usage) and usage.exact
    assert usage.reused_tokens == engine.totals["reused"]  # the first turn reused nothing
    assert usage.reused_tokens == predicted.reused_tokens
    assert usage.prompt_tokens == len(predicted.prompt)
    assert usage.completion_tokens == len(tok.encode("ok")) + 1
    assert [t["turn"] for t in session.turn_stats] == [0, 1]
    stats = session.turn_stats[1]
    assert stats["reused_tokens"] == usage.reused_tokens and stats["source"] == "engine"
    assert stats["first_divergence"] == predicted.first_divergence
    assert stats["anchor"]["message_index"] == predicted.anchor.message_index


def test_session_errors(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="unknown sampling option.*temprature"):
        Session(ScriptedEngine(tok), temprature=0)
    with pytest.raises(InvalidRequestError, match="max_tokens must be a positive"):
        Session(ScriptedEngine(tok), max_tokens=0)
    session = Session(ScriptedEngine(tok), system="s", parser_factory=None)
    with pytest.raises(InvalidRequestError, match="already has system"):
        session.diff([SystemMessage("t"), UserMessage("u")])
    with pytest.raises(InvalidRequestError, match="matches no earlier call"):
        session.diff([UserMessage("u"), ToolResult("x", "y")])


@pytest.mark.parametrize(
    ("tools", "pattern"),
    [
        ("get_weather", "tools must be a list"),
        ({"name": "f"}, "tools must be a list"),
        ([{"description": "no name"}], "tool 0 must be"),
        ([{"type": "function", "function": {"name": ""}}], "tool 0: its function needs"),
        ([{"name": "f", "parameters": "x"}], r"tool 0 \(f\): parameters must be"),
        ([{"name": "f"}, {"type": "retrieval"}], "tool 1 must be"),
    ],
)
def test_malformed_tools_are_refused_at_once(tok: Tokenizer, tools, pattern) -> None:
    """At construction and when set, not at a later render (where a template rendered a
    malformed tool as whatever it made of it)."""
    with pytest.raises(InvalidRequestError, match=pattern):
        Session(ScriptedEngine(tok), tools=tools)
    session = Session(ScriptedEngine(tok), tools=[{"name": "ok", "parameters": {}}])
    with pytest.raises(InvalidRequestError, match=pattern):
        session.tools = tools
    assert session.tools == [{"name": "ok", "parameters": {}}]  # unchanged by the refusal


def test_sampling_must_be_params_or_a_mapping(tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    session = Session(ScriptedEngine(tok), parser_factory=None)
    wrong = rng.choice([5, [("max_tokens", 3)], "max_tokens=3", True])
    with pytest.raises(InvalidRequestError, match="sampling must be SamplingParams or a mapping"):
        list(session.send([UserMessage(rand_text(rng))], wrong))


# --- the real engine --------------------------------------------------------------------------


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def test_send_on_the_demo_engine(engine: Engine, tok: Tokenizer, rng_seed: int) -> None:
    """Two turns on a real engine: the second reuses the first turn's prompt and generated
    tokens as far as the re-rendered history keeps them, as the engine itself reports."""
    rng = random.Random(rng_seed)
    system = rand_text(rng)
    session = Session(
        engine, system=system, temperature=0, max_tokens=rng.randint(3, 8), parser_factory=None
    )
    history: list = [UserMessage(rand_text(rng))]
    events = list(session.send(history))
    usage = events[-1]
    ids1 = independent_ids(tok, history, system)
    gen = session.last_output_ids
    assert isinstance(usage, Usage) and usage.exact
    assert (usage.prompt_tokens, usage.reused_tokens, usage.prefilled_tokens) == (
        len(ids1),
        0,
        len(ids1),
    )
    assert usage.completion_tokens == len(gen) > 0 and usage.finish_reason in ("stop", "length")
    deltas = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert deltas == session.last_output_text == tok.decode(gen)
    assert session.last_sent == ids1 + gen

    history += [AssistantMessage(session.last_output_text), UserMessage(rand_text(rng))]
    predicted = session.diff(history)
    usage2 = list(session.send(history, {"max_tokens": 2}))[-1]
    ids2 = independent_ids(tok, history, system)
    shared = common_prefix(ids1 + gen, ids2)
    expected = min(shared, len(ids1) + len(gen) - 1, len(ids2) - 1)
    assert usage2.exact and usage2.reused_tokens == expected == predicted.reused_tokens
    assert usage2.prefilled_tokens == len(ids2) - expected
    assert usage2.completion_tokens == 2
    # The whole first prompt is kept (the template re-renders the reply after the same
    # "<|im_start|>assistant\n"; a reply starting with a newline may merge with it).
    assert expected >= len(ids1) - 1
    stats = session.turn_stats
    assert [s["reused_tokens"] for s in stats] == [0, expected]
    assert all(s["source"] == "engine" for s in stats)
    engine.check_integrity()


def test_usage_stays_exact_under_concurrency(engine: Engine, rng_seed: int):
    """Another request finishing during the turn moves the engine's counters too; the turn's
    figures come from its own request's final event, exact all the same (the Session once fell
    back to its prediction here, which misses what other sessions put in the prefix cache)."""
    rng = random.Random(rng_seed)
    session = Session(engine, temperature=0, max_tokens=2, ignore_eos=True, parser_factory=None)
    history: list = [UserMessage(rand_text(rng))]
    list(session.send(history))
    history += [AssistantMessage(session.last_output_text), UserMessage(rand_text(rng))]
    predicted = session.diff(history)
    for _ in range(rng.randint(1, 3)):  # finish beside it
        engine.submit([rng.randrange(1, 900) for _ in range(20)], SamplingParams(max_tokens=2))
    before = engine.stats()["tokens"]
    usage = list(session.send(history))[-1]
    assert usage.exact and session.turn_stats[-1]["source"] == "engine"
    assert (usage.reused_tokens, usage.prefilled_tokens) == (
        predicted.reused_tokens,
        predicted.prefill_tokens,
    )
    after = engine.stats()["tokens"]
    assert after["reused"] - before["reused"] > usage.reused_tokens or (
        after["prefilled"] - before["prefilled"] > usage.prefilled_tokens
    )  # the counters did mix the others in: the figures are not their difference


def test_sessions_sharing_a_cached_prefix_report_it_when_concurrent(engine: Engine, rng_seed):
    """Fresh Sessions (ChatFreeToken's pool lends one per call) run at once over a service,
    their prompts sharing a long system message: each reports what the engine reused for its
    own request, whatever finished beside it, and together they add up to the engine's."""
    rng = random.Random(rng_seed)
    system = " ".join(rand_text(rng) for _ in range(40))
    with EngineService(engine) as service:
        first = Session(service, system=system, temperature=0, max_tokens=2, parser_factory=None)
        list(first.send([UserMessage(rand_text(rng))]))  # the prefix, cached
        before = service.stats()["tokens"]
        usages: list = []
        # Drawn before the threads start: which thread runs which is the scheduler's.
        questions = [f"{i} {rand_text(rng)}" for i in range(rng.randint(3, 6))]

        def turn(question: str) -> None:
            session = Session(service, system=system, temperature=0, max_tokens=3,
                              ignore_eos=True, parser_factory=None)  # fmt: skip
            usages.append(list(session.send([UserMessage(question)]))[-1])

        threads = [threading.Thread(target=turn, args=(q,)) for q in questions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        after = service.stats()["tokens"]
    assert len(usages) == len(threads) and all(u.exact for u in usages)
    assert all(u.reused_tokens > 0 for u in usages)  # the system prompt, cached
    assert sum(u.reused_tokens for u in usages) == after["reused"] - before["reused"]
    assert sum(u.prefilled_tokens for u in usages) == after["prefilled"] - before["prefilled"]


def test_closing_early_aborts_and_keeps_what_was_sent(engine: Engine, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    session = Session(engine, temperature=0, max_tokens=50, ignore_eos=True, parser_factory=None)
    history: list = [UserMessage(rand_text(rng))]
    stream = session.send(history)
    first = next(e for e in stream if isinstance(e, TextDelta))
    stream.close()
    assert not engine.has_unfinished()
    assert session.turn_stats[-1]["finish_reason"] == "abort"
    assert session.last_output_text.startswith(first.text)
    assert 0 < len(session.last_output_ids) < 50
    # The aborted request's tokens are cached like a finished one's.
    history += [AssistantMessage(session.last_output_text), UserMessage(rand_text(rng))]
    predicted = session.diff(history)
    usage = list(session.send(history, SamplingParams(max_tokens=1)))[-1]
    assert usage.exact and usage.reused_tokens == predicted.reused_tokens > 0


def test_parser_factory_gets_the_prompt(engine: Engine, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    seen = []

    class Upper:
        def __init__(self, prompt) -> None:
            seen.append(prompt)

        def feed(self, text: str) -> list:
            return [("upper", text.upper())]

        def finish(self) -> list:
            return [("done",)]

    session = Session(engine, parser_factory=Upper, temperature=0, max_tokens=4)
    history = [UserMessage(rand_text(rng))]
    events = list(session.send(history))
    assert seen[0] is session.last_prompt
    assert seen[0].generation_prefix == "<|im_start|>assistant\n"
    assert events[-2] == ("done",) and isinstance(events[-1], Usage)
    text = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == "upper")
    assert text == session.last_output_text.upper()
    # parser_factory=None on one call gives raw deltas again.
    raw = list(session.send(history, parser_factory=None))
    assert all(isinstance(e, TextDelta) for e in raw[:-1])


def test_the_default_parser_is_the_models_own(tok: Tokenizer, rng_seed: int) -> None:
    """DESIGN section 9's `Session(engine, system=..., tools=[...])` yields reasoning, content
    and tool-call events without a parser named (it yielded raw text until the forty-second
    session); `parser_factory=None` still gives the raw text."""
    rng = random.Random(rng_seed)
    thought, answer, n = rand_text(rng), rand_text(rng), rng.randint(0, 999)
    call = json.dumps({"name": "search", "arguments": {"n": n}})
    reply = f"<think>{thought}</think>{answer}<tool_call>\n{call}\n</tool_call>"
    end = tok.token_to_id("<|im_end|>")
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    history = [UserMessage(rand_text(rng))]
    session = Session(ScriptedEngine(tok), system=rand_text(rng), tools=tools)
    session.engine.replies.append(tok.encode(reply) + [end])
    events = list(session.send(history))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEnd)]
    assert reasoning.strip() == thought and content.strip() == answer
    assert calls == [("search", {"n": n})]
    raw = Session(ScriptedEngine(tok), tools=tools, parser_factory=None)
    raw.engine.replies.append(tok.encode(reply) + [end])
    text = "".join(e.text for e in raw.send(history) if isinstance(e, TextDelta))
    assert text == reply


def test_turn_stats_keep_the_most_recent_turns(tok: Tokenizer, rng_seed: int, monkeypatch) -> None:
    """A Session reused for many independent calls (ChatFreeToken's pool) keeps the figures
    of its last RECORDS_KEPT turns, numbered from the Session's first."""
    rng = random.Random(rng_seed)
    kept = rng.randint(2, 4)
    monkeypatch.setattr(session_module, "RECORDS_KEPT", kept)
    session = Session(ScriptedEngine(tok), max_tokens=64, parser_factory=None)
    turns = kept + rng.randint(1, 5)
    for _ in range(turns):
        scripted_turn(session, [UserMessage(rand_text(rng))], rng)
    assert [t["turn"] for t in session.turn_stats] == list(range(turns - kept, turns))
    assert session.turn_stats[-1]["source"] == "engine"
