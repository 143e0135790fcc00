"""A history that does not fit the engine's context is refused before its anchors are located.

Locating anchors renders a history prefix per message (anchor_locator.py): thousands of tiny
messages cost thousands of renders, seconds to minutes, for a prompt the engine then refuses.
ChatFormat.render(max_model_len=...) refuses it after one render and one tokenization; a
Session passes its engine's context (through an EngineService or a view of one too)."""

from __future__ import annotations

import random

import pytest
from render_count import count_renders

from freetoken_agent import ContextLengthError, Engine
from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import AssistantMessage, ToolCall, ToolResult, UserMessage
from freetoken_agent.service import EngineService, ServiceView
from freetoken_agent.session import Session

WORDS = ["alpha", "beta", "café", "你好", "🙂", "x,", "{a:", "1}"]
CONTEXT = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def renders(monkeypatch) -> list[int]:
    """Counts the chat template renders (one per call of ChatTemplate.render_plain)."""
    return count_renders(monkeypatch)


def _history(rng: random.Random, n: int) -> list:
    out: list = []
    while len(out) < n:
        out.append(UserMessage(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))))
        if rng.random() < 0.3:
            call = ToolCall(f"c{len(out)}", "search", {"q": rng.choice(WORDS)})
            out += [AssistantMessage("", None, [call]), ToolResult(call.id, rng.choice(WORDS))]
        out.append(AssistantMessage(" ".join(rng.choice(WORDS) for _ in range(3))))
    out = out[:n]
    while not isinstance(out[-1], (UserMessage, ToolResult)):
        out.pop()
    return out


def _tools():
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    return [{"type": "function", "function": {"name": "search", "parameters": schema}}]


def test_render_refuses_what_does_not_fit_after_one_render(tok, renders, rng_seed):
    rng = random.Random(rng_seed)
    history = _history(rng, rng.randint(60, 120))
    whole = ChatFormat(tok).render(history, tools=_tools())
    n = len(whole.token_ids)
    assert len(renders) > len(history)  # locating anchors renders per message
    renders.clear()
    limit = rng.randint(n // 4, n)
    with pytest.raises(ContextLengthError) as refused:
        ChatFormat(tok).render(history, tools=_tools(), max_model_len=limit)
    assert str(refused.value) == (
        f"the prompt has {n} tokens; this engine's context holds {limit} tokens "
        f"(prompt + output), so at most {limit - 1} prompt tokens fit"
    )
    assert len(renders) == 1  # the full rendering only: no anchor was located


def test_a_history_that_fits_gets_the_same_prompt(tok, rng_seed):
    rng = random.Random(rng_seed)
    history = _history(rng, rng.randint(4, 40))
    whole = ChatFormat(tok).render(history, tools=_tools())
    with pytest.raises(ContextLengthError):  # the boundary: one output token must fit
        ChatFormat(tok).render(history, tools=_tools(), max_model_len=len(whole.token_ids))
    for limit in (len(whole.token_ids) + 1, len(whole.token_ids) + rng.randint(2, 10_000)):
        fitted = ChatFormat(tok).render(history, tools=_tools(), max_model_len=limit)
        assert fitted.token_ids == whole.token_ids and fitted.text == whole.text
        assert fitted.anchors == whole.anchors
        assert fitted.generation_prefix == whole.generation_prefix


@pytest.mark.parametrize("wrap", ["engine", "service", "view"])
def test_a_session_refuses_what_its_engine_cannot_hold_before_rendering_anchors(
    model_dir, renders, rng_seed, wrap
):
    rng = random.Random(rng_seed)
    engine = Engine.load(model_dir, device="cpu", progress=False, max_model_len=CONTEXT)
    history = [UserMessage(rng.choice(WORDS)) if i % 2 == 0 else AssistantMessage("ok")
               for i in range(rng.randint(400, 700) | 1)]  # fmt: skip
    ids = ChatFormat(engine.tokenizer).render(history[:1]).token_ids
    with pytest.raises(ContextLengthError) as engine_says:
        engine.submit(ids * (CONTEXT // len(ids) + 1))
    service = EngineService(engine)
    try:
        target = {"engine": engine, "service": service, "view": ServiceView(service)}[wrap]
        session = Session(target, max_tokens=4)
        renders.clear()
        with pytest.raises(ContextLengthError) as refused:
            if wrap == "view":  # a bare view has no `stream` (integrations add theirs)
                session.render(history)
            else:
                list(session.send(history))
        assert len(renders) == 1
        # The engine's own wording, with this prompt's length.
        pattern = str(engine_says.value).split(" tokens;")[1]
        assert str(refused.value).endswith(pattern)
        assert session.last_prompt is None and not engine.has_unfinished()
        if wrap != "view":
            events = list(session.send(history[:3]))  # a short history still runs
            assert events[-1].finish_reason in ("stop", "length")
    finally:
        service.close()
