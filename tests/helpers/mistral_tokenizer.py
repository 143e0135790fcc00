"""A Mistral-v3-style tokenizer built locally (nothing downloaded): Metaspace + byte-fallback
BPE trained on the demo corpus, decoded as Llama/Mistral do (Strip of one leading space), with
Mixtral-8x22B-Instruct's control tokens as special tokens at ids 0..9."""

from __future__ import annotations

import json

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from freetoken_agent.demo_model import CORPUS

CONTROL = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def mistral_v3_backend() -> Backend:
    base = Backend(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>"], show_progress=False, limit_alphabet=80
    )
    base.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    model = json.loads(base.to_str())["model"]
    vocab = {t: i for i, t in enumerate(CONTROL)}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    for piece in model["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    return tok
