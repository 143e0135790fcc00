"""ChatFreeToken's structured output after the reasoning: where the template opens a think
block (or is a hybrid one in thinking mode), with_structured_output (json_schema, json_mode)
lets the model reason, then holds the answer to the schema; the thinking budget caps the
reasoning. With `reasoning=False` the template closes the block and the schema holds from the
first token, as before."""

from __future__ import annotations

import random

import pytest
from pydantic import BaseModel, Field
from thinking_model import check_close, thinking_demo

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.thinking_budget import MAX_WAIT
from freetoken_agent.integrations.langchain import ChatFreeToken


class Pick(BaseModel):
    count: int = Field(ge=0, le=99)
    flag: bool


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def engine(demo_dir, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = thinking_demo(demo_dir, tmp_path_factory.mktemp("thinking") / "model")
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def test_under_a_hybrid_template_the_model_reasons_first(demo_dir, rng_seed):
    """The demo model as made: Qwen3's hybrid template, whose prompt opens no block in thinking
    mode. The prompt is given the `<think>\\n` the model would write, then the model reasons
    and answers the schema; with `reasoning=False` the JSON comes from the first token."""
    rng = random.Random(rng_seed)
    engine = Engine.load(demo_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=1024)  # fmt: skip
    budget = rng.randint(2, 8)
    for reasoning in (None, False):
        llm = ChatFreeToken(engine=engine, temperature=0.8, seed=rng.randrange(1 << 30),
                            max_tokens=budget + 60, thinking_token_budget=budget,
                            logprobs=True, reasoning=reasoning)  # fmt: skip
        out = llm.with_structured_output(Pick, include_raw=True).invoke("ka lo mi")
        assert isinstance(out["parsed"], Pick), out
        raw = out["raw"]
        tokens = [e["token"] for e in raw.response_metadata["logprobs"]["content"]]
        assert "<think>" not in tokens, tokens  # the prompt wrote it, or thinking is off
        if reasoning is False:
            assert "</think>" not in tokens and not raw.additional_kwargs.get("reasoning_content")
        elif check_close(tokens, budget, MAX_WAIT) > 1:
            assert raw.additional_kwargs.get("reasoning_content"), raw


def test_structured_output_after_the_reasoning(engine, rng_seed):
    """json_schema (json_mode takes the same path: an open object, which a random model
    writes keys into until max_tokens, so it is not the one tested here)."""
    rng = random.Random(rng_seed)
    budget = rng.randint(2, 8)
    llm = ChatFreeToken(engine=engine, temperature=0.8, seed=rng.randrange(1 << 30),
                        max_tokens=budget + 60, thinking_token_budget=budget,
                        logprobs=True)  # fmt: skip
    out = llm.with_structured_output(Pick, include_raw=True).invoke("ka lo mi")
    assert isinstance(out["parsed"], Pick), out
    raw = out["raw"]
    tokens = [e["token"] for e in raw.response_metadata["logprobs"]["content"]]
    if check_close(tokens, budget, MAX_WAIT) > 1:
        assert raw.additional_kwargs.get("reasoning_content"), raw


def test_a_bad_ref_is_refused_and_stops_do_not_cut_the_answer(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0.8, seed=rng.randrange(1 << 30),
                        max_tokens=80, thinking_token_budget=rng.randint(0, 4),
                        stop=[": ", '"'])  # fmt: skip
    bad = {"title": "Bad", "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(InvalidRequestError, match=r"json_schema cannot be used.*/\$defs/missing"):
        llm.with_structured_output(bad).invoke("ka")
    assert isinstance(llm.with_structured_output(Pick).invoke("ka lo mi"), Pick)


def test_with_reasoning_off_the_schema_holds_from_the_first_token(engine, rng_seed):
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0.8, seed=rng.randrange(1 << 30),
                        max_tokens=60, reasoning=False, logprobs=True)  # fmt: skip
    out = llm.with_structured_output(Pick, include_raw=True).invoke("ka lo mi")
    assert isinstance(out["parsed"], Pick), out
    tokens = [e["token"] for e in out["raw"].response_metadata["logprobs"]["content"]]
    assert "</think>" not in tokens and not out["raw"].additional_kwargs.get("reasoning_content")


def test_usage_metadata_counts_the_reasoning(engine, rng_seed):
    """output_token_details.reasoning (ChatOpenAI's): the think block's tokens, tags included."""
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(engine=engine, temperature=0.8, seed=rng.randrange(1 << 30),
                        max_tokens=30, thinking_token_budget=rng.randint(0, 6),
                        logprobs=True)  # fmt: skip
    reply = llm.invoke("ka lo mi")
    tokens = [e["token"] for e in reply.response_metadata["logprobs"]["content"]]
    expected = tokens.index("</think>") + 1 if "</think>" in tokens else len(tokens)
    assert reply.usage_metadata["output_token_details"] == {"reasoning": expected}, tokens


def test_a_forced_call_follows_a_bounded_reasoning(demo_dir, rng_seed):
    """bind_tools(tool_choice=...) or with_structured_output(method="function_calling") under
    the demo's hybrid template: with a thinking budget the model reasons, then the grammar
    writes the call; without one the call comes from the first token (it must come)."""
    rng = random.Random(rng_seed)
    engine = Engine.load(demo_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=1024)  # fmt: skip
    for budget in rng.sample([None, rng.randint(2, 6)], 2):
        llm = ChatFreeToken(engine=engine, temperature=0.8, seed=rng.randrange(1 << 30),
                            max_tokens=120, thinking_token_budget=budget,
                            logprobs=True)  # fmt: skip
        if rng.random() < 0.5:
            out = llm.bind_tools([Pick], tool_choice="Pick").invoke("ka lo mi")
            Pick.model_validate(out.tool_calls[0]["args"])
        else:
            got = llm.with_structured_output(Pick, method="function_calling", include_raw=True)
            result = got.invoke("ka lo mi")
            assert isinstance(result["parsed"], Pick), result
            out = result["raw"]
        tokens = [e["token"] for e in out.response_metadata["logprobs"]["content"]]
        assert ("</think>" in tokens) == (budget is not None), (budget, tokens)
        if budget is not None:
            close = check_close(tokens, budget, MAX_WAIT)
            assert "<tool_call>" in tokens[close:] and tokens[-1] == "</tool_call>", tokens
            assert bool(out.additional_kwargs.get("reasoning_content")) == (close > 1), out
