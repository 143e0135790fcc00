"""ChatFreeToken's continue_final_message: the model goes on from a trailing AIMessage of text
(a prefill, as ChatAnthropic continues one), sync and async, per call or as the model's field;
the prompt is the finished history cut after the prefill, the reply the continuation alone;
what cannot be continued is a ValueError before anything runs."""

from __future__ import annotations

import asyncio
import random

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from pydantic import BaseModel

from freetoken_agent import Engine
from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.messages import AssistantMessage, UserMessage

WORDS = ["alpha", "beta", "café", "ka", "lo", "mi", "x,", "{a:", "日本"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_a_trailing_ai_message_is_continued(scripted, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted
    question, prefill = _words(rng, 3), _words(rng, 2) + rng.choice(["", " ", ": {"])
    replies = [_words(rng, rng.randint(1, 4)) for _ in range(3)]
    fake.replies = [(r, "stop") for r in replies]
    messages = [HumanMessage(question), AIMessage(prefill)]
    closed = ChatFormat(fake.tokenizer).render(
        [UserMessage(question), AssistantMessage(prefill)], add_generation_prompt=False
    )
    per_call = ChatFreeToken(engine=service, max_tokens=8)
    assert per_call.invoke(messages, continue_final_message=True).content == replies[0]
    as_field = ChatFreeToken(engine=service, max_tokens=8, continue_final_message=True)
    assert asyncio.run(as_field.ainvoke(messages)).content == replies[1]
    for i in (0, 1):
        text = fake.tokenizer.decode(fake.prompts[i], skip_special_tokens=False)
        assert text.endswith(prefill) and closed.text == text + "<|im_end|>\n", i
    # Without it, the AIMessage is a finished turn and a new one opens after it.
    per_call.invoke(messages)
    text = fake.tokenizer.decode(fake.prompts[2], skip_special_tokens=False)
    assert text.startswith(closed.text)


class Answer(BaseModel):
    value: int


def test_what_cannot_be_continued_is_refused(scripted, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = scripted
    llm = ChatFreeToken(engine=service, max_tokens=8)
    human = HumanMessage(_words(rng, 2))
    called = AIMessage("", tool_calls=[{"id": "c1", "name": "f", "args": {}}])
    cases = [
        ([human], {}, "is not an AIMessage"),
        ([human, called], {}, "has tool calls"),
        ([human, AIMessage("{")], {"response_format": {"type": "json_object"}}, "response_format"),
        ([human, AIMessage("x")], {"continue_final_message": "yes"}, "True or False"),
    ]
    for messages, extra, says in cases:
        options = {"continue_final_message": True, **extra}
        with pytest.raises(ValueError, match=says):
            llm.invoke(messages, **options)
    structured = ChatFreeToken(engine=service, max_tokens=8, continue_final_message=True)
    with pytest.raises(ValueError, match="structured output"):
        structured.with_structured_output(Answer).invoke([human, AIMessage('{"value": ')])
    assert fake.submitted == 0
