"""Special tokens named in tokenizer_config (bos, eos, unk) are special added tokens even when
tokenizer.json has them only as ordinary pieces of its vocabulary (exports that list some
control tokens as added tokens and not others), as transformers makes them."""

from __future__ import annotations

import json
import random

from mistral_tokenizer import CONFIG, mistral_v3_backend
from tokenizers import Tokenizer as Backend

from freetoken_agent.engine.text.detokenizer import IncrementalDetokenizer
from freetoken_agent.engine.text.tokenizer import Tokenizer

WORDS = ["hi", "there", "the", "quick", "answer", "is"]


def test_named_specials_in_the_vocabulary_encode_and_decode_as_specials(rng_seed):
    rng = random.Random(rng_seed)
    raw = json.loads(mistral_v3_backend().to_str())
    named = {CONFIG["bos_token"], CONFIG["eos_token"]}
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] not in named]
    tok = Tokenizer(Backend.from_str(json.dumps(raw)), dict(CONFIG))
    bos, eos = tok.bos_token_id, tok.token_to_id(CONFIG["eos_token"])
    assert {bos, eos} <= tok.special_token_ids
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    split = tok.encode(f"{a}</s>{b}")  # one id for "</s>", not "<", "/", "s", ">"
    assert split[: len(tok.encode(a))] == tok.encode(a) and split[len(tok.encode(a))] == eos
    assert tok.encode(f"<s>{a}")[0] == bos
    ids = [*tok.encode(f"{a} {b}"), eos, *tok.encode(rng.choice(WORDS))]
    decoded = tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    assert "</s>" not in decoded and decoded == streamed
