"""A tiny hybrid chat checkpoint (Qwen3.5-MoE: gated DeltaNet beside attention, random weights)
with the demo tokenizer and either the demo chat template or a real Qwen3.5 one."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import make_tiny

from freetoken_agent.demo_model import ADDED_TOKENS, build_tokenizer, tokenizer_config

# A Qwen3.5 chat template (tests/freetoken_agent/test_first_turn_anchor.py says where from).
QWEN3_5 = (
    Path(__file__).parents[1] / "freetoken_agent" / "qwen3_5_chat_template.jinja"
).read_text()


def make_hybrid_chat(folder: Path, seed: int, qwen3_5: bool = False) -> dict[str, int]:
    """Write the checkpoint into `folder`; returns the added tokens' ids by their text."""
    tok = build_tokenizer()
    ids = {content: tok.token_to_id(content) for content, _ in ADDED_TOKENS}
    make_tiny("qwen3_5_moe", folder, seed, vocab_size=tok.get_vocab_size(with_added_tokens=True),
              max_position_embeddings=8192, eos_token_id=ids["<|im_end|>"])  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(ids)
    if qwen3_5:
        config["chat_template"] = QWEN3_5
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return ids
