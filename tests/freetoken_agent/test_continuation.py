"""Continuing the final assistant message: the rendering is the whole history's, cut right after
that message's written text (its end-of-turn left out), with the same tokens and anchors as far
as the cut; what cannot be continued is refused by name."""

from __future__ import annotations

import random

import pytest
from chat_histories import QWEN3_THINKING, TOOLS, check_token_prefix, rand_history, rand_text

from freetoken_agent import Engine
from freetoken_agent.chat_format import ChatFormat, common_prefix
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import AssistantMessage, ToolCall, UserMessage
from freetoken_agent.session import Session, TextDelta, Usage

PLAIN_CHATML = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


@pytest.fixture(params=["demo", "qwen3"])
def fmt(request, tok: Tokenizer) -> ChatFormat:
    return ChatFormat(tok, chat_template=QWEN3_THINKING if request.param == "qwen3" else None)


# A ChatML template that drops assistant content (as some templates drop it beside tool calls).
DROPS_CONTENT = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role != 'assistant' %}{{ m.content }}{% endif %}<|im_end|>\n{%- endfor %}"
)


def test_the_rendering_is_the_finished_ones_cut_after_the_text(
    fmt: ChatFormat,
    tok: Tokenizer,
    rng_seed: int,
) -> None:
    rng = random.Random(rng_seed)
    for _ in range(5):
        history = rand_history(rng)
        prefill = rand_text(rng, 4)
        history.append(AssistantMessage(prefill, rand_text(rng) if rng.random() < 0.5 else None))
        tools = TOOLS if rng.random() < 0.5 else None
        open_ = fmt.render(history, tools=tools, continue_final=True)
        closed = fmt.render(history, tools=tools, add_generation_prompt=False)
        # The same text up to the end of the prefill, then the closed one's end of turn alone.
        assert open_.text.endswith(prefill)
        assert closed.text.startswith(open_.text)
        assert closed.text[len(open_.text) :].startswith("<|im_end|>")
        assert open_.token_ids == tok.encode(open_.text)
        assert open_.generation_prefix == ""
        # Anchors: the closed rendering's, as far as the cut (the last message's start among them).
        kept = [a for a in closed.anchors if a.char_offset <= len(open_.text)]
        assert open_.anchors == kept
        assert open_.find("turn_start", len(history) - 1) is not None
        check_token_prefix(tok, open_)


def test_whitespace_written_at_the_end_is_kept(tok: Tokenizer, rng_seed: int) -> None:
    """The Qwen3 template trims content; the continuation keeps what the caller wrote."""
    rng = random.Random(rng_seed)
    fmt_ = ChatFormat(tok, chat_template=QWEN3_THINKING)
    prefill = rand_text(rng, 3) + rng.choice([" ", "\n", ":\n  ", " {\n"])
    history = [UserMessage(rand_text(rng)), AssistantMessage(prefill)]
    text = fmt_.render(history, continue_final=True).text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + prefill)
    assert not fmt_.render(history, add_generation_prompt=False).text.endswith(prefill)


def test_an_empty_prefill_opens_the_turn(fmt: ChatFormat, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    history = [UserMessage(rand_text(rng)), AssistantMessage("")]
    text = fmt.render(history, continue_final=True).text
    assert text.startswith(fmt.render(history[:1], add_generation_prompt=False).text)
    assert text.endswith("<|im_start|>assistant\n") or text.endswith("</think>\n\n")


def test_what_cannot_be_continued_is_refused(tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    fmt_ = ChatFormat(tok)
    with pytest.raises(InvalidRequestError, match="'user', not 'assistant'"):
        fmt_.render([UserMessage(rand_text(rng))], continue_final=True)
    call = ToolCall("call_0", "search", {"q": rand_text(rng)})
    history = [UserMessage(rand_text(rng)), AssistantMessage(rand_text(rng), None, [call])]
    with pytest.raises(InvalidRequestError, match="message 1 .assistant. has tool calls"):
        fmt_.render(history, tools=TOOLS, continue_final=True)
    dropping = ChatFormat(tok, chat_template=DROPS_CONTENT)
    with pytest.raises(InvalidRequestError, match="does not render the final assistant message"):
        dropping.render([UserMessage("q"), AssistantMessage(rand_text(rng))], continue_final=True)


def test_a_session_continues_and_its_next_turn_reuses_the_continuation(
    tok: Tokenizer,
    tmp_path_factory: pytest.TempPathFactory,
    rng_seed: int,
) -> None:
    """On the demo engine: the continued turn generates what greedy decoding of the cut
    prompt generates (the prompt checked above against the finished rendering), the events
    are that continuation alone, and the next turn, whose history holds the whole message
    (prefill + continuation), reuses the continued turn's prompt."""
    rng = random.Random(rng_seed)
    engine = Engine.load(
        ensure_demo_model(tmp_path_factory.mktemp("cache")),
        device="cpu",
        progress=False,
        kv_tokens=4096,
        max_model_len=1024,
    )
    n = rng.randint(3, 8)
    session = Session(engine, temperature=0, max_tokens=n, ignore_eos=True, parser_factory=None)
    # A template that keeps every turn as written (the demo's drops the think block of turns
    # before the last question, which would cut the reuse there, continued or not).
    session.chat_format = ChatFormat(tok, chat_template=PLAIN_CHATML)
    prefill = rand_text(rng, 3) + rng.choice(["", " ", ": "])
    history = [UserMessage(rand_text(rng)), AssistantMessage(prefill)]
    events = list(session.send(history, continue_final=True))
    prompt = session.chat_format.render(history, continue_final=True)
    assert prompt.text.endswith("<|im_start|>assistant\n" + prefill)
    greedy = engine.generate(prompt.token_ids, SamplingParams(temperature=0, max_tokens=n,
                                                              ignore_eos=True))  # fmt: skip
    assert session.last_output_ids == list(greedy.token_ids)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == tok.decode(greedy.token_ids)
    usage = events[-1]
    assert isinstance(usage, Usage) and usage.prompt_tokens == len(prompt)

    sent = prompt.token_ids + list(greedy.token_ids)
    history = [history[0], AssistantMessage(prefill + text), UserMessage(rand_text(rng))]
    usage = list(session.send(history, {"max_tokens": 1}))[-1]
    again = session.last_prompt.token_ids
    assert usage.exact
    assert usage.reused_tokens == min(common_prefix(sent, again), len(sent) - 1, len(again) - 1)
    # The cut prompt is kept but for its last token or two, where the prefill's end and the
    # continuation's start may tokenize differently once written together.
    assert usage.reused_tokens >= len(prompt) - 2
    engine.check_integrity()
