"""Mixtral tool calls through the engine: Mistral v3 tokenizers make `[TOOL_CALLS]` a special
(control) token, and output text is decoded with special tokens skipped. The engine keeps the
ones that are parser tags (engine/text/markers.py), so the call reaches the Mistral parser;
eos, `[INST]` and the other control tokens stay out of the text.

The model is a tiny random Mixtral whose logits are replaced by a script (greedy picks the
scripted token), so the whole path runs: prefill, decode, sampling, OutputState, parser."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mistral_tokenizer import CONFIG, CONTROL, mistral_v3_backend
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.text.markers import OUTPUT_MARKERS
from freetoken_agent.parsers import (
    ContentDelta,
    ParseWarning,
    ToolCallEnd,
    coalesce,
    hermes,
    mistral,
    parser_factory_for,
    qwen3_coder,
    reasoning,
)


def save_mistral_v3_tokenizer(folder: Path) -> int:
    """tests/helpers/mistral_tokenizer.py's tokenizer saved as an HF tokenizer folder; returns
    its vocabulary size."""
    tok = mistral_v3_backend()
    tok.save(str(folder / "tokenizer.json"))
    config = {**CONFIG, "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("mixtral_v3")
    vocab = save_mistral_v3_tokenizer(folder)
    make_tiny("mixtral", folder, seed=0, vocab_size=vocab)
    eng = Engine.load(folder, device="cpu", progress=False, kv_tokens=1024)
    yield eng
    eng.close()


def scripted(engine, monkeypatch, script: list[int]) -> None:
    """The model's next-token logits pick `script`'s tokens in turn (one request at a time),
    then eos: overlap scheduling samples a step ahead, past the script's end."""
    steps = iter(script)
    vocab, eos = engine.spec.vocab_size, engine.tokenizer.eos_token_id

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], vocab)  # [N, V]
        logits[:, next(steps, eos)] = 100.0
        return logits

    monkeypatch.setattr(engine.runner.model, "compute_logits", compute_logits)


def test_a_mixtral_tool_call_reaches_the_parser(engine, monkeypatch, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    tok = engine.tokenizer
    ids = tok.token_to_id
    city = rng.choice(["Paris", "Oslo", "Lima", "Kyiv"])
    call = [{"name": "get_weather", "arguments": {"city": city, "days": rng.randint(1, 9)}}]
    # Some prose with stray control tokens in it, then the call, then eos.
    prose = tok.encode("the answer is") + [ids("[INST]"), ids("<s>")] + tok.encode("the fox")
    body = [ids("[TOOL_CALLS]"), *tok.encode(" " + json.dumps(call))]
    script = (prose if rng.random() < 0.5 else []) + body + [tok.eos_token_id]
    scripted(engine, monkeypatch, script)
    prompt = tok.encode("[INST] weather? [/INST]", add_special_tokens=True)

    events = list(engine.stream(prompt, SamplingParams(max_tokens=len(script) + 4, temperature=0)))
    assert [e.token_id for e in events] == script
    assert events[-1].finish_reason == "stop"
    text = "".join(e.text for e in events)
    assert "[TOOL_CALLS]" in text
    for control in ("</s>", "<s>", "[INST]"):
        assert control not in text, text

    # The parser every entry point builds for this engine (Session, MCP, LangChain).
    parser = parser_factory_for(engine)(SimpleNamespace(text=tok.decode(prompt, False)))
    out = []
    for event in events:
        out += parser.feed(event.text)
    out = coalesce(out + parser.finish())
    ends = [e for e in out if isinstance(e, ToolCallEnd)]
    assert [(e.name, e.arguments) for e in ends] == [("get_weather", call[0]["arguments"])]
    assert not any(isinstance(e, ParseWarning) for e in out)
    content = "".join(e.text for e in out if isinstance(e, ContentDelta))
    assert "[TOOL_CALLS]" not in content


def test_eos_and_control_tokens_stay_out_of_the_text(engine, monkeypatch, rng_seed) -> None:
    """ignore_eos: eos and other control tokens are pushed mid-text; the text is the whole
    decode with them skipped (no word loses its space after one)."""
    rng = random.Random(rng_seed)
    tok = engine.tokenizer
    controls = sorted(tok.special_token_ids - {tok.token_to_id("[TOOL_CALLS]")})
    script: list[int] = []
    for _ in range(rng.randint(3, 10)):
        script += tok.encode(" ".join(rng.choice(["the", "quick", "fox", "is"]) for _ in range(2)))
        script += [rng.choice(controls) for _ in range(rng.randint(0, 2))]
    scripted(engine, monkeypatch, script)
    prompt = tok.encode("[INST] hi [/INST]", add_special_tokens=True)
    sampling = SamplingParams(max_tokens=len(script), temperature=0, ignore_eos=True)
    out = engine.generate(prompt, sampling)
    assert out.token_ids == script
    whole = tok.decode(prompt + script)
    assert out.text == whole[len(tok.decode(prompt)) :]
    for control in CONTROL:
        assert control not in out.text


def test_every_parser_tag_is_an_output_marker() -> None:
    """engine/text/markers.py lists the parsers' tags itself (the engine cannot import the
    agent layer); a tag added to a parser must be added there too."""
    tags = {
        reasoning.OPEN,
        reasoning.CLOSE,
        hermes.OPEN,
        hermes.CLOSE,
        qwen3_coder.OPEN,
        qwen3_coder.CLOSE,
        qwen3_coder.FUNCTION,
        qwen3_coder.FUNCTION_END,
        qwen3_coder.PARAMETER,
        qwen3_coder.PARAMETER_END,
        mistral.OPEN,
        mistral.ARGS,
        mistral.CALL_ID,
    }
    assert tags <= OUTPUT_MARKERS
