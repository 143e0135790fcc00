"""ChatFormat: token ids equal the template's text tokenized, and every anchor sits exactly on
the boundary it names, checked against oracles that parse the ChatML text independently."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from chat_histories import QWEN3_THINKING, TOOLS, check_token_prefix, rand_history, rand_text

from freetoken_agent.chat_format import ChatFormat, normalize_tools
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.text.chat_template import ChatTemplate, ChatTemplateError
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    to_template_messages,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


@pytest.fixture(params=["demo", "qwen3"])
def fmt(request, tok: Tokenizer) -> ChatFormat:
    if request.param == "demo":
        return ChatFormat(tok)
    return ChatFormat(tok, chat_template=QWEN3_THINKING)


def template_of(fmt: ChatFormat) -> ChatTemplate:
    return fmt.template(None)


def message_starts(text: str, tools_turn: bool) -> list[int]:
    """Oracle for both ChatML templates: each message starts at `<|im_start|>`, except tool
    results after the first of a group, which start at their `\n<tool_response>`. With tools
    and no system message the templates open a system turn of their own (`tools_turn`), which
    belongs to the first message."""
    starts = []
    for m in re.finditer(r"<\|im_start\|>|\n<tool_response>", text):
        if m.group() == "\n<tool_response>" and text[: m.start()].endswith("<|im_start|>user"):
            continue  # the first result of a group starts at its <|im_start|>user
        starts.append(m.start())
    if tools_turn:
        del starts[1]  # the first message's own <|im_start|> follows the tools turn
    return starts


def test_ids_and_text_match_the_template(fmt: ChatFormat, tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(5):
        history = rand_history(rng)
        tools = TOOLS if rng.random() < 0.5 else None
        prompt = fmt.render(history, tools=tools)
        wrapped = [t if "type" in t else {"type": "function", "function": t} for t in tools or []]
        text = template_of(fmt).render(to_template_messages(history), tools=wrapped or None)
        assert prompt.text == text
        assert prompt.token_ids == tok.encode(text)
        assert prompt.messages == history
        offsets = [(a.offset, a.char_offset) for a in prompt.anchors]
        assert offsets == sorted(offsets)
        assert all(0 <= a.offset <= len(prompt) for a in prompt.anchors)
        check_token_prefix(tok, prompt)


def test_turn_starts_are_message_boundaries(fmt: ChatFormat, tok: Tokenizer, rng_seed: int) -> None:
    """Histories with and without reasoning (so with and without the template stripping it):
    every message's turn_start is where the oracle says it begins."""
    rng = random.Random(rng_seed)
    template = template_of(fmt)
    compared = 0
    for trial in range(6):
        history = rand_history(rng, reasoning=trial % 2 == 1)
        tools = TOOLS if trial % 3 == 0 else None
        prompt = fmt.render(history, tools=tools)
        tools_turn = tools is not None and not isinstance(history[0], SystemMessage)
        expected = message_starts(prompt.text, tools_turn)
        assert expected[0] == 0
        assert len(expected) == len(history) + 1  # + the generation prompt
        dicts = to_template_messages(history)
        for i in range(len(history)):
            anchor = prompt.find("turn_start", i)
            # Also where the template refuses the truncated history ([system] alone has no user
            # query for the Qwen3 template): every session shares that prefix.
            assert anchor is not None, i
            assert anchor.char_offset == expected[i], (i, prompt.text[expected[i] - 20 :][:60])
            assert anchor.exact  # ChatML boundaries sit next to special tokens
        # Where the truncated history renders as a prefix of the whole (the template did not
        # look ahead), the token prefix decodes to exactly that rendering.
        for i in range(1, len(history)):
            anchor = prompt.find("turn_start", i)
            head = _try_render(template, dicts[:i], normalize_tools(tools))
            if anchor is not None and head is not None and prompt.text.startswith(head):
                assert anchor.char_offset == len(head)
                assert tok.decode(prompt.token_ids[: anchor.offset], False) == head
                compared += 1
    assert compared > 0


def _try_render(template: ChatTemplate, dicts: list, tools) -> str | None:
    try:
        return template.render(dicts, tools=tools, add_generation_prompt=False)
    except ChatTemplateError:
        return None


def test_reasoning_anchors_and_stripping(fmt: ChatFormat, rng_seed: int) -> None:
    """Reasoning after the last user query is kept and spanned exactly; earlier reasoning is
    dropped by the template and has no anchors."""
    rng = random.Random(rng_seed)
    for _ in range(6):
        history = rand_history(rng, end_with_user=rng.random() < 0.5)
        if rng.random() < 0.5:  # a tool round after the last query keeps its reasoning
            call = ToolCall("late", "search", {"q": rand_text(rng, 2)})
            history += [AssistantMessage("", rand_text(rng), [call]), ToolResult("late", "r end")]
        prompt = fmt.render(history)
        last_query = max(i for i, m in enumerate(history) if isinstance(m, UserMessage))
        for i, msg in enumerate(history):
            if not isinstance(msg, AssistantMessage) or not msg.reasoning:
                assert prompt.find("reasoning_start", i) is None
                continue
            start, end = prompt.find("reasoning_start", i), prompt.find("reasoning_end", i)
            if i > last_query:
                assert start is not None and end is not None
                assert prompt.text[start.char_offset : end.char_offset] == msg.reasoning
                assert prompt.text[: start.char_offset].endswith("<think>\n")
                assert prompt.text[end.char_offset :].startswith("\n</think>")
                assert start.offset <= end.offset
            else:
                assert start is None and end is None
                assert msg.reasoning not in prompt.text


def test_tool_call_and_output_anchors(fmt: ChatFormat, tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(6):
        history = rand_history(rng)
        prompt = fmt.render(history, tools=TOOLS)
        for i, msg in enumerate(history):
            calls = [a for a in prompt.anchors_of(i) if a.kind == "tool_call"]
            if isinstance(msg, AssistantMessage):
                assert len(calls) == len(msg.tool_calls)
                turn = prompt.find("turn_start", i)
                for j, (anchor, call) in enumerate(zip(calls, msg.tool_calls, strict=True)):
                    rest = prompt.text[anchor.char_offset :]
                    # The call's block, its separator included, starts here and names the call.
                    assert rest.lstrip("\n").startswith("<tool_call>\n")
                    assert re.match(
                        rf"\n*<tool_call>\n(<function=|{{\"name\": \"){call.name}", rest
                    )
                    # Exactly j calls of this message lie before it.
                    before = prompt.text[turn.char_offset : anchor.char_offset]
                    assert before.count("<tool_call>") == j
                    if msg.content:
                        assert msg.content in before
            else:
                assert calls == []
            out = prompt.find("tool_output", i)
            if isinstance(msg, ToolResult):
                assert out is not None
                assert prompt.text[out.char_offset :].startswith(msg.content + "\n</tool_response>")
                assert prompt.text[: out.char_offset].endswith("<tool_response>\n")
                assert prompt.find("turn_start", i).offset <= out.offset
            else:
                assert out is None
        check_token_prefix(tok, prompt)


@pytest.mark.parametrize("thinking", [None, False])
def test_generation_prefix(fmt: ChatFormat, rng_seed: int, thinking: bool | None) -> None:
    rng = random.Random(rng_seed)
    history = rand_history(rng)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    prompt = fmt.render(history, **kwargs)
    bare = fmt.render(history, add_generation_prompt=False, **kwargs)
    anchor = prompt.find("generation_prefix", len(history))
    assert anchor is not None and anchor.exact
    assert anchor.char_offset == len(bare.text)
    assert prompt.text[: anchor.char_offset] == bare.text
    assert bare.token_ids == prompt.token_ids[: anchor.offset]
    assert prompt.generation_prefix == prompt.text[anchor.char_offset :]
    qwen = fmt.template(None).source == QWEN3_THINKING
    head = "<|im_start|>assistant\n"
    if thinking is False:
        assert prompt.generation_prefix == head + "<think>\n\n</think>\n\n"
    else:
        assert prompt.generation_prefix == head + ("<think>\n" if qwen else "")
    assert bare.generation_prefix == "" and bare.find("generation_prefix", len(history)) is None
    # The generation prefix is the deepest anchor of the prompt.
    assert prompt.deepest_anchor(len(prompt)) == anchor


def test_boundary_inside_a_token_moves_back(tok: Tokenizer) -> None:
    """A tool call right after content ending in punctuation: the demo tokenizer merges ".\n"
    into one token, so the boundary before "\n<tool_call>" falls inside it."""
    history = [UserMessage("q"), AssistantMessage("Let me check.", None, [ToolCall("c", "f", {})])]
    prompt = ChatFormat(tok).render(history)
    anchor = prompt.find("tool_call", 1)
    assert prompt.text[anchor.char_offset :].startswith("\n<tool_call>")
    assert not anchor.exact
    assert tok.decode(prompt.token_ids[: anchor.offset], skip_special_tokens=False).endswith(
        "Let me check"
    )
    assert prompt.deepest_anchor(anchor.offset - 1).kind == "turn_start"


def test_render_errors(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="empty history"):
        ChatFormat(tok).render([])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        ChatFormat(None)
    qwen = ChatFormat(tok, chat_template=QWEN3_THINKING)
    with pytest.raises(InvalidRequestError, match="rejected this history.*No user query"):
        qwen.render([SystemMessage("s")])
    with pytest.raises(InvalidRequestError, match="matches no earlier call"):
        qwen.render([UserMessage("q"), ToolResult("nope", "r")])
    with pytest.raises(InvalidRequestError, match="tool 0 must be a dict"):
        qwen.render([UserMessage("q")], tools=["search"])


def test_dict_messages_are_accepted(tok: Tokenizer, tmp_path: Path) -> None:
    fmt = ChatFormat(tok)
    records = [UserMessage("hi"), AssistantMessage("yo", "hmm")]
    dicts = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning_content": "hmm"},
    ]
    assert fmt.render(dicts).token_ids == fmt.render(records).token_ids


def test_cache_gives_the_same_anchors_as_a_cold_render(tok: Tokenizer, rng_seed: int) -> None:
    """A ChatFormat caches what it found per message prefix: a growing history (a Session's
    turns, with earlier reasoning stripped once a new user message arrives) must get exactly
    the anchors a fresh ChatFormat finds."""
    rng = random.Random(rng_seed)
    for source in (None, QWEN3_THINKING):
        warm = ChatFormat(tok, chat_template=source)
        history = rand_history(rng, end_with_user=True)
        for _ in range(3):
            tools = TOOLS if rng.random() < 0.5 else None
            got = warm.render(history, tools=tools)
            cold = ChatFormat(tok, chat_template=source).render(history, tools=tools)
            assert got.anchors == cold.anchors and got.token_ids == cold.token_ids
            more = [m for m in rand_history(rng) if not isinstance(m, SystemMessage)]
            # Fresh call ids: the new turns' ids must not repeat the pending ones.
            history = history + more


def rand_mixed_keys(rng: random.Random, depth: int = 0) -> dict:
    """A nested dict whose keys mix ints and strings (json.dumps cannot sort them)."""
    out: dict = {}
    for _ in range(rng.randint(2, 4)):
        key = rng.choice([rng.randint(-99, 99), f"k{rng.randrange(100)}"])
        out[key] = rand_mixed_keys(rng, depth + 1) if depth < 2 and rng.random() < 0.4 else 1
    out[rng.randint(-99, 99)], out[f"s{rng.randrange(100)}"] = rand_text(rng, 1), 2  # both kinds
    return out


def test_mixed_key_types_render_and_keep_the_cache(tok: Tokenizer, rng_seed: int) -> None:
    """Regression: nested tool-call arguments and tool schemas mixing int and str keys render
    fine in the template, but the cache keys' json.dumps(sort_keys=True) raised TypeError."""
    rng = random.Random(rng_seed)
    for source in (None, QWEN3_THINKING):
        history = rand_history(rng, end_with_user=False)
        history.insert(-1, AssistantMessage("", None, [ToolCall("mixed", "f", {})]))
        history.insert(-1, ToolResult("mixed", rand_text(rng)))
        history[-3].tool_calls[0].arguments["nested"] = rand_mixed_keys(rng)
        history.append(UserMessage(rand_text(rng)))
        tools = [*TOOLS, {"name": "f", "parameters": rand_mixed_keys(rng)}]
        warm = ChatFormat(tok, chat_template=source)
        got = warm.render(history, tools=tools)
        template = warm.template(normalize_tools(tools))
        dicts = to_template_messages(history)
        assert got.text == template.render(dicts, tools=normalize_tools(tools))
        cold = ChatFormat(tok, chat_template=source).render(history, tools=tools)
        assert got.anchors == cold.anchors and got.token_ids == cold.token_ids
        # Keys are stable: the same history again finds everything in the cache.
        entries = dict(warm._cache)
        assert warm.render(history, tools=tools).anchors == got.anchors
        assert warm._cache == entries


def test_reasons_first_reads_the_generation_prompt(tok: Tokenizer, rng_seed: int) -> None:
    """An answer begins with reasoning where the prompt opens a think block, or where a hybrid
    template (thinking off closes an empty block) is left in thinking mode and its model opens
    the block itself; not with thinking off, nor under a template with no thinking mode."""
    from freetoken_agent.demo_text import CHAT_TEMPLATE as HYBRID

    rng = random.Random(rng_seed)
    tools = TOOLS if rng.random() < 0.5 else None
    off_branch = HYBRID[HYBRID.index("{%- if enable_thinking is defined") :]
    off_branch = off_branch[: off_branch.index("{%- endif %}") + len("{%- endif %}")]
    plain = HYBRID.replace(off_branch, "")  # no thinking mode at all
    # Thinking off unless asked for (DeepSeek-V3.1's default): the block is closed by default.
    off_by_default = HYBRID.replace("enable_thinking is defined and enable_thinking is false",
                                    "not enable_thinking")  # fmt: skip
    assert plain != HYBRID and off_by_default != HYBRID, "the demo template changed"
    cases = [
        (ChatFormat(tok), True),  # the demo's hybrid template: the model opens the block
        (ChatFormat(tok, enable_thinking=True), True),
        (ChatFormat(tok, enable_thinking=False), False),
        (ChatFormat(tok, chat_template=QWEN3_THINKING), True),  # the prompt opens it
        (ChatFormat(tok, chat_template=plain), False),
        (ChatFormat(tok, chat_template=plain, enable_thinking=True), False),
        (ChatFormat(tok, chat_template=off_by_default), False),
        (ChatFormat(tok, chat_template=off_by_default, enable_thinking=True), True),
    ]
    for fmt, expected in cases:
        assert fmt.reasons_first(tools) is expected, (fmt.template_kwargs, expected)
    assert ChatFormat(tok).opens_reasoning(tools) is False  # the hybrid's prompt opens nothing
    assert ChatFormat(tok, chat_template=QWEN3_THINKING).opens_reasoning(tools) is True


def test_a_full_render_cache_keeps_the_recently_used_sessions_warm(
    tok: Tokenizer, rng_seed: int, monkeypatch
) -> None:
    """The render cache (shared by a server's sessions) evicts its least recently used entries
    when full. It used to be cleared whole: every live session's next turn then rendered its
    history cold (O(n^2) template renders, ~28 s at 120k tokens). Here session A's history is
    rendered, then other histories fill the cache while A goes on being used: A's next turn
    takes as few template renders as with a cache of its own."""
    from freetoken_agent import anchor_locator

    rng = random.Random(rng_seed)
    renders = {"n": 0}
    real = ChatTemplate.render_plain  # (which ChatTemplate.render calls)

    def counting(self, *args, **kwargs):
        renders["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render_plain", counting)

    def renders_of(fmt: ChatFormat, history: list) -> int:
        before = renders["n"]
        fmt.render(history)
        return renders["n"] - before

    session = [rand_history(rng, end_with_user=True)]
    others = [rand_history(rng, end_with_user=True) for _ in range(rng.randint(4, 8))]
    alone = ChatFormat(tok)
    alone.render(session[0])
    warm = renders_of(alone, session[0])  # A's turn again, from its own cache
    sized = ChatFormat(tok)
    sized.render(session[0])
    entries = []  # what each other history's render adds
    for other in others:
        own = ChatFormat(tok)
        own.render(other)
        entries.append(len(own._cache))
    # Room for A's and any one other's entries, not for all of them.
    limit = len(sized._cache) + max(entries) + 1
    assert len(sized._cache) + sum(entries) > limit, "the cache never fills: the test is void"
    monkeypatch.setattr(anchor_locator, "_CACHE_ENTRIES", limit)
    for other in others:  # other sessions fill the cache; A's turns come between them
        sized.render(other)
        assert renders_of(sized, session[0]) == warm, rng_seed
    assert len(sized._cache) <= anchor_locator._CACHE_ENTRIES


def test_stable_contexts_are_the_prefixes_of_the_full_text(
    tok: Tokenizer, rng_seed: int, monkeypatch
) -> None:
    """AnchorLocator.stable (one pass of prefix digests over the full text) says of each
    truncated rendering R_j exactly whether it is a prefix of the full text. Qwen3's template
    drops the reasoning of turns a newer user message follows, so some R_j are not."""
    from freetoken_agent.anchor_locator import AnchorLocator

    rng = random.Random(rng_seed)
    seen = {"stable": 0, "unstable": 0}
    one_pass = AnchorLocator.stable

    def checked(self):
        got = one_pass(self)
        for j in range(len(self.dicts) + 1):
            text = "" if j == 0 else self.text(j)
            assert got[j] == (text is not None and self.full.startswith(text)), (rng_seed, j)
            seen["stable" if got[j] else "unstable"] += 1
        return got

    monkeypatch.setattr(AnchorLocator, "stable", checked)
    for source in (None, QWEN3_THINKING):
        for _ in range(4):
            ChatFormat(tok, chat_template=source).render(rand_history(rng), tools=TOOLS)
    assert seen["stable"] and seen["unstable"], seen


def test_a_langchain_tool_given_as_a_tool_says_how_to_convert_it() -> None:
    """Session(engine, tools=[a LangChain tool]), as the README's LangChain lines suggest: the
    refusal names the conversion (it said only "must be a dict")."""
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from freetoken_agent import InvalidRequestError

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with pytest.raises(InvalidRequestError, match="convert_to_openai_tool"):
        normalize_tools([add])
    assert normalize_tools([convert_to_openai_tool(add)])[0]["function"]["name"] == "add"
