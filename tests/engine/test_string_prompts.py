"""A string prompt is encoded as transformers, vLLM and llama.cpp encode a raw prompt: with the
model's own special tokens (a Llama/Mistral bos at the start; nothing for Qwen-style models)."""

from __future__ import annotations

import json
import random

import pytest
from mistral_tokenizer import CONFIG, mistral_v3_backend
from tiny_models import make_tiny

from freetoken_agent import Engine, InvalidRequestError, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model

WORDS = ["the", "quick", "answer", "is", "café", "naïve", "x", "{", ":"]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))


def test_a_bos_model_gets_its_bos_and_a_qwen_style_one_nothing(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    tok = mistral_v3_backend()
    folder = tmp_path / "mistral"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**CONFIG, "add_bos_token": True}))
    make_tiny("mixtral", folder, rng_seed, vocab_size=tok.get_vocab_size())
    demo = ensure_demo_model(tmp_path / "demo")
    sp = SamplingParams(max_tokens=2, temperature=0)
    for path, bos in ((folder, tok.token_to_id("<s>")), (demo, None)):
        engine = Engine.load(path, device="cpu", progress=False, kv_tokens=1024)
        text = _text(rng)
        plain = engine.tokenizer.encode(text)
        out = engine.generate(text, sp)
        assert out.prompt_ids == ([bos] if bos is not None else []) + plain
        engine.close()


def test_a_lone_surrogate_in_a_string_prompt_is_refused_naming_it(tmp_path, rng_seed):
    """(Bytes that were not UTF-8, decoded with surrogateescape.) A refusal, not a TypeError
    from inside the tokenizer."""
    rng = random.Random(rng_seed)
    engine = Engine.load(ensure_demo_model(tmp_path), device="cpu", progress=False,
                         kv_tokens=256, max_model_len=128)  # fmt: skip
    head = rng.choice(["", "ka ", "café "])
    prompt = head + chr(rng.randint(0xD800, 0xDFFF)) + " lo"
    at = f"lone UTF-16 surrogate .* at character {len(head)} "
    with pytest.raises(InvalidRequestError, match=at):
        engine.generate(prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()
