"""IncrementalDetokenizer: streamed deltas add up to `decode(all_ids)`, never half a character,
and each step decodes only a small window."""

from __future__ import annotations

import json
import random

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from freetoken_agent.demo_model import CORPUS, ensure_demo_model
from freetoken_agent.engine.text.detokenizer import IncrementalDetokenizer
from freetoken_agent.engine.text.token_bytes import TokenBytes
from freetoken_agent.engine.text.tokenizer import Tokenizer

PIECES = [
    " hello",
    "world",
    " 你好",
    "世界",
    "🙂",
    "🚀👍🏽",
    " naïve café",
    "\n",
    "  ",
    "def f(x):",
    "Ω≈ç√",
    "🇫🇷",
    "<think>",
    "<|im_end|>",
    "<|im_start|>",
    "ﷺ",
    "𝔘𝔫𝔦",
]


@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


class SentencePieceLike:
    """A Metaspace + byte-fallback BPE, decoded like Llama-2/Mistral: leading-space stripping
    and <0xNN> byte tokens, the other family of decoders the window must handle."""

    def __init__(self) -> None:
        base = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
        base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<unk>"], show_progress=False, limit_alphabet=80
        )
        base.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
        model = json.loads(base.to_str())["model"]
        vocab = dict(model["vocab"])
        vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        tok = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
        )
        tok.pre_tokenizer = base.pre_tokenizer
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
        self.backend = tok
        self.special_token_ids = frozenset({tok.token_to_id("<s>"), tok.token_to_id("</s>")})
        self.token_bytes = TokenBytes(tok)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingDecoder:
    """Wraps a tokenizer and records the longest window it was asked to decode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.special_token_ids = tok.special_token_ids
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def rand_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def stream(
    tok, ids: list[int], skip: bool = True, context: list[int] | None = None, via=None
) -> list[str]:
    """Push `ids` one by one (through `via`, a wrapper of `tok`, if given); checks the running
    text is always a prefix of the final one and the deltas add up to `tok.decode`."""
    detok = IncrementalDetokenizer(via or tok, skip_special_tokens=skip, context=context or ())
    if context:
        full = tok.decode(context + ids, skip)[len(tok.decode(context, skip)) :]
    else:
        full = tok.decode(ids, skip)
    deltas = []
    for token_id in ids:
        deltas.append(detok.push(token_id))
        assert full.startswith(detok.text), (ids, deltas)
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == full, (ids, deltas)
    return deltas


def byte_token_ids(tok: Tokenizer) -> dict[int, int]:
    """Byte value -> id of the demo tokenizer's single-byte token (GPT-2 byte-to-char map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars |= {b: chr(256 + i) for i, b in enumerate(extra)}
    ids = {b: tok.token_to_id(c) for b, c in chars.items()}
    assert None not in ids.values()
    return ids


def test_valid_text_streams_whole_characters(demo_tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(200):
        ids = demo_tok.encode(rand_text(rng, rng.randint(1, 30)))
        for skip in (True, False):
            deltas = stream(demo_tok, ids, skip)
            assert not any("\ufffd" in d for d in deltas), deltas


def test_random_ids_match_decode(demo_tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    special = sorted(demo_tok.special_token_ids)
    for _ in range(300):
        ids = [
            rng.choice(special) if rng.random() < 0.1 else rng.randrange(demo_tok.vocab_size)
            for _ in range(rng.randint(0, 60))
        ]
        for skip in (True, False):
            stream(demo_tok, ids, skip)


def test_broken_utf8_streams_match_decode_in_a_bounded_window(
    demo_tok: Tokenizer, rng_seed: int
) -> None:
    # Single-byte tokens mixing lead bytes, continuation bytes and ASCII: incomplete and
    # invalid sequences of every kind, including long runs that never become a character.
    rng = random.Random(rng_seed)
    byte_ids = byte_token_ids(demo_tok)
    groups = [
        [0xC3, 0xE4, 0xE5, 0xF0, 0xF4, 0xED, 0xE0, 0xC0, 0xFF],
        list(range(0x80, 0xC0)),
        [ord("a"), ord(" "), ord("\n")],
    ]
    specials = sorted(demo_tok.special_token_ids)
    for _ in range(200):
        weights = [rng.random() for _ in groups]
        ids = []
        for _ in range(rng.randint(1, 120)):
            if rng.random() < 0.05:
                ids.append(rng.choice(specials))
            else:
                ids.append(byte_ids[rng.choice(rng.choices(groups, weights)[0])])
        counting = CountingDecoder(demo_tok)
        for skip in (True, False):
            stream(demo_tok, ids, skip, via=counting)
        assert counting.longest <= 30, counting.longest


def test_window_stays_small_on_long_streams(demo_tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    byte_ids = byte_token_ids(demo_tok)
    text_ids = demo_tok.encode(rand_text(rng, 1500))
    garbage = [byte_ids[rng.randrange(0x80, 0xC0)] for _ in range(1500)]
    for ids in (text_ids, garbage, text_ids[:700] + garbage + text_ids[700:]):
        counting = CountingDecoder(demo_tok)
        detok = IncrementalDetokenizer(counting)
        for token_id in ids:
            detok.push(token_id)
            assert detok.window <= 30
        detok.flush()
        assert detok.text == demo_tok.decode(ids)
        assert counting.longest <= 30


def test_sentencepiece_style_decoder(rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    sp = SentencePieceLike()
    for _ in range(200):
        ids = sp.encode(rand_text(rng, rng.randint(1, 20)))
        for skip in (True, False):
            deltas = stream(sp, ids, skip)
            assert not any("\ufffd" in d for d in deltas), deltas


def test_context_makes_the_first_token_decode_mid_sequence(rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    sp = SentencePieceLike()
    prompt = sp.encode("say hello")
    reply = sp.encode("x hello world")[2:]  # starts with "▁hello": a leading space mid-text
    assert sp.decode(reply).startswith("hello")
    deltas = stream(sp, reply, context=prompt)
    assert "".join(deltas).startswith(" hello")
    for _ in range(50):
        prompt = sp.encode(rand_text(rng, 5))
        stream(sp, sp.encode("a" + rand_text(rng, 8))[1:], context=prompt)


def _kind(demo_tok: Tokenizer, kind: str):
    """(tokenizer, encode, byte value -> the id of its single-byte token) of a kind."""
    if kind == "byte-level":
        return demo_tok, demo_tok.encode, byte_token_ids(demo_tok)
    sp = SentencePieceLike()
    return sp, sp.encode, {b: sp.backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_a_prompt_ending_inside_a_character_leaves_it_to_the_reply(
    demo_tok: Tokenizer, kind: str, rng_seed: int
) -> None:
    """Token-id prompts can end inside a character (a reply cut by max_tokens mid-emoji,
    continued): the reply's first delta holds the whole character, and nothing of the reply
    is lost. Read as emitted, the prompt's stray bytes (one U+FFFD each on byte-fallback
    decoders) cut as many of the reply's characters ("and more" for "😀 and more"). A reply
    that breaks the character instead does not repeat the U+FFFD the prompt showed for it."""
    rng = random.Random(rng_seed)
    tok, encode, byte_ids = _kind(demo_tok, kind)
    for _ in range(100):
        char = rng.choice(["🙂", "你", "é", "🚀", "Ω", "𝔘"])
        raw = [byte_ids[b] for b in char.encode()]
        cut = rng.randrange(1, len(raw))
        before, after = rand_text(rng, rng.randint(1, 4)), rand_text(rng, rng.randint(0, 4))
        whole = encode(before)  # the prompt's whole characters
        context = whole + raw[:cut]
        reply = raw[cut:] + (encode("a" + after)[1:] if after else [])
        completes = rng.random() >= 0.2
        if not completes:  # a token that breaks the character instead of completing it
            reply = encode("a" + after)[1:] or encode("a")
        detok = IncrementalDetokenizer(tok, context=context)
        text = "".join(detok.push(t) for t in reply) + detok.flush()
        if all(t in tok.special_token_ids for t in reply):  # nothing shown: the prompt's
            assert text == "", text  # broken character is not the reply's text
            continue
        # The same as a stream given the character's first bytes as reply tokens, less the
        # U+FFFD the prompt showed for a character the reply breaks
        alike = IncrementalDetokenizer(tok, context=whole)
        alike_text = "".join(alike.push(t) for t in raw[:cut] + reply) + alike.flush()
        shown = "" if completes else tok.decode(raw[:cut])
        assert alike_text == shown + text, (before, char, cut, after, text)
        # Shown by the reply in every case (the legacy completions' echo left it out)
        echoed = IncrementalDetokenizer(tok, context=context, show_cut=True)
        assert "".join(echoed.push(t) for t in reply) + echoed.flush() == alike_text
        if completes:
            full = tok.decode(whole + raw + reply[len(raw) - cut :])
            assert text == full[len(tok.decode(whole)) :] and text.startswith(char)
        elif kind == "byte-level":  # (byte-fallback decoders turn a whole run of byte
            # tokens with invalid bytes into U+FFFD: the module's limit)
            full = tok.decode(context + reply)
            assert text == full[len(tok.decode(context)) :], (before, char, cut, after, text)
    detok = IncrementalDetokenizer(tok, context=encode("ka") + raw[:cut])
    assert detok.flush() == ""  # no reply: the prompt's broken character is not its text
    echoed = IncrementalDetokenizer(tok, context=encode("ka") + raw[:cut], show_cut=True)
    assert echoed.flush() == tok.decode(raw[:cut])  # ... unless the reply is to show it
    # A skipped special token after the cut bytes ends the character there (as the echo
    # reads the same ids): the reply's bytes are read on their own, as a decode that keeps
    # the special reads them (joined across it, the reply's character vanished)
    special = min(tok.special_token_ids)
    context = encode("ka") + raw[:cut] + [special]
    for show_cut in (False, True):
        detok = IncrementalDetokenizer(tok, context=context, show_cut=show_cut)
        text = "".join(detok.push(t) for t in raw[cut:]) + detok.flush()
        kept = tok.decode(context, skip_special_tokens=False)
        assert text == tok.decode(context + raw[cut:], skip_special_tokens=False)[len(kept) :]
        assert text and set(text) == {"\ufffd"}, text


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_a_prompt_ending_in_replacement_or_invalid_bytes_is_read_as_it_is(
    demo_tok: Tokenizer, kind: str, rng_seed: int
) -> None:
    """A U+FFFD the prompt holds, or bytes no character starts with, stand for themselves:
    the reply is what decoding the whole adds to the prompt's decode (holding them back as
    a cut character put U+FFFD at the start of the reply)."""
    rng = random.Random(rng_seed)
    tok, encode, byte_ids = _kind(demo_tok, kind)
    for _ in range(60):
        before = rand_text(rng, rng.randint(1, 4))
        stray = rng.choice([[rng.randrange(0x80, 0xC0)] * rng.randint(1, 3),
                            [rng.choice([0xC0, 0xC1, 0xFF, 0xF8])]])  # fmt: skip
        tail = rng.choice(
            [encode(before + "\ufffd"), encode(before) + [byte_ids[b] for b in stray]]
        )
        # ASCII words: no byte token of the reply joins the prompt's run of them (a
        # byte-fallback decoder turns a whole run with invalid bytes into U+FFFD)
        words = " ".join(rng.choice(["hello", "world", "def", "x"]) for _ in range(3))
        reply = encode("a " + words)[1:]
        detok = IncrementalDetokenizer(tok, context=tail)
        text = "".join(detok.push(t) for t in reply) + detok.flush()
        full = tok.decode(tail + reply)
        assert text == full[len(tok.decode(tail)) :], (tail, reply, text)


class CrossingVocab:
    """A byte-level vocabulary with a token crossing a character boundary (byte-level BPE
    merges inside runs of CJK letters): 好 + the first byte of 你."""

    special_token_ids = frozenset({0})
    PIECES = {0: b"", 1: b"hello ", 2: "好".encode() + "你".encode()[:1],
              3: "你".encode()[1:], 4: b" there", 5: "好".encode()}  # fmt: skip

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.PIECES[token_id]


class CountingBytes:
    """A tokenizer that counts the calls for its token table (built on first use, ~1 s for a
    large vocabulary)."""

    def __init__(self, tok) -> None:
        self.tok, self.special_token_ids, self.asked = tok, tok.special_token_ids, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def token_bytes(self):
        self.asked += 1
        return self.tok.token_bytes


def test_the_token_table_is_asked_only_for_a_prompt_ending_in_u_fffd(
    demo_tok: Tokenizer, rng_seed: int
) -> None:
    """Whole characters at a prompt's end, 4-byte ones split into byte tokens included (their
    last 3 bytes alone decode to U+FFFD), never build the token table."""
    rng = random.Random(rng_seed)
    byte_ids = byte_token_ids(demo_tok)
    counting = CountingBytes(demo_tok)
    for _ in range(50):
        char = rng.choice(["🙂", "𝔘", "你", "é", "a"])
        context = demo_tok.encode(rand_text(rng, 3)) + [byte_ids[b] for b in char.encode()]
        IncrementalDetokenizer(counting, context=context)
    assert counting.asked == 0
    IncrementalDetokenizer(counting, context=[byte_ids[0xF0], byte_ids[0x9F]])
    assert counting.asked == 1


def test_a_prompt_token_crossing_into_a_cut_character_is_not_repeated() -> None:
    """The prompt ends on a token holding 好 and the first byte of 你: a reply completing 你
    starts with 你 (holding that token back emitted 好 again); one breaking it shows no
    U+FFFD of the prompt's; no reply shows nothing."""
    tok = CrossingVocab()
    for reply, want in (([3, 4], "你 there"), ([4], " there"), ([0], "")):
        detok = IncrementalDetokenizer(tok, context=[1, 2])
        assert "".join(detok.push(t) for t in reply) + detok.flush() == want, reply


def test_flush_ends_the_stream(demo_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(demo_tok)
    assert detok.push(byte_token_ids(demo_tok)[0xE4]) == ""  # half a character: held
    assert detok.flush() == "\ufffd"  # the end: shown as decode shows it
    assert detok.flush() == ""
    assert detok.text == "\ufffd"
    with pytest.raises(RuntimeError, match="after flush"):
        detok.push(1)
