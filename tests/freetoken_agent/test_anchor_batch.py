"""Batched probes (anchor_batch.py) give exactly what AnchorLocator's single probes give, in a
number of renders that does not grow with the agent run a user's follow-up re-renders."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from chat_histories import QWEN3_THINKING, TOOLS, rand_history, rand_text
from hybrid_chat import QWEN3_5
from render_count import count_renders

from freetoken_agent import anchor_locator
from freetoken_agent.anchor_batch import probe_at_once, sentinel
from freetoken_agent.anchor_locator import UNRENDERED, AnchorLocator
from freetoken_agent.anchor_probes import call_start, field_span
from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.text.chat_template import ChatTemplate
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


def _single(locator: AnchorLocator, probe: tuple):
    """What the single probe finds for a `probes` key."""
    kind, j, i, what = probe
    dicts, ref, gen = locator.ctx_dicts(j), locator.text(j), locator.ctx_gen(j)
    if kind == "call":
        return call_start(locator.render, dicts, i, what, ref, gen)
    try:
        return field_span(locator.render, dicts, i, what, ref, gen, required="it")
    except InvalidRequestError:
        return UNRENDERED


def _anchors(fmt: ChatFormat, history: list, tools) -> list[tuple]:
    prompt = fmt.render(history, tools=tools)
    return [(a.kind, a.message_index, a.char_offset, a.offset) for a in prompt.anchors]


@pytest.mark.parametrize(
    "source", [None, QWEN3_THINKING, QWEN3_5], ids=["demo", "qwen3", "qwen3.5"]
)
def test_batched_probes_equal_single_probes(
    tok: Tokenizer, rng_seed: int, monkeypatch, source: str | None
) -> None:
    """Sessions over random agent histories (user turns, tool rounds, reasoning the Qwen
    templates drop once a newer user message follows): every probe the batch fills equals the
    single probe in the same context, and every turn's anchors equal those found without it."""
    rng = random.Random(rng_seed)
    checked = {"field": 0, "call": 0, "absent": 0}
    batch = AnchorLocator.batch

    def verified(self, j, members, stable):
        before = set(self.probes)
        batch(self, j, members, stable)
        for probe in set(self.probes) - before:
            assert self.probes[probe] == _single(self, probe), (rng_seed, probe)
            checked["absent" if self.probes[probe] is UNRENDERED else probe[0]] += 1

    monkeypatch.setattr(AnchorLocator, "batch", verified)
    for _ in range(6):
        history, tools = rand_history(rng), TOOLS if rng.random() < 0.8 else None
        batched, single = (
            ChatFormat(tok, chat_template=source),
            ChatFormat(tok, chat_template=source),
        )
        for end in range(1, len(history) + 1):
            if history[end - 1].role == "system":
                continue
            got = _anchors(batched, history[:end], tools)
            with monkeypatch.context() as off:
                off.setattr(anchor_locator, "BATCH_MIN", 10**9)
                assert got == _anchors(single, history[:end], tools), (rng_seed, end)
    assert checked["field"] and checked["call"], checked
    if source is not None:  # the Qwen templates drop earlier turns' reasoning
        assert checked["absent"], checked


def _agent_run(rng: random.Random, fmt: ChatFormat, rounds: int) -> list:
    """A user's request, then `rounds` of reasoning, calls and results, each rendered as a
    Session would, then the final answer."""
    history: list = [SystemMessage(rand_text(rng)), UserMessage(rand_text(rng))]
    for r in range(rounds):
        calls = [
            ToolCall(f"c{r}_{i}", "search", {"q": rand_text(rng, 3)})
            for i in range(rng.randint(1, 2))
        ]
        history.append(
            AssistantMessage(rand_text(rng) if rng.random() < 0.3 else "", rand_text(rng), calls)
        )
        fmt.render(history, tools=TOOLS)
        history += [ToolResult(c.id, rand_text(rng), name=c.name) for c in calls]
        fmt.render(history, tools=TOOLS)
    history.append(AssistantMessage(rand_text(rng), rand_text(rng)))
    fmt.render(history, tools=TOOLS)
    return history


@pytest.mark.parametrize("source", [QWEN3_THINKING, QWEN3_5], ids=["qwen3", "qwen3.5"])
def test_a_follow_up_after_an_agent_run_takes_a_few_renders(
    tok: Tokenizer, rng_seed: int, monkeypatch, source: str
) -> None:
    """The template re-renders the run without its reasoning once the user follows up, so no
    truncated history of the run is a prefix of the new text and every run message is probed
    in the whole history. That took ~5 renders a message (75 after 6 rounds, 16.7 s at 49k
    tokens); now the batch's few, whatever the run's length, and the same anchors."""
    rng = random.Random(rng_seed)
    rounds = rng.randint(8, 16)
    fmt = ChatFormat(tok, chat_template=source)
    history = [*_agent_run(rng, fmt, rounds), UserMessage(rand_text(rng))]
    renders = count_renders(monkeypatch)
    got = _anchors(fmt, history, TOOLS)
    # The full text, R_n's head, the fields' render, two per call index (all cut, the last
    # alone; at most 2 calls here), one for a tail: a handful, not ~5 x 3 x rounds.
    assert len(renders) <= 8, (rng_seed, rounds, len(renders))
    monkeypatch.setattr(anchor_locator, "BATCH_MIN", 10**9)
    assert got == _anchors(ChatFormat(tok, chat_template=source), history, TOOLS), rng_seed


def _locator(source: str, dicts: list[dict], gen: bool = False) -> AnchorLocator:
    template = ChatTemplate(source)

    def render(ds, g, with_tools=True):
        return template.render(ds, tools=None, add_generation_prompt=g)

    return AnchorLocator(render, dicts, render(dicts, gen), gen, OrderedDict(), b"test")


# Prints the assistant's reasoning stripped of newlines and its content trimmed, then each call.
STRIPPING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content.strip('\\n') }}</think>{% endif %}"
    "{{ (m.content or '') | trim }}"
    "{%- for c in m.tool_calls or [] %}\n<call>{{ c.function.name }}</call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}"
)


def _messages(rng: random.Random, n: int) -> list[dict]:
    out = [{"role": "user", "content": rand_text(rng)}]
    for k in range(n):
        pad = rng.choice(["", "\n", " ", "\n\n "])
        calls = [
            {"id": f"c{k}{c}", "type": "function", "function": {"name": f"f{c}", "arguments": {}}}
            for c in range(rng.randint(0, 3))
        ]
        out.append(
            {
                "role": "assistant",
                "content": pad + rand_text(rng) + pad,
                "tool_calls": calls,
                "reasoning_content": pad + rand_text(rng) + pad,
            }  # fmt: skip
        )
        out.append({"role": "user", "content": rand_text(rng)})
    return out


def test_stripped_values_and_calls_match_the_single_probes(rng_seed: int) -> None:
    """Values the template strips, and up to three calls a message: the batch vouches for every
    probe and each equals the single probe."""
    rng = random.Random(rng_seed)
    dicts = _messages(rng, rng.randint(3, 8))
    loc = _locator(STRIPPING, dicts)
    fields = [
        (i, k) for i, d in enumerate(dicts) for k in ("content", "reasoning_content") if k in d
    ]
    calls = [(i, c) for i, d in enumerate(dicts) for c in range(len(d.get("tool_calls", [])))]
    spans, absent, starts = probe_at_once(loc.render, dicts, loc.full, False, fields, calls)
    assert set(spans) == set(fields) and not absent and set(starts) == set(calls), rng_seed
    for (i, key), span in spans.items():
        assert span == field_span(loc.render, dicts, i, key, loc.full, False), (rng_seed, i, key)
    for (i, c), start in starts.items():
        assert start == call_start(loc.render, dicts, i, c, loc.full, False), (rng_seed, i, c)


def test_what_the_batch_cannot_vouch_for_is_left_out(rng_seed: int) -> None:
    """A field printed twice, a value holding the sentinels' characters, and calls of two
    messages with no field between them: left to the single probes, never guessed."""
    rng = random.Random(rng_seed)
    twice = "{%- for m in messages %}[{{ m.content }}|{{ m.content }}]{%- endfor %}"
    dicts = [{"role": "user", "content": rand_text(rng)} for _ in range(rng.randint(2, 5))]
    loc = _locator(twice, dicts)
    fields = [(i, "content") for i in range(len(dicts))]
    assert probe_at_once(loc.render, dicts, loc.full, False, fields, []) == ({}, set(), {})

    dicts = _messages(rng, 3)
    fields = [(1, "content"), (3, "content")]
    dicts[1]["content"] = rand_text(rng) + sentinel(0)[0] + rand_text(rng)  # not batched
    loc = _locator(STRIPPING, dicts)
    spans, _, _ = probe_at_once(loc.render, dicts, loc.full, False, fields, [])
    assert set(spans) == {(3, "content")}, rng_seed
    dicts[1]["content"] = rand_text(rng) + sentinel(0) + rand_text(rng)  # reads as a sentinel
    loc = _locator(STRIPPING, dicts)
    assert probe_at_once(loc.render, dicts, loc.full, False, fields, []) == ({}, set(), {})

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
    dicts = [
        {"role": "user", "content": rand_text(rng)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": rand_text(rng)},
    ]
    loc = _locator(STRIPPING, dicts)
    fields = [(0, "content"), (3, "content")]
    spans, _, starts = probe_at_once(loc.render, dicts, loc.full, False, fields, [(1, 0), (2, 0)])
    assert set(spans) == set(fields) and starts == {}, rng_seed


def test_a_tool_result_the_template_drops_is_still_refused(
    tok: Tokenizer, rng_seed: int, monkeypatch
) -> None:
    """The batch does not answer for a tool result its render lacks: the single probe refuses
    the history (the model would never see the result), as without the batch."""
    rng = random.Random(rng_seed)
    no_results = (
        "{%- for m in messages %}{%- if m.role != 'tool' %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>"
        "{%- endfor %}{%- if loop.last %} (last){%- endif %}<|im_end|>\n{%- endif %}{%- endfor %}"
    )  # "(last)": no truncated history is a prefix of the whole, so all are probed at once
    calls = [
        ToolCall(f"c{i}", "search", {"q": rand_text(rng, 2)}) for i in range(rng.randint(2, 4))
    ]
    history = [
        UserMessage(rand_text(rng)),
        AssistantMessage(rand_text(rng), None, calls),
        *[ToolResult(c.id, rand_text(rng), name=c.name) for c in calls],
        UserMessage(rand_text(rng)),
    ]
    batches = []
    monkeypatch.setattr(
        anchor_locator, "probe_at_once", lambda *a: batches.append(a) or probe_at_once(*a)
    )
    with pytest.raises(InvalidRequestError, match="tool results"):
        ChatFormat(tok, chat_template=no_results).render(history)
    assert batches, "the batch never ran: the test is void"


# Templates built to trip a batch: every answer it gives must still be the single probe's.
ADVERSARIAL = {
    # A figure of all the contents at the end: sentinels change it, so no decomposition holds.
    "length at the end": "{%- for m in messages %}<{{ m.content }}>{%- endfor %}"
    "{{ messages | map(attribute='content') | join | length }}",
    # A mark after everything when the last content is long (a sentinel is not).
    "a mark for a long last content": "{%- for m in messages %}<{{ m.content }}>{%- endfor %}"
    "{%- if messages[-1].content | length > 5 %}!{%- endif %}",
    # The first content trimmed, the others as they are: with contents that begin or end with
    # newlines two decompositions can read the text, only one is the single probes'.
    "first trimmed": "{%- for m in messages %}{%- if loop.first %}{{ m.content | trim }}"
    "{%- else %}{{ m.content }}{%- endif %}{{ '\\n' }}{%- endfor %}]",
    # Calls right before the next content, which may begin like a call.
    "calls touch the next content": "{%- for m in messages %}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{%- endfor %}"
    "{%- endfor %}",
    # The number of the message's calls before its content, the calls after.
    "count before content": "{%- for m in messages %}({{ (m.tool_calls or []) | length }})"
    "{{ m.content }}{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>"
    "{%- endfor %};{%- endfor %}",
    # After a message's content, whether a later message has calls (gpt-oss's template looks
    # ahead so): cutting a later message's calls changes an earlier message's text.
    "looks ahead at later calls": "{%- for m in messages %}<{{ m.content }}"
    "{%- set ns = namespace(more=false) %}{%- for x in messages[loop.index:] %}"
    "{%- if x.tool_calls %}{%- set ns.more = true %}{%- endif %}{%- endfor %}"
    "{%- if ns.more %}+{%- endif %}"
    "{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{%- endfor %}>"
    "{%- endfor %}",
    # The whole history's number of calls before each message: every cut changes them all.
    "global count": "{%- set ns = namespace(n=0) %}{%- for m in messages %}"
    "{%- set ns.n = ns.n + (m.tool_calls or []) | length %}{%- endfor %}"
    "{%- for m in messages %}[{{ ns.n }}]{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{%- endfor %}"
    "{%- endfor %}",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_templates_get_only_the_single_probes_answers(rng_seed: int, name: str) -> None:
    rng = random.Random(rng_seed)
    source, answered = ADVERSARIAL[name], 0
    for _ in range(40):
        dicts = []
        for k in range(rng.randint(2, 6)):
            pad = [rng.choice(["", "\n", "\n\n", "<ca", " "]) for _ in range(2)]
            calls = [
                {
                    "id": f"c{k}{c}",
                    "type": "function",
                    "function": {"name": f"f{c}", "arguments": {}},
                }
                for c in range(rng.choice([0, 0, 1, 2]))
            ]
            dicts.append(
                {
                    "role": "assistant",
                    "content": pad[0] + rand_text(rng, 2) + pad[1],
                    "tool_calls": calls,
                }
            )
        loc = _locator(source, dicts)
        fields = [(i, "content") for i in range(len(dicts))]
        calls = [(i, c) for i, d in enumerate(dicts) for c in range(len(d["tool_calls"]))]
        spans, absent, starts = probe_at_once(loc.render, dicts, loc.full, False, fields, calls)
        for (i, key), span in spans.items():
            assert span == field_span(loc.render, dicts, i, key, loc.full, False), (rng_seed, i)
        for i, key in absent:
            assert _single(loc, ("field", len(dicts) + 1, i, key)) is UNRENDERED, (rng_seed, i)
        for (i, c), start in starts.items():
            assert start == call_start(loc.render, dicts, i, c, loc.full, False), (rng_seed, i, c)
        answered += len(spans) + len(absent) + len(starts)
    if name in ("calls touch the next content", "count before content"):
        assert answered, "the batch answered nothing: the test is void"


@pytest.mark.parametrize("source", [QWEN3_THINKING, QWEN3_5], ids=["qwen3", "qwen3.5"])
def test_tails_kept_short_give_the_same_turn_starts(
    tok: Tokenizer, rng_seed: int, monkeypatch, source: str
) -> None:
    """A tail is cached as its first TAIL_KEPT characters, its length and digest (a last
    call's arguments can be long): kept to a few characters, where a tail agrees with the
    text only in part (a tool result followed by another) or beyond what is kept, every
    turn's anchors are those found with whole tails."""
    rng = random.Random(rng_seed)
    for _ in range(3):
        history, kept = rand_history(rng), rng.randint(0, 12)
        short, whole = ChatFormat(tok, chat_template=source), ChatFormat(tok, chat_template=source)
        for end in range(2, len(history) + 1):
            with monkeypatch.context() as cut:
                cut.setattr(anchor_locator, "TAIL_KEPT", kept)
                got = _anchors(short, history[:end], TOOLS)
            assert got == _anchors(whole, history[:end], TOOLS), (rng_seed, kept, end)
