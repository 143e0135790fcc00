"""Tool results in call order, and calls the model wrote but that could not be parsed.

Chat templates (Hermes/Qwen `<tool_response>`) render results by position, without ids: a
history whose results come in another order than the calls must render as if they came in call
order, through every entry point (records, the OpenAI form, ChatFormat/Session rendering).
An assistant message's `invalid_call_ids` may be answered by a result (agents report the
failure); it renders as a tool response, before the parsed calls' results.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    coerce_messages,
    in_call_order,
    messages_from_openai,
    to_openai_messages,
    validate_history,
)

WORDS = ["alpha", "beta", "gamma", "café", "你好", "🙂", "x,", "!?"]


def rand_text(rng: random.Random, n: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def rand_history(rng: random.Random) -> list:
    """A valid history with tool results in call order; parallel calls, some invalid ones
    (their broken text in the content), ids reused across turns once answered."""
    history: list = [SystemMessage(rand_text(rng))] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        history.append(UserMessage(rand_text(rng)))
        for _ in range(rng.randint(1, 3)):
            ids = [f"call_{k}" for k in rng.sample(range(8), 8)]  # reused: numbered per turn
            calls = [
                ToolCall(ids.pop(), rng.choice(["search", "calc"]), {"q": rand_text(rng)})
                for _ in range(rng.randint(1, 4))
            ]
            invalid = [ids.pop() for _ in range(rng.randint(0, 2) if rng.random() < 0.4 else 0)]
            broken = "".join('<tool_call>\n{"name": "calc", "arg\n</tool_call>' for _ in invalid)
            history.append(AssistantMessage(rand_text(rng) + broken, None, calls, invalid))
            answered = [*(i for i in invalid if rng.random() < 0.7), *(c.id for c in calls)]
            history += [ToolResult(cid, f"result {rand_text(rng)} {cid}") for cid in answered]
        history.append(AssistantMessage(rand_text(rng)))
    return history


def shuffle_runs(rng: random.Random, history: list) -> list:
    out, i = list(history), 0
    while i < len(out):
        j = i
        while j < len(out) and isinstance(out[j], ToolResult):
            j += 1
        out[i:j] = rng.sample(out[i:j], j - i)
        i = j + 1
    return out


@pytest.fixture(scope="module")
def fmt(tmp_path_factory: pytest.TempPathFactory) -> ChatFormat:
    return ChatFormat(Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache"))))


def test_shuffled_results_render_like_results_in_call_order(fmt, rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(10):
        ordered = rand_history(rng)
        shuffled = shuffle_runs(rng, ordered)
        validate_history(shuffled)
        assert in_call_order(shuffled) == ordered
        assert coerce_messages(shuffled) == ordered
        wire = json.loads(json.dumps(to_openai_messages(shuffled)))
        assert messages_from_openai(wire) == ordered
        assert coerce_messages(wire) == ordered
        want, got = fmt.render(ordered), fmt.render(shuffled)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.messages == ordered and got.anchors == want.anchors
        # The tool responses follow the calls as rendered: the broken blocks (in the content)
        # first, then the parsed calls.
        expected = [m.content for m in ordered if isinstance(m, ToolResult)]
        rendered = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", got.text, re.S)
        assert rendered == expected


def test_results_answering_calls_of_several_turns_keep_a_fixed_order(rng_seed):
    """Results may answer calls of older turns and ids may be reused: the order is that of the
    calls each result pairs with (the latest pending call of its id)."""
    rng = random.Random(rng_seed)
    a, b = (f"call_{k}" for k in rng.sample(range(100), 2))
    first = AssistantMessage("", None, [ToolCall(a, "search"), ToolCall(b, "calc")])
    again = AssistantMessage("", None, [ToolCall(b, "calc"), ToolCall(a, "search")])
    r = {(cid, turn): ToolResult(cid, f"{cid}@{turn}") for cid in (a, b) for turn in (1, 2)}
    history = [UserMessage("q"), first, r[b, 1], r[a, 1], UserMessage("more"), again]
    history += [r[a, 2], r[b, 2]]
    assert in_call_order(history) == [*history[:2], r[a, 1], r[b, 1], *history[4:6]] + [
        r[b, 2],
        r[a, 2],
    ]
    # A call left pending from an earlier turn is answered in the run after a later one.
    late = [UserMessage("q"), AssistantMessage("", None, [ToolCall(a, "search")]), UserMessage("?")]
    late += [AssistantMessage("", None, [ToolCall(b, "calc")]), r[b, 2], r[a, 1]]
    assert in_call_order(late) == [*late[:4], r[a, 1], r[b, 2]]
    # A user message ends a run: nothing moves across it.
    split = [UserMessage("q"), first, r[b, 1], UserMessage("wait"), r[a, 1]]
    assert in_call_order(split) == split


def test_invalid_call_ids_are_checked_and_answerable(rng_seed):
    rng = random.Random(rng_seed)
    bad, good = (f"call_{k}" for k in rng.sample(range(10**6), 2))
    broken = '<tool_call>\n{"name": "calc", "arguments": {\n</tool_call>'
    ask = AssistantMessage(broken, None, [ToolCall(good, "calc")], [bad])
    error = ToolResult(bad, "Tool call calc could not be executed: malformed", True, "calc")
    result = ToolResult(good, rand_text(rng), name="calc")
    assert in_call_order([UserMessage("q"), ask, result, error]) == [
        UserMessage("q"),
        ask,
        error,
        result,
    ]
    validate_history([UserMessage("q"), ask, result])  # an invalid call needs no answer
    with pytest.raises(InvalidRequestError, match=f"message 4 \\(tool\\): .*'{bad}' was already"):
        validate_history([UserMessage("q"), ask, error, result, error])
    # An unanswered invalid call does not hold its id; a parsed call waiting for a result does.
    reuse = AssistantMessage("", None, [ToolCall(bad, "search")])
    validate_history([UserMessage("q"), ask, result, reuse, ToolResult(bad, "x")])
    with pytest.raises(InvalidRequestError, match=f"message 2 .*'{good}' is still waiting"):
        validate_history([UserMessage("q"), ask, AssistantMessage("", None, [], [good])])
    with pytest.raises(InvalidRequestError, match=f"tool call id '{good}' appears twice"):
        AssistantMessage("", None, [ToolCall(good, "calc")], [good])
    with pytest.raises(InvalidRequestError, match="invalid call id 1 must be a non-empty"):
        AssistantMessage("", None, [], [bad, ""])
    with pytest.raises(InvalidRequestError, match="message 1 \\(assistant\\): invalid_call_ids"):
        messages_from_openai(
            [{"role": "user", "content": "q"}, {"role": "assistant", "invalid_call_ids": bad}]
        )
    assert AssistantMessage("", None, (), (bad,)).invalid_call_ids == [bad]
    # The wire form keeps them (no OpenAI field), so it reads back as the same history.
    # (is_error has no OpenAI field either, and is left out.)
    history = [UserMessage("q"), ask, ToolResult(bad, error.content, name="calc"), result]
    assert messages_from_openai(json.loads(json.dumps(to_openai_messages(history)))) == history
    assert "invalid_call_ids" not in to_openai_messages([AssistantMessage("a")])[0]
