"""Over-sized input is refused by its size before any work that grows with it: a prompt longer
than the context before its ids are scanned, a long text encoded without holding the GIL, stop
lists capped, input nested too deeply refused as a request error (not a RecursionError)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import ContextLengthError, Engine, InvalidRequestError, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from freetoken_agent.engine.text.chat_template import ChatTemplate, plain_data
from freetoken_agent.engine.text.tokenizer import LONG_TEXT_CHARS, Tokenizer

VOCAB = 320  # the tiny model's


@pytest.fixture
def engine(tmp_path, rng_seed):
    make_tiny("qwen2_moe", tmp_path, rng_seed)
    return Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=2048, max_model_len=256)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("demo")))


def _nest(depth: int, leaf):
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


@pytest.mark.parametrize("form", ["list", "tensor", "tuple"])
def test_an_over_long_prompt_is_refused_by_its_length_before_its_ids_are_read(
    engine, rng_seed, form
):
    """Every id lies outside the vocabulary: had they been scanned first (per id, under the
    service's lock in a server), the error would name one of them."""
    rng = random.Random(rng_seed)
    n = rng.randint(300, 5000)
    ids = [rng.choice([-1, VOCAB, VOCAB + 7]) for _ in range(n)]
    prompt = {"list": ids, "tensor": torch.tensor(ids), "tuple": tuple(ids)}[form]
    with pytest.raises(ContextLengthError, match=f"the prompt has {n} tokens.*256"):
        engine.submit(prompt)
    assert not engine.has_unfinished()


def test_an_over_long_list_is_refused_before_its_items_are_checked(engine, rng_seed):
    """A non-integer item far into an over-long list: the length is what is wrong first."""
    rng = random.Random(rng_seed)
    ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(300, 3000))]
    ids[rng.randrange(257, len(ids))] = 1.5
    with pytest.raises(ContextLengthError, match=f"{len(ids)} tokens"):
        engine.submit(ids)
    # One that fits still gets its items checked, naming the bad one.
    with pytest.raises(InvalidRequestError, match="item 3 is 1.5"):
        engine.submit([5, 6, 7, 1.5])
    with pytest.raises(InvalidRequestError, match=f"token id {VOCAB} is outside"):
        engine.submit([5, VOCAB])


class _SpyBackend:
    """A tokenizers.Tokenizer that records which encode entry point was used."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def encode(self, *args, **kwargs):
        self.calls.append("encode")
        return self.inner.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self.calls.append("encode_batch")
        return self.inner.encode_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_long_text_is_encoded_through_encode_batch_with_the_same_ids(tokenizer, rng_seed):
    """tokenizers' `encode` holds the GIL throughout (seconds for a few MB: every other thread
    of a server stalls); `encode_batch` releases it."""
    rng = random.Random(rng_seed)
    words = ["hello", "wörld", "3.14", "<|im_end|>", "\n", "  ", "tool_call", "é"]
    text = " ".join(rng.choice(words) for _ in range(LONG_TEXT_CHARS // 3))
    assert len(text) > LONG_TEXT_CHARS
    inner = tokenizer.backend
    expected = inner.encode(text, add_special_tokens=False).ids
    spy = _SpyBackend(inner)
    tokenizer.backend = spy
    try:
        assert tokenizer.encode(text) == expected
        assert spy.calls == ["encode_batch"]
        spy.calls.clear()
        short = text[: rng.randint(1, 200)]
        assert tokenizer.encode(short) == inner.encode(short, add_special_tokens=False).ids
        assert spy.calls == ["encode"]
    finally:
        tokenizer.backend = inner


def test_stop_lists_are_capped():
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    SamplingParams(stop=["x" * MAX_STOP_CHARS])
    with pytest.raises(ValueError, match=rf"^stop holds {MAX_STOP_STRINGS + 1} strings.*OpenAI"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=rf"^stop\[1\] has {MAX_STOP_CHARS + 1} characters"):
        SamplingParams(stop=["ok", "y" * (MAX_STOP_CHARS + 1)])


def test_input_nested_too_deeply_is_a_request_error(tokenizer, rng_seed):
    rng = random.Random(rng_seed)
    deep = _nest(rng.randint(1500, 3000), 1)
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        plain_data(deep)
    assert plain_data(_nest(50, 1)) == _nest(50, 1)
    template = ChatTemplate(tokenizer.chat_template_sources["default"], tokenizer.special_tokens)
    user = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        template.render(user, tools=[tool])
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    history = [*user, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        template.render(history)
