"""Agent histories that hold more than neat call/result pairs, through ChatFreeToken.

- A malformed tool call comes back as an `invalid_tool_call` (with an id). langchain's
  create_agent answers each one with an error ToolMessage on every model call
  (`_patch_invalid_tool_calls`); that history must render (the broken block in the assistant's
  text, as written, then the error as its tool response), not be refused, whether the turn also
  had good calls (which run first) or not (the next user turn of the thread).
- Tool results may arrive in any order (HumanInTheLoopMiddleware puts a rejected call's message
  before the results of the calls that ran). Templates render `<tool_response>`s by position,
  without ids, so they must render in the order of the calls.

The model's texts are scripted (`ScriptedEngine`): the demo model never writes a broken call.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langchain_core.tools import tool
from langgraph.checkpoint.memory import MemorySaver
from langgraph.types import Command
from scripted_engine import ScriptedEngine

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.integrations.langchain_messages import to_history
from freetoken_agent.integrations.langchain_runtime import service_for
from freetoken_agent.messages import AssistantMessage, ToolResult

WORDS = ["alpha", "beta", "café", "你好", "🙂", "x,", "!?"]


def text(rng: random.Random, n: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def block(name: str, args: dict) -> str:
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>\n"


def broken_block(rng: random.Random) -> str:
    """A call block whose JSON is cut: the parser reports it as an invalid call."""
    cut = rng.choice(['{"a": ', '{"a": 1, "b": [', '{"a": "x'])
    return f'<tool_call>\n{{"name": "add", "arguments": {cut}\n</tool_call>'


def responses(prompt: str) -> list[str]:
    return [r.strip() for r in re.findall(r"<tool_response>(.*?)</tool_response>", prompt, re.S)]


@tool
def add(a: int, b: int) -> int:
    """Add two ints."""
    return a + b


@tool
def rm(path: str) -> str:
    """Delete a file."""
    return "deleted " + path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    engine = Engine.load(path, device="cpu", progress=False, kv_tokens=8192, max_model_len=2048)
    yield engine
    service_for(engine).close()


def last_prompt(fake: ScriptedEngine) -> str:
    return fake.tokenizer.decode(fake.prompts[-1], False)


def test_agent_runs_good_calls_beside_a_broken_one(scripted, rng_seed):
    """Case A: one turn with good calls and a broken one. The tools run, then the agent calls
    the model again with the error ToolMessage create_agent added for the broken call."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    pairs = [(rng.randint(-99, 99), rng.randint(-99, 99)) for _ in range(rng.randint(1, 3))]
    broken, answer = broken_block(rng), text(rng)
    reply = "".join(block("add", {"a": a, "b": b}) for a, b in pairs) + broken
    fake.replies = [(reply, "stop"), (answer, "stop")]
    agent = create_agent(ChatFreeToken(engine=service, max_tokens=256), [add])

    out = agent.invoke({"messages": [HumanMessage(text(rng))]})

    assert out["messages"][-1].content == answer
    ai = out["messages"][1]
    assert len(ai.tool_calls) == len(pairs) and len(ai.invalid_tool_calls) == 1
    prompt = last_prompt(fake)
    assert broken in prompt  # the call as the model wrote it, in its turn
    # The broken block is in the content, which the template renders before the parsed calls:
    # its error answer comes first, then the results in call order.
    got = responses(prompt)
    assert got[0].startswith(f"Tool call add with id {ai.invalid_tool_calls[0]['id']}")
    assert "malformed" in got[0]
    assert got[1:] == [str(a + b) for a, b in pairs]


def test_a_broken_call_does_not_poison_the_thread(scripted, rng_seed):
    """Case B: a turn with only a broken call ends the agent run; every later model call of the
    thread gets the error ToolMessage for it, and must still render, the same way each time."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    broken = broken_block(rng)
    turns = [text(rng) for _ in range(rng.randint(2, 3))]
    answers = [text(rng) for _ in turns]
    fake.replies = [(text(rng) + "\n" + broken, "stop")] + [(a, "stop") for a in answers]
    agent = create_agent(
        ChatFreeToken(engine=service, max_tokens=256), [add], checkpointer=MemorySaver()
    )
    cfg = {"configurable": {"thread_id": f"t{rng.randrange(10**6)}"}}

    first = agent.invoke({"messages": [HumanMessage(text(rng))]}, cfg)
    ai = first["messages"][-1]
    assert not ai.tool_calls and len(ai.invalid_tool_calls) == 1
    prompts = []
    for question, answer in zip(turns, answers, strict=True):
        out = agent.invoke({"messages": [HumanMessage(question)]}, cfg)
        assert out["messages"][-1].content == answer
        prompts.append(last_prompt(fake))
        head, _, tail = prompts[-1].partition(broken)
        assert tail, "the broken call is rendered as the model wrote it"
        assert responses(tail)[0].startswith(
            f"Tool call add with id {ai.invalid_tool_calls[0]['id']}"
        )
    # Each later prompt extends the one before (with the reply in between): prefix reuse holds.
    for before, after, answer in zip(prompts, prompts[1:], answers, strict=False):
        assert after.startswith(before + answer)


def test_invalid_calls_convert_with_their_ids(rng_seed):
    """to_history keeps the ids of invalid calls, so that results answering them validate;
    results come out in the order the template renders the calls: invalid ones (their text
    is in the content) first, then the parsed calls."""
    rng = random.Random(rng_seed)
    for _ in range(20):
        ids = rng.sample(range(10**6), 8)
        good = [
            tool_call(name="add", args={"a": rng.randint(0, 9), "b": 1}, id=f"g{ids.pop()}")
            for _ in range(rng.randint(0, 3))
        ]
        bad = [
            invalid_tool_call(name="add", args=broken_block(rng), id=f"b{ids.pop()}", error="x")
            for _ in range(rng.randint(1, 3))
        ]
        nameless = invalid_tool_call(name=None, args="{", id=None, error="no id")
        ai = AIMessage(
            content=text(rng) + "".join(c["args"] for c in bad),
            tool_calls=good,
            invalid_tool_calls=rng.sample([*bad, nameless], len(bad) + 1),
        )
        answered = [*good, *(c for c in bad if rng.random() < 0.7)]  # an answer is optional
        results = [
            ToolMessage(text(rng), tool_call_id=c["id"], status=rng.choice(["success", "error"]))
            for c in answered
        ]
        shuffled = rng.sample(results, len(results))
        history = to_history([HumanMessage(text(rng)), ai, *shuffled])
        assistant = history[1]
        assert isinstance(assistant, AssistantMessage)
        assert assistant.content == ai.content
        assert assistant.invalid_call_ids == [
            c["id"] for c in ai.invalid_tool_calls if c["id"] is not None
        ]
        place = {cid: k for k, cid in enumerate(assistant.invalid_call_ids)}
        place |= {c["id"]: len(place) + k for k, c in enumerate(good)}
        got = history[2:]
        assert all(isinstance(r, ToolResult) for r in got)
        assert [r.tool_call_id for r in got] == sorted(
            (m.tool_call_id for m in results), key=place.__getitem__
        )
        by_id = {m.tool_call_id: m for m in results}
        for r in got:
            assert r.content == by_id[r.tool_call_id].content
            assert r.is_error == (by_id[r.tool_call_id].status == "error")


def test_rejected_calls_render_in_call_order(scripted, rng_seed):
    """HumanInTheLoopMiddleware: the rejected calls' ToolMessages come first in the state, the
    results of the calls that ran after; the model must read them against the right calls."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    while True:
        kinds = [rng.choice(["add", "rm"]) for _ in range(rng.randint(2, 5))]
        if "rm" in kinds and kinds[0] == "add":  # a rejection lands before a result
            break
    calls = [
        ("add", {"a": rng.randint(0, 99), "b": rng.randint(0, 99)})
        if kind == "add"
        else ("rm", {"path": f"/tmp/{rng.randrange(10**6)}"})
        for kind in kinds
    ]
    fake.replies = [("".join(block(n, a) for n, a in calls), "stop"), (text(rng), "stop")]
    agent = create_agent(
        ChatFreeToken(engine=service, max_tokens=512),
        [add, rm],
        checkpointer=MemorySaver(),
        middleware=[HumanInTheLoopMiddleware(interrupt_on={"rm": True})],
    )
    cfg = {"configurable": {"thread_id": f"t{rng.randrange(10**6)}"}}
    agent.invoke({"messages": [HumanMessage(text(rng))]}, cfg)
    reasons = [f"no {rng.randrange(10**6)}" for n, _ in calls if n == "rm"]
    decisions = [{"type": "reject", "message": r} for r in reasons]
    out = agent.invoke(Command(resume={"decisions": decisions}), cfg)

    ai = out["messages"][1]
    assert [c["name"] for c in ai.tool_calls] == kinds
    order = [m.tool_call_id for m in out["messages"] if isinstance(m, ToolMessage)]
    assert order != [c["id"] for c in ai.tool_calls]  # the state holds them out of order
    got, rejections = responses(last_prompt(fake)), iter(reasons)
    assert len(got) == len(calls)
    for response, (name, args) in zip(got, calls, strict=True):
        if name == "add":
            assert response == str(args["a"] + args["b"])
        else:  # "User rejected the tool call for `rm` with reason: ..."
            assert response.startswith("User rejected") and response.endswith(next(rejections))


def test_shuffled_results_render_as_in_call_order(scripted, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted
    llm = ChatFreeToken(engine=service, max_tokens=16).bind_tools([add, rm])
    for _ in range(5):
        history: list = [HumanMessage(text(rng))]
        for _ in range(rng.randint(1, 3)):
            ids = rng.sample(range(10**6), 5)
            calls = [
                tool_call(name="add", args={"a": rng.randint(0, 9), "b": 2}, id=f"c{ids.pop()}")
                for _ in range(rng.randint(1, 5))
            ]
            history.append(AIMessage(content=text(rng), tool_calls=calls))
            history += [ToolMessage(text(rng), tool_call_id=c["id"]) for c in calls]
        shuffled, i = list(history), 0
        while i < len(shuffled):  # shuffle each run of ToolMessages
            j = i
            while j < len(shuffled) and isinstance(shuffled[j], ToolMessage):
                j += 1
            shuffled[i:j] = rng.sample(shuffled[i:j], j - i)
            i = j + 1
        fake.replies = [("ok", "stop"), ("ok", "stop")]
        llm.invoke(history)
        llm.invoke(shuffled)
        assert fake.prompts[-1] == fake.prompts[-2]
        prompt = fake.tokenizer.decode(fake.prompts[-1], False)
        assert responses(prompt) == [m.content for m in history if isinstance(m, ToolMessage)]
