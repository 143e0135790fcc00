"""Tokenizer.encode_with_offsets (an echoed prompt's text_offset, integrations/server/echo.py):
the ids `encode` gives, and where each token's text starts in the text; a token the tokenizer
added (a bos it prepends, or a post-processor's bos or eos) spans nothing of the text and sits
where the text before it ends."""

from __future__ import annotations

import json
import random
import shutil
import string
from pathlib import Path

import tokenizers

from freetoken_agent.engine.text.tokenizer import Tokenizer


def _text(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + " .,:;!?\n" + "éüß中文字😀"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))


def _folder(demo: Path, tmp_path: Path, **config) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(demo, folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def test_offsets_are_where_each_token_starts(ours: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(30):
        text = _text(rng)
        ids, offsets = ours.encode_with_offsets(text, add_special_tokens=True)
        assert ids == ours.encode(text, add_special_tokens=True), (rng_seed, text)
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
        for token, start in zip(ids, offsets, strict=True):
            piece = ours.decode([token], skip_special_tokens=False)
            if "\ufffd" not in piece:  # a whole-character token: its text is there
                assert text[start : start + len(piece)] == piece, (rng_seed, text, token)


def test_added_tokens_sit_where_the_text_before_them_ends(demo, tmp_path, rng_seed) -> None:
    """A bos the tokenizer prepends (add_bos_token), and a post-processor adding bos and eos
    around the text: the text's own tokens keep their offsets, bos is at 0, eos at the end."""
    rng = random.Random(rng_seed)
    text = _text(rng)
    plain_ids, plain_offsets = Tokenizer.from_dir(demo).encode_with_offsets(text)
    folder = _folder(demo, tmp_path, bos_token="<|endoftext|>", add_bos_token=True)
    tok = Tokenizer.from_dir(folder)
    bos = tok.bos_token_id
    assert tok.encode_with_offsets(text, add_special_tokens=True) == (
        [bos, *plain_ids],
        [0, *plain_offsets],
    )
    eos = tok.token_to_id("<|im_end|>")
    raw = json.loads((folder / "tokenizer.json").read_text())
    processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>",
        special_tokens=[("<|endoftext|>", bos), ("<|im_end|>", eos)],
    )
    raw["post_processor"] = json.loads(processor.__getstate__())
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    ids, offsets = Tokenizer.from_dir(folder).encode_with_offsets(text, add_special_tokens=True)
    assert ids == [bos, *plain_ids, eos], rng_seed
    reach = max(end for _, end in tok.backend.encode(text).offsets)
    assert offsets == [0, *plain_offsets, reach], rng_seed
