"""Message records: validation names the problem; OpenAI and template conversions round-trip."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    coerce_messages,
    content_text,
    messages_from_openai,
    to_openai_messages,
    to_template_messages,
    validate_history,
)

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "café",
    "naïve",
    "你好",
    "🙂",
    "{json}",
    '"quoted"',
    "a\\b",
    "t\tx",
]


def rand_text(rng: random.Random, max_words: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


def rand_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 2 else 4)
    if kind == 0:
        return rand_text(rng, 3)
    if kind == 1:
        return rng.randint(-(10**6), 10**6)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.random() * 100
    if kind == 4:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": rand_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def rand_history(rng: random.Random) -> list:
    """A valid history: optional system, turns with optional reasoning and tool rounds."""
    history: list = [SystemMessage(rand_text(rng))] if rng.random() < 0.5 else []
    n_call = 0
    for _ in range(rng.randint(1, 4)):
        history.append(UserMessage(rand_text(rng)))
        for _ in range(rng.randint(0, 2)):
            calls = []
            for _ in range(rng.randint(1, 3)):
                args = {f"arg{i}": rand_value(rng) for i in range(rng.randint(0, 3))}
                calls.append(ToolCall(f"call_{n_call}", rng.choice(["search", "calc"]), args))
                n_call += 1
            reasoning = rand_text(rng) if rng.random() < 0.5 else None
            history.append(AssistantMessage(rand_text(rng), reasoning, calls))
            for call in rng.sample(calls, len(calls)):  # results in any order
                history.append(ToolResult(call.id, rand_text(rng), rng.random() < 0.2, call.name))
        history.append(
            AssistantMessage(rand_text(rng), rand_text(rng) if rng.random() < 0.5 else None)
        )
    return history


def test_openai_round_trip(rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(20):
        history = rand_history(rng)
        validate_history(history)
        wire = to_openai_messages(history)
        # The wire form is JSON: arguments travel as strings.
        wire = json.loads(json.dumps(wire))
        for m in wire:
            for call in m.get("tool_calls", []):
                assert isinstance(call["function"]["arguments"], str)
        # is_error has no OpenAI field: it does not survive the wire form. Results come back in
        # the order of their calls (templates render them by position).
        expected = [
            ToolResult(m.tool_call_id, m.content, False, m.name) if isinstance(m, ToolResult) else m
            for m in history
        ]
        place = {
            c.id: k
            for m in history
            if isinstance(m, AssistantMessage)
            for k, c in enumerate(m.tool_calls)
        }
        i = 0
        while i < len(expected):
            j = i
            while j < len(expected) and isinstance(expected[j], ToolResult):
                j += 1
            expected[i:j] = sorted(expected[i:j], key=lambda r: place[r.tool_call_id])
            i = j + 1
        assert messages_from_openai(wire) == expected
        assert coerce_messages(wire) == expected


def test_template_dicts(rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    history = rand_history(rng)
    dicts = to_template_messages(history)
    assert len(dicts) == len(history)
    for msg, d in zip(history, dicts, strict=True):
        assert d["role"] == msg.role and d["content"] == msg.content
        if isinstance(msg, AssistantMessage):
            assert ("reasoning_content" in d) == (msg.reasoning is not None)
            assert d.get("reasoning_content") == msg.reasoning
            calls = d.get("tool_calls", [])
            assert [c["function"]["arguments"] for c in calls] == [
                c.arguments for c in msg.tool_calls
            ]
            assert [c["id"] for c in calls] == [c.id for c in msg.tool_calls]
        if isinstance(msg, ToolResult):
            assert d["tool_call_id"] == msg.tool_call_id


def test_text_parts_are_joined_for_templates() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert to_template_messages([UserMessage(parts)])[0]["content"] == "one\ntwo"
    assert to_openai_messages([UserMessage(parts)])[0]["content"] == parts
    with pytest.raises(InvalidRequestError, match="part 1 has type 'image_url'.*text only"):
        content_text([parts[0], {"type": "image_url", "image_url": {"url": "x"}}])
    # Assistant parts too: kept by messages_from_openai, joined with "\n" for templates.
    assistant = messages_from_openai(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": parts}]
    )[1]
    assert assistant.content == parts
    assert to_template_messages([assistant])[0]["content"] == "one\ntwo"


@pytest.mark.parametrize(
    ("items", "pattern"),
    [
        ([{"role": "bot", "content": "x"}], r"message 0: unknown role 'bot'"),
        ([{"content": "x"}], r"message 0: unknown role None"),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "tool", "tool_call_id": "c9", "content": "r"},
            ],
            r"message 1 \(tool\): tool result for id 'c9' matches no earlier call",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "[1, 2]"}}],
                },
            ],
            r"message 1 \(assistant\): tool call 0 'c1' \(f\): arguments must be a dict, got list",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{bad"}}],
                },
            ],
            r"message 1 \(assistant\): tool call 0 \(f\): arguments are not JSON",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
            ],
            r"message 1 \(assistant\): tool call 0: id must be a non-empty string",
        ),
        (
            [{"role": "user", "content": 5}],
            r"message 0 \(user\): content must be a string or a list",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            r"message 0 \(user\): text content part 0 has no string",
        ),
        ([{"role": "user"}], r"message 0 \(user\): a user message needs content"),
    ],
)
def test_openai_errors_name_the_problem(items, pattern) -> None:
    with pytest.raises(InvalidRequestError, match=pattern):
        messages_from_openai(items)


def test_history_errors_name_the_problem(rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    cid = f"call_{rng.randrange(10**6)}"
    call = ToolCall(cid, "search", {"q": rand_text(rng)})
    ask = AssistantMessage("", None, [call])
    answer = ToolResult(cid, rand_text(rng))
    validate_history([UserMessage("q"), ask, answer])
    with pytest.raises(InvalidRequestError, match=f"message 3 \\(tool\\): .*'{cid}' was already"):
        validate_history([UserMessage("q"), ask, answer, answer])
    with pytest.raises(InvalidRequestError, match=f"message 2 .*'{cid}' is still waiting"):
        validate_history([UserMessage("q"), ask, ask])
    # A reused id is fine once answered: the result pairs with the latest call.
    validate_history([UserMessage("q"), ask, answer, ask, answer])
    with pytest.raises(InvalidRequestError, match="message 1: unknown message type dict .*role"):
        validate_history([UserMessage("q"), {"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="list of message records"):
        validate_history("hello")
    # Records check fields when built and again when validated (they are mutable).
    with pytest.raises(InvalidRequestError, match="arguments must be a dict, got str"):
        ToolCall(cid, "search", '{"q": 1}')
    with pytest.raises(InvalidRequestError, match="tool call id .* appears twice"):
        AssistantMessage("", None, [call, call])
    with pytest.raises(InvalidRequestError, match="name must be a non-empty string"):
        ToolCall(cid, "", {})
    broken = UserMessage("fine")
    broken.content = 42
    with pytest.raises(InvalidRequestError, match="message 0 \\(user\\): content must be"):
        validate_history([broken])
    assert issubclass(InvalidRequestError, ValueError)


def test_assistant_defaults() -> None:
    msg = AssistantMessage(None, None, ())  # APIs send content None beside tool calls
    assert msg.content == "" and msg.tool_calls == [] and msg.reasoning is None
    reasoning = messages_from_openai(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "t"}]
    )[1].reasoning
    assert reasoning == "t"
    assert messages_from_openai([{"role": "developer", "content": "d"}]) == [SystemMessage("d")]


@pytest.mark.parametrize(
    "content", [[3], ["text"], [{"type": "text"}], [{"type": "text", "text": 5}], 7]
)
def test_malformed_content_parts_are_clear_errors(content):
    from freetoken_agent.messages import content_text

    with pytest.raises(InvalidRequestError, match="content"):
        content_text(content, "messages[0]")


def test_text_parts_render_the_same_after_an_openai_round_trip(rng_seed: int) -> None:
    """Regression: assistant text parts were joined with "\\n" for templates as records but with
    "" by messages_from_openai, so a history and its OpenAI form rendered different prompts."""
    rng = random.Random(rng_seed)
    history = rand_history(rng)
    for i, msg in enumerate(history):
        if isinstance(msg, AssistantMessage) or rng.random() < 0.5:
            parts = [{"type": "text", "text": rand_text(rng)} for _ in range(rng.randint(2, 4))]
            history[i] = dataclasses.replace(msg, content=parts)
    back = messages_from_openai(json.loads(json.dumps(to_openai_messages(history))))
    # (back has the tool results in call order, as coerce_messages gives them to templates)
    assert to_template_messages(back) == to_template_messages(coerce_messages(history))


def test_an_assistant_refusal_part_is_its_text(rng_seed: int) -> None:
    """OpenAI's assistant `refusal` part (a history an OpenAI client replays) renders as the
    text part with its words would; a user's refusal part is no part a user writes."""
    rng = random.Random(rng_seed)
    words = [rand_text(rng) for _ in range(rng.randint(1, 3))]
    kinds = [rng.choice(["text", "refusal"]) for _ in words]
    kinds[rng.randrange(len(kinds))] = "refusal"  # one at least
    parts = [{"type": k, k: w} if k == "refusal" else {"type": k, "text": w}
             for k, w in zip(kinds, words, strict=True)]  # fmt: skip
    user = {"role": "user", "content": rand_text(rng)}
    got = messages_from_openai([user, {"role": "assistant", "content": parts}])
    texts = [{"type": "text", "text": w} for w in words]
    plain = messages_from_openai([user, {"role": "assistant", "content": texts}])
    assert to_template_messages(got) == to_template_messages(plain)
    refusing = {"role": "user", "content": [{"type": "refusal", "refusal": rand_text(rng)}]}
    with pytest.raises(InvalidRequestError, match="type 'refusal'"):
        to_template_messages(messages_from_openai([refusing]))


def _rand_lone_surrogate(rng: random.Random) -> str:
    text = rand_text(rng)
    cut = rng.randint(0, len(text))
    return text[:cut] + chr(rng.randint(0xD800, 0xDFFF)) + text[cut:]


def test_lone_surrogates_are_refused_naming_the_message(rng_seed: int) -> None:
    """Regression: a lone UTF-16 surrogate (JSON's "\\ud83d" decodes to one) passed the checks,
    then rendering failed inside the tokenizer with an unrelated TypeError."""
    rng = random.Random(rng_seed)
    for _ in range(10):
        history = rand_history(rng)
        wire = json.loads(json.dumps(to_openai_messages(history)))
        i = rng.randrange(len(wire))
        msg, bad = wire[i], _rand_lone_surrogate(rng)
        places = ["content"]
        if msg["role"] != "tool":
            msg["content"] = [{"type": "text", "text": msg["content"]}]
            places.append("part")
        if msg.get("reasoning_content"):
            places.append("reasoning")
        if msg.get("tool_calls"):
            places += ["arguments", "argument name"]
        place = rng.choice(places)
        if place == "content":
            msg["content"] = bad
        elif place == "part":
            msg["content"].insert(rng.randint(0, 1), {"type": "text", "text": bad})
        elif place == "reasoning":
            msg["reasoning_content"] = bad
        else:
            fn = rng.choice(msg["tool_calls"])["function"]
            args = {"k": {bad: 1}} if place == "argument name" else {"k": [bad]}
            # As a JSON string (the wire form: its escape decodes to the surrogate) or a dict.
            fn["arguments"] = json.dumps(args) if rng.random() < 0.5 else args
        with pytest.raises(InvalidRequestError, match=rf"^message {i} \({msg['role']}\): "):
            messages_from_openai(wire)
    with pytest.raises(InvalidRequestError, match="user message: content holds a lone UTF-16"):
        UserMessage(_rand_lone_surrogate(rng))
    # A surrogate pair written as two escapes is one character: fine.
    assert messages_from_openai([{"role": "user", "content": json.loads('"\\ud83d\\ude00"')}])


def test_deep_or_non_json_arguments_are_invalid_requests(rng_seed: int) -> None:
    """Regression: deeply nested arguments escaped as RecursionError (json.loads); NaN passed."""
    rng = random.Random(rng_seed)
    depth = rng.choice([rng.randint(101, 1000), 100_000])  # past the parsers' cap (100)
    for args in ["[" * depth + "]" * depth, "NaN", "-Infinity"]:
        wire = [
            {"role": "user", "content": rand_text(rng)},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "function": {"name": "f", "arguments": f'{{"a": {args}}}'}}
                ],
            },
        ]
        with pytest.raises(
            InvalidRequestError, match=r"message 1 \(assistant\): tool call 0 \(f\): arguments"
        ):
            messages_from_openai(wire)


@pytest.mark.parametrize("value", ["false", "true", "", 0, 1, [], "False"])
def test_is_error_must_be_a_bool(value) -> None:
    """Regression: bool(item["is_error"]) turned the string "false" into True."""
    wire = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x", "is_error": value},
    ]
    with pytest.raises(InvalidRequestError, match=r"message 2 \(tool\): is_error must be a bool"):
        messages_from_openai(wire)
    for ok, expected in [(True, True), (False, False), (None, False)]:
        wire[2]["is_error"] = ok
        assert messages_from_openai(wire)[2].is_error is expected
