"""ChatFreeToken(logprobs=True, top_logprobs=k): each generated token's raw log-probability in
`response_metadata["logprobs"]`, ChatOpenAI's shape, from invoke and (added up) from stream;
absent when not asked. Values are held to a second engine's score path of the same tokens."""

from __future__ import annotations

import json
import random

import pytest
import torch
from langchain_core.messages import HumanMessage
from scripted_engine import ScriptedEngine

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.integrations.langchain_runtime import service_for
from freetoken_agent.service import EngineService

TOL = 1e-4  # float32 logits computed in other shapes (decode vs the reference's prefill)
WORDS = ["alpha", "beta", "café", "你好", "x,", "{a:", "1}", "!?", "line\nbreak"]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def _load(path) -> Engine:
    return Engine.load(path, device="cpu", progress=False, kv_tokens=8192, max_model_len=2048)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    engine = _load(path)
    yield engine, path
    service_for(engine).close()


def _aggregate(chunks):
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    return merged


def _check_shape(content: list, k: int, seed: int) -> None:
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}, seed
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"], seed
        assert len(e["top_logprobs"]) == k, seed
        values = [t["logprob"] for t in e["top_logprobs"]]
        assert values == sorted(values, reverse=True), seed


def test_invoke_and_stream_carry_the_engine_s_logprobs(demo, rng_seed):
    engine, path = demo
    rng = random.Random(rng_seed)
    k = rng.randint(0, 20)
    n = rng.randint(2, 10)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=n, logprobs=True, top_logprobs=k)
    prompt = [HumanMessage(_text(rng))]
    message = llm.invoke(prompt)
    logprobs = message.response_metadata["logprobs"]
    assert logprobs["refusal"] is None
    content = logprobs["content"]
    assert len(content) == message.usage_metadata["output_tokens"], rng_seed
    _check_shape(content, k, rng_seed)
    session = llm._ensure_engine().last
    ids, out = session.last_prompt.token_ids, session.last_output_ids
    assert len(out) == len(content), rng_seed
    ref = torch.log_softmax(_load(path).score(ids + out).double(), dim=-1)
    tokenizer = engine.tokenizer
    for i, (entry, token) in enumerate(zip(content, out, strict=True)):
        row = ref[len(ids) - 1 + i]
        assert entry["token"] == tokenizer.decode([token], skip_special_tokens=False), rng_seed
        assert abs(entry["logprob"] - row[token].item()) <= TOL, (rng_seed, i)
        got = [t["logprob"] for t in entry["top_logprobs"]]
        want = row.topk(k).values.tolist()
        assert all(abs(a - b) <= TOL for a, b in zip(got, want, strict=True)), (rng_seed, i)

    chunks = list(llm.stream(prompt))
    streamed = _aggregate(chunks).response_metadata["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in content], rng_seed
    for a, b in zip(streamed, content, strict=True):
        assert abs(a["logprob"] - b["logprob"]) <= TOL, rng_seed
    per_chunk = [len(c.response_metadata.get("logprobs", {}).get("content", [])) for c in chunks]
    assert sum(per_chunk) == len(content), rng_seed  # each token on one chunk only


def test_a_call_may_ask_and_absent_otherwise(demo, rng_seed):
    engine, _ = demo
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0, max_tokens=rng.randint(2, 6))
    prompt = [HumanMessage(_text(rng))]
    assert "logprobs" not in llm.invoke(prompt).response_metadata
    assert all("logprobs" not in c.response_metadata for c in llm.stream(prompt))
    asked = llm.bind(logprobs=True).invoke(prompt)
    content = asked.response_metadata["logprobs"]["content"]
    assert len(content) == asked.usage_metadata["output_tokens"], rng_seed
    _check_shape(content, 0, rng_seed)


@pytest.mark.parametrize(
    "options",
    [{"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 1}, {"logprobs": "yes"},
     {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}],
)  # fmt: skip
def test_bad_options_are_refused_naming_them(demo, options):
    engine, _ = demo
    llm = ChatFreeToken(engine=engine, max_tokens=2)
    with pytest.raises(ValueError) as caught:
        llm.invoke("hi", **options)
    named = "top_logprobs" if "top_logprobs" in options else "logprobs"
    assert named in str(caught.value)


def test_thinking_and_tool_call_tokens_have_entries(demo, rng_seed):
    """A reply with reasoning, text and a tool call (ScriptedEngine, its made-up values): one
    entry per token, in order, invoked and streamed."""
    engine, _ = demo
    rng = random.Random(rng_seed)
    fake = ScriptedEngine(engine)
    service = EngineService(fake)
    try:
        args = {"k": rng.randint(-9, 99)}
        reply = (
            f"<think>\n{_text(rng)}\n</think>\n\n{_text(rng)}\n"
            f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(args)}}}\n</tool_call>'
        )
        fake.replies = [(reply, "stop", None)] * 2
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        llm = ChatFreeToken(engine=service, logprobs=True).bind_tools([tool])
        ids = fake.tokenizer.encode(reply)
        expected = [-0.5 * (i + 1) for i in range(len(ids))]  # ScriptedEngine's values
        message = llm.invoke([HumanMessage(_text(rng))])
        assert message.tool_calls and message.additional_kwargs.get("reasoning_content")
        got = [e["logprob"] for e in message.response_metadata["logprobs"]["content"]]
        assert got == expected, rng_seed
        chunks = list(llm.stream([HumanMessage(_text(rng))]))
        streamed = _aggregate(chunks)
        assert [e["logprob"] for e in streamed.response_metadata["logprobs"]["content"]] == got
        for c in chunks:  # a chunk's tokens are those since the chunk before: its text's last
            text = c.content or c.additional_kwargs.get("reasoning_content")
            if text:
                joined = "".join(e["token"] for e in c.response_metadata["logprobs"]["content"])
                # (a character split over tokens shows as U+FFFD in each token's string; the
                # parser may hold a token's trailing newline, before a tag: "in", not "endswith")
                assert text in joined or "\ufffd" in joined, (rng_seed, text, joined)
    finally:
        service.close()
