"""Tool hooks: edit or veto calls, edit results, and the anchor an edited result touches."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from freetoken_agent import Engine
from freetoken_agent import session as session_module
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.hooks import ToolHooks, run_tool
from freetoken_agent.messages import AssistantMessage, ToolCall, ToolResult, UserMessage
from freetoken_agent.session import Session


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def session(model_dir: Path) -> Session:
    engine = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=2048, max_model_len=512)
    return Session(engine, temperature=0, max_tokens=1)


def rand_args(rng: random.Random) -> dict:
    return {
        f"a{i}": rng.choice([rng.randint(-99, 99), f"s{rng.randrange(10**6)}"])
        for i in range(rng.randint(1, 4))
    }


def test_before_hook_edits_arguments(session: Session, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    call = ToolCall("c1", "echo", rand_args(rng))
    extra = rng.randrange(10**6)
    got = []

    def add_arg(c: ToolCall, s: Session) -> ToolCall:
        assert s is session
        return ToolCall(c.id, c.name, {**c.arguments, "extra": extra})

    session.hooks.before.append(add_arg)
    result = session.run_tool(call, lambda **kw: got.append(kw) or kw)
    assert got == [{**call.arguments, "extra": extra}]
    assert call.arguments.get("extra") is None  # the model's call is left as it was
    run = session.tool_runs["c1"]
    assert run.arguments_edited and not run.vetoed and not run.result_edited
    assert result.tool_call_id == "c1" and result.name == "echo" and not result.is_error
    assert result.content == str(result.content) and str(extra) in result.content  # JSON


def test_veto_skips_the_tool(session: Session, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    calls = []
    session.hooks.before.append(lambda c, s: None if c.name == "rm" else c)
    result = session.run_tool(ToolCall("c2", "rm", rand_args(rng)), lambda **kw: calls.append(kw))
    assert calls == [] and result.is_error and "rm" in result.content
    assert session.tool_runs["c2"].vetoed and session.tool_runs["c2"].raw_result is None
    ok = session.run_tool(ToolCall("c3", "ls", {}), lambda: "listing")
    assert ok.content == "listing" and not ok.is_error


def test_after_hooks_compose_and_truncate(session: Session, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    limit = rng.randint(5, 20)
    text = "".join(rng.choice("abcdef ") for _ in range(rng.randint(limit + 1, 200)))

    def truncate(c: ToolCall, r: ToolResult, s: Session) -> ToolResult:
        return ToolResult(r.tool_call_id, r.content[:limit], r.is_error, r.name)

    def mark(c: ToolCall, r: ToolResult, s: Session) -> ToolResult:
        return ToolResult(r.tool_call_id, r.content + " [cut]", r.is_error, r.name)

    session.hooks.after += [truncate, mark]
    result = session.run_tool(ToolCall("c4", "read", {}), lambda: text)
    assert result.content == text[:limit] + " [cut]"
    run = session.tool_runs["c4"]
    assert run.result_edited and run.raw_result.content == text


def test_tool_errors_become_results(session: Session) -> None:
    def boom(x: int) -> None:
        raise RuntimeError(f"bad x={x}")

    session.hooks.after.append(
        lambda c, r, s: ToolResult(r.tool_call_id, r.content.upper(), r.is_error, r.name)
    )
    result = session.run_tool(ToolCall("c5", "boom", {"x": 7}), boom)
    assert result.is_error and result.content == "RUNTIMEERROR: BAD X=7"
    # A wrong argument name is the model's mistake, reported to it the same way.
    result = session.run_tool(ToolCall("c6", "boom", {"y": 1}), boom)
    assert result.is_error and "TYPEERROR" in result.content


def test_broken_hooks_raise(session: Session) -> None:
    def bad_before(c, s):
        return ToolCall("other", c.name, c.arguments)

    session.hooks.before.append(bad_before)
    with pytest.raises(TypeError, match="bad_before must return a ToolCall with id 'c7'"):
        session.run_tool(ToolCall("c7", "f", {}), lambda: "x")
    session.hooks.before.clear()
    session.hooks.after.append(lambda c, r, s: r.content)
    with pytest.raises(TypeError, match="must return a ToolResult for call 'c8'"):
        session.run_tool(ToolCall("c8", "f", {}), lambda: "x")


def test_async_tools(session: Session, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    value = rng.randrange(10**6)

    async def fetch(n: int) -> dict:
        await asyncio.sleep(0)
        return {"n": n, "twice": 2 * n}

    session.hooks.after.append(
        lambda c, r, s: ToolResult(r.tool_call_id, r.content + "!", r.is_error, r.name)
    )
    result = asyncio.run(session.arun_tool(ToolCall("c9", "fetch", {"n": value}), fetch))
    assert result.content == f'{{"n": {value}, "twice": {2 * value}}}!'


def test_anchor_for_an_edited_result(session: Session, rng_seed: int) -> None:
    """After a hook truncates a result, the session names the anchor the edit touches: the
    tool_output anchor of the message carrying it, whose text is the edited result."""
    rng = random.Random(rng_seed)
    limit = rng.randint(3, 12)
    session.hooks.after.append(
        lambda c, r, s: ToolResult(r.tool_call_id, r.content[:limit], r.is_error, r.name)
    )
    calls = [ToolCall(f"k{i}", "read", {"i": i}) for i in range(rng.randint(1, 3))]
    history: list = [UserMessage("read them"), AssistantMessage("", None, calls)]
    long_text = {c.id: f"{c.id} " + "x" * rng.randint(limit, 60) for c in calls}
    for call in calls:
        assert session.anchor_for(call.id) is None  # nothing holding it was sent yet
        history.append(session.run_tool(call, lambda i, c=call: long_text[c.id]))
    list(session.send(history))
    prompt = session.last_prompt
    for index, call in enumerate(calls, start=2):
        anchor = session.anchor_for(call.id)
        assert anchor == prompt.find("tool_output", index)
        assert anchor.message_index == index
        assert prompt.text[anchor.char_offset :].startswith(long_text[call.id][:limit] + "\n")
        assert session.tool_runs[call.id].result_edited
    assert session.anchor_for("unknown") is None


def test_plain_lists_become_json(rng_seed: int) -> None:
    """Regression: a tool's plain list result ([2, 3, 5], ["a", "b"]) was passed on as content
    parts and so reported to the model as a failed call; only content-part lists pass as they
    are ("anything else as JSON")."""
    rng = random.Random(rng_seed)
    call = ToolCall("c1", "items", {})
    for _ in range(20):
        value = rng.choice(
            [
                [rng.randint(-99, 99) for _ in range(rng.randint(1, 5))],
                [f"s{rng.randrange(10**6)}" for _ in range(rng.randint(1, 5))],
                [rand_args(rng) for _ in range(rng.randint(1, 3))],  # dicts without "type"
                [{"type": "text", "text": "x"}, rng.randint(0, 9)],  # not all parts
                [],
            ]
        )
        run = run_tool(call, lambda v=value: v, ToolHooks(), None)
        assert not run.result.is_error and run.result.content == json.dumps(value)
    parts = [{"type": "text", "text": f"t{rng.randrange(10**6)}"} for _ in range(rng.randint(1, 3))]
    assert run_tool(call, lambda: parts, ToolHooks(), None).result.content == parts


def test_tool_runs_keep_the_most_recent_calls(session: Session, rng_seed, monkeypatch) -> None:
    """A long-lived Session (the MCP host's, a pooled ChatFreeToken one) keeps the records of
    its last RECORDS_KEPT calls only; a call id run again counts as the newest."""
    rng = random.Random(rng_seed)
    kept = rng.randint(2, 5)
    monkeypatch.setattr(session_module, "RECORDS_KEPT", kept)
    ids = [f"c{i}" for i in range(kept + rng.randint(1, 8))]
    for call_id in ids:
        session.run_tool(ToolCall(call_id, "echo", rand_args(rng)), lambda **kw: kw)
    assert list(session.tool_runs) == ids[-kept:]
    again = ids[-kept]  # the oldest kept, run once more: now the newest
    asyncio.run(session.arun_tool(ToolCall(again, "echo", {}), lambda: "again"))
    assert list(session.tool_runs) == [*ids[-kept + 1 :], again]
    assert session.tool_runs[again].result.content == "again"
