"""IncrementalDetokenizer with special tokens between words: the deltas add up to the whole
decode, on a SentencePiece-style (Metaspace + Strip) and on a byte-level BPE tokenizer, with
every special token skipped or with the parsers' markers kept (engine/text/markers.py).

Before the fix a skipped special token could open the window, and the Strip decoder then ate
the next word's leading space ("is" + "</s>" + "▁the" streamed as "isthe")."""

from __future__ import annotations

import random

import pytest
from mistral_tokenizer import CONFIG, mistral_v3_backend
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from freetoken_agent.demo_model import CORPUS
from freetoken_agent.engine.output_state import OutputState
from freetoken_agent.engine.text.detokenizer import IncrementalDetokenizer
from freetoken_agent.engine.text.markers import marker_ids
from freetoken_agent.engine.text.tokenizer import Tokenizer

# A byte-level tokenizer whose reasoning and tool tags are special tokens too.
BYTE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"]
WORDS = ["the", "quick", "answer", "is", "café", "naïve", "你好", "🙂", "x", "{", '"a"', ":", "\n"]


def mistral_v3() -> Tokenizer:
    """Metaspace + byte-fallback BPE decoded as Llama/Mistral do (Strip of one leading space)."""
    return Tokenizer(mistral_v3_backend(), dict(CONFIG))


def byte_level() -> Tokenizer:
    """GPT-2 style byte-level BPE (Qwen's family of decoders), tags as special tokens."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=BYTE_SPECIAL,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return Tokenizer(tok, {"eos_token": "<|im_end|>"})


TOKENIZERS = {"metaspace": mistral_v3, "byte_level": byte_level}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request) -> Tokenizer:
    return TOKENIZERS[request.param]()


def reference(tok: Tokenizer, ids: list[int], keep: frozenset[int]) -> str:
    """decode(all) under the skip rule: special tokens dropped, those in `keep` excepted."""
    if not keep:
        return tok.decode(ids, skip_special_tokens=True)
    drop = tok.special_token_ids - keep
    return tok.decode([i for i in ids if i not in drop], skip_special_tokens=False)


def sequence(tok: Tokenizer, rng: random.Random, keep: frozenset[int]) -> list[int]:
    """Words with special tokens between them, and, rarely, a skipped one inside a word's
    pieces (a kept one there could split a character: invalid text, see the module doc of
    detokenizer.py for what byte-fallback decoders then do)."""
    specials = sorted(tok.special_token_ids)
    skipped = sorted(tok.special_token_ids - keep)
    ids: list[int] = []
    for _ in range(rng.randint(1, 25)):
        text = "".join(rng.choice(WORDS) + rng.choice(["", " ", " "]) for _ in range(3))
        pieces = tok.encode(text)
        if rng.random() < 0.1 and len(pieces) > 1:
            cut = rng.randrange(1, len(pieces))
            pieces[cut:cut] = [rng.choice(skipped)]
        ids += pieces
        ids += [rng.choice(specials) for _ in range(rng.choice([0, 0, 1, 1, 2]))]
    return ids


def streamed(tok: Tokenizer, ids: list[int], keep: frozenset[int], context: list[int]) -> str:
    detok = IncrementalDetokenizer(tok, context=context, keep_special=keep)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert not any("\ufffd" in d for d in deltas), deltas  # never half a character
    return "".join(deltas)


def check(tok: Tokenizer, rng: random.Random, keep: frozenset[int]) -> None:
    for _ in range(150):
        ids = sequence(tok, rng, keep)
        out = streamed(tok, ids, keep, [])
        assert out == reference(tok, ids, keep), [tok.id_to_token(i) for i in ids]
        # With a prompt as context: prompt text + streamed text = the whole decode.
        context = sequence(tok, rng, keep)
        whole = reference(tok, context + ids, keep)
        head = reference(tok, context, keep)
        assert whole.startswith(head)
        out = streamed(tok, ids, keep, context)
        assert out == whole[len(head) :], [tok.id_to_token(i) for i in context + ids]


def test_skipped_specials_keep_the_next_words_space(tok: Tokenizer, rng_seed: int) -> None:
    check(tok, random.Random(rng_seed), frozenset())


def test_kept_markers_stream_as_the_whole_decode_gives_them(tok: Tokenizer, rng_seed: int) -> None:
    keep = marker_ids(tok)
    assert keep and keep < tok.special_token_ids and tok.eos_token_id not in keep
    check(tok, random.Random(rng_seed), keep)


def test_a_special_after_the_last_emit_does_not_eat_a_space() -> None:
    """The hunter's case, written out: "The answer is" </s> "the quick fox"."""
    tok = mistral_v3()
    ids = tok.encode("The answer is") + [tok.eos_token_id] + tok.encode("the quick fox")
    state = OutputState(tok, [], context=tok.encode("[INST] hi [/INST]"))
    text = "".join(state.push(i) for i in ids) + state.release(final=True)
    assert text == " The answer is the quick fox"


def test_markers_are_the_special_tags_only() -> None:
    """Mistral v3 keeps [TOOL_CALLS] (not [TOOL_RESULTS], [INST] or eos); the byte-level one
    its special `<think>`, `</think>`, `<tool_call>`."""
    mistral = mistral_v3()
    assert marker_ids(mistral) == {mistral.token_to_id("[TOOL_CALLS]")}
    byte = byte_level()
    assert marker_ids(byte) == {byte.token_to_id(t) for t in BYTE_SPECIAL[3:]}
    assert marker_ids(None) == frozenset()
