"""TokenBytes: each token's bytes join to the text it encodes, for a byte-level BPE tokenizer
(the demo's, as Qwen's) and a SentencePiece one with byte fallback (Mistral v3's)."""

from __future__ import annotations

import random
import unicodedata

import pytest
from mistral_tokenizer import mistral_v3_backend
from tokenizers import AddedToken

from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.text.token_bytes import TokenBytes
from freetoken_agent.engine.text.tokenizer import Tokenizer

# Multi-byte characters a token may split: CJK, emoji with a skin tone and a ZWJ sequence,
# combining marks, and characters no small vocabulary holds (byte fallback).
PIECES = ["中文", "👍🏽", "👩\u200d💻", "e\u0301", "ß", "Ωμέγα", "\u2581", "\t", "  ", "\n"]


def _text(rng: random.Random) -> str:
    words = []
    for _ in range(rng.randint(1, 12)):
        word = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 7)))
        words.append(rng.choice([word, word, rng.choice(PIECES), word + rng.choice(PIECES)]))
    return rng.choice(["", " "]).join(words)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


def test_byte_level_tokens_join_to_the_texts_bytes(demo: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    token_bytes = TokenBytes(demo.backend)
    added = demo.backend.get_added_tokens_decoder().values()
    special = rng.choice(sorted(t.content for t in added))
    for _ in range(50):
        text = _text(rng) + rng.choice(["", special]) + _text(rng)
        ids = demo.backend.encode(text, add_special_tokens=False).ids
        whole = demo.backend.decode(ids, skip_special_tokens=False)  # the text, NFC
        assert whole == unicodedata.normalize("NFC", text)
        assert b"".join(map(token_bytes, ids)) == whole.encode("utf-8"), text
        # A token split inside a character reads U+FFFD alone; its bytes are the real ones.
        assert all(token_bytes(i).decode("utf-8", "replace") for i in ids)


def test_sentencepiece_tokens_keep_their_word_start_space(rng_seed: int) -> None:
    """Decoded alone, "▁the" loses its space to the decoder's Strip; its bytes keep it, and
    `<0xHH>` pieces are their byte."""
    rng = random.Random(rng_seed)
    backend = mistral_v3_backend()
    token_bytes = TokenBytes(backend)
    for _ in range(50):
        text = _text(rng).replace("\u2581", "").strip(" ") or "x"
        ids = backend.encode(text, add_special_tokens=False).ids
        joined = b"".join(map(token_bytes, ids))
        assert joined == (" " + backend.decode(ids)).encode("utf-8"), text
        assert joined.decode("utf-8").lstrip(" ") == text.lstrip(" "), text


def test_added_tokens_read_as_the_decoder_shows_them(rng_seed: int) -> None:
    """tokenizers runs added tokens through the decoder too: a SentencePiece added token
    holding "▁" shows a space in the text, and its bytes must (they kept U+2581)."""
    rng = random.Random(rng_seed)
    backend = mistral_v3_backend()
    contents = ["\u2581<EOT>", "\u2581" * rng.randint(2, 5), f"<x{rng.randint(0, 99)}>"]
    backend.add_special_tokens([AddedToken(contents[0], special=True, normalized=False)])
    backend.add_tokens([AddedToken(c, special=False, normalized=False) for c in contents[1:]])
    token_bytes = TokenBytes(backend)
    for content in contents:
        text = _text(rng).replace("\u2581", "").strip(" ") or "x"
        ids = backend.encode(text + content + "y", add_special_tokens=False).ids
        whole = backend.decode(ids, skip_special_tokens=False)
        assert b"".join(map(token_bytes, ids)) == (" " + whole).encode("utf-8"), content
