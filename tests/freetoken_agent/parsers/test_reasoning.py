"""`<think>` ... `</think>` split, with and without the block opened by the template."""

from __future__ import annotations

import random
from types import SimpleNamespace

from chat_histories import QWEN3_THINKING

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.parsers import (
    ContentDelta,
    ReasoningDelta,
    ReasoningSplitter,
    opens_think_block,
    prompt_opens_reasoning,
)


def reasoning_text(rng, kit) -> str:
    # Tool-call syntax and tag fragments inside the thinking stay reasoning.
    r = kit.without(rng, lambda: kit.rand_text(rng, 0, 60), "</think>")
    r = "x" + r if r.startswith("<think>") else r  # would be a repeated open tag
    if rng.random() < 0.5:
        r += '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>' + r[:5]
    return r


def split(kit, starts: bool, chunks: list[str]) -> list:
    return kit.merge(kit.run(ReasoningSplitter(starts), chunks))


def test_qwen_layout_in_every_chunking(rng, kit):
    """`<think>\\nR\\n</think>\\n\\nC` gives exactly R and C, for any R and C."""
    for _ in range(40):
        r = reasoning_text(rng, kit)
        c = kit.without(rng, lambda: kit.rand_text(rng, 0, 40), "</think>").lstrip()
        starts = rng.random() < 0.5
        lead = "" if starts else rng.choice(["", "\n", "  "]) + "<think>\n"
        text = f"{lead}{r}\n</think>\n\n{c}"
        want = [ReasoningDelta(r)] if r else []
        want += [ContentDelta(c)] if c else []
        for chunks in kit.chunkings(rng, text):
            assert split(kit, starts, chunks) == want, (text, chunks)


def test_no_think_block_is_all_content(rng, kit):
    for _ in range(20):
        c = kit.without(rng, lambda: kit.rand_text(rng, 1, 40), "<think>")
        for chunks in kit.chunkings(rng, c):
            assert split(kit, False, chunks) == [ContentDelta(c)]


def test_only_a_leading_block_is_reasoning():
    text = "Answer first. <think>not reasoning</think> still content"
    assert split_all(text) == [ContentDelta(text)]


def split_all(text: str, starts: bool = False) -> list:
    s = ReasoningSplitter(starts)
    return s.feed(text) + s.finish()


def test_other_newlines_are_kept():
    # Only one newline after <think> and one before </think> belong to the tags.
    got = split_all("<think>\n\nA\n\nB\n\n</think>\n\nC\n\nD\n")
    assert got == [ReasoningDelta("\nA\n\nB\n"), ContentDelta("C\n\nD\n")]


def test_template_opened_block_with_a_repeated_open_tag():
    assert split_all("<think>\nR</think>C", starts=True) == [
        ReasoningDelta("R"),
        ContentDelta("C"),
    ]
    # Without a repeated tag nothing is stripped at the start.
    assert split_all("\nR</think>C", starts=True) == [ReasoningDelta("\nR"), ContentDelta("C")]


def test_unclosed_block_stays_reasoning_and_held_text_is_released(rng, kit):
    r = reasoning_text(rng, kit) + "\n</thi"  # cut inside the close tag
    for chunks in kit.chunkings(rng, "<think>\n" + r):
        assert split(kit, False, chunks) == [ReasoningDelta(r)]


def test_partial_tags_are_held_only_while_they_can_complete():
    s = ReasoningSplitter(True)
    assert s.feed("a <b> c") == [ReasoningDelta("a <b> c")]
    assert s.feed(" </th") == [ReasoningDelta(" ")]
    assert s.feed("x") == [ReasoningDelta("</thx")]
    s = ReasoningSplitter(False)
    assert s.feed("<thi") == []
    assert s.feed("s is") == [ContentDelta("<this is")]


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_a_think_block_opens_only_with_the_think_token(tmp_path, rng_seed):
    """`opens_think_block`: the template's `<think>` (the token) opens the block; the same
    text at the end of a continued assistant message (encoded as characters) does not; with
    no tokenizer the text alone tells."""
    rng = random.Random(rng_seed)
    tok = Tokenizer.from_dir(ensure_demo_model(tmp_path))
    user = {"role": "user", "content": rng.choice(["hi", "ka lo", "x"])}
    opened = ChatFormat(tok, chat_template=QWEN3_THINKING).render([user])
    assert opens_think_block(opened, tok)
    tail = "<think>" + rng.choice(["", "\n", "\n\n"])
    prefill = {"role": "assistant", "content": rng.choice(["so ", ""]) + tail}
    continued = ChatFormat(tok).render([user, prefill], continue_final=True)
    assert prompt_opens_reasoning(continued.text)  # the text alone would say it opens
    assert not opens_think_block(continued, tok)
    assert opens_think_block(continued, None)


def test_a_think_word_that_is_no_added_token_leaves_the_text_to_tell(rng_seed):
    """Where `<think>` is in the vocabulary but not an added token, text never encodes to its
    id (the template's `<think>` is characters too): the text alone tells, as before."""
    rng = random.Random(rng_seed)
    think_id = rng.randint(10, 99)
    text = "<|im_start|>assistant\n<think>" + rng.choice(["", "\n"])
    prompt = SimpleNamespace(text=text, token_ids=[rng.randint(100, 200) for _ in range(6)])

    def tokenizer(added: dict) -> SimpleNamespace:
        backend = SimpleNamespace(get_added_tokens_decoder=lambda: added)
        return SimpleNamespace(token_to_id=lambda t: think_id, backend=backend,
                               decode=lambda ids: "x")  # fmt: skip

    assert opens_think_block(prompt, tokenizer({}))  # a vocabulary word: the text tells
    assert not opens_think_block(prompt, tokenizer({think_id: "<think>"}))  # the token: absent
