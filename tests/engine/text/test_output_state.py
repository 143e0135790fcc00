"""OutputState: stop strings cut the streamed text wherever they complete, the characters the
detokenizer holds until the sequence ends (an incomplete one, flushed as U+FFFD) included."""

from __future__ import annotations

import random

import tokenizers
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.output_state import OutputState


class ByteTokens:
    """A tokenizer whose token ids are the bytes of UTF-8 text."""

    special_token_ids: frozenset[int] = frozenset()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _run(data: bytes, stop: list[str]) -> tuple[str, bool]:
    """Push every byte, then end the sequence: (the streamed text, whether a stop cut it)."""
    state = OutputState(ByteTokens(), stop)
    out = ""
    for b in data:
        out += state.push(b)
        if state.stopped:
            return out, True
    return out + state.release(final=True), state.stopped


def test_a_stop_string_cuts_where_it_completes(rng_seed):
    """Random words with a random stop string taken from the text: the stream is the text up
    to its first occurrence, whatever the word boundaries."""
    rng = random.Random(rng_seed)
    words = ["naïve", "café", "hello", "Ω≈", "🙂", "x", " "]
    text = "".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
    start = rng.randrange(len(text) - 1)
    stop = text[start : start + rng.randint(1, 3)]
    out, stopped = _run(text.encode(), [stop])
    assert stopped and out == text[: text.find(stop)]


def test_a_stop_string_completed_by_the_flushed_tail_cuts_too(rng_seed):
    """The sequence ends inside a multi-byte character: the flush gives U+FFFD, and a stop
    string ending in it (as a client takes it from an earlier, whole answer) cuts the text
    and counts as a stop."""
    rng = random.Random(rng_seed)
    head = "".join(rng.choice("abcdé ") for _ in range(rng.randint(3, 12)))
    char = rng.choice(["é", "你", "🙂"]).encode()
    data = head.encode() + char[: rng.randint(1, len(char) - 1)]  # an incomplete character
    whole = data.decode("utf-8", errors="replace")
    assert whole.endswith("\ufffd")
    stop = whole[-2:]
    out, stopped = _run(data, [stop])
    assert stopped and out == whole[: whole.find(stop)]
    out, stopped = _run(data, ["\u2603"])  # a stop that never appears: all of it, no stop
    assert not stopped and out == whole


def _word_tokenizer(folder=None):
    """Words `w3`..`w319` as single tokens behind a Metaspace pre-tokenizer and decoder, the
    SentencePiece style Llama, Mistral and Mixtral ship: a decode drops the leading space of
    its first word. Saved as `folder`/tokenizer.json when given."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"\u2581w{i}": i for i in range(3, 320)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = tokenizers.decoders.Metaspace(prepend_scheme="first")
    if folder is not None:
        tok.save(str(folder / "tokenizer.json"))
    return tok


class _Words:
    special_token_ids: frozenset[int] = frozenset({1, 2})

    def __init__(self):
        self.backend = _word_tokenizer()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_first_token_decodes_as_it_does_after_the_prompt(rng_seed):
    """With the prompt as context, prompt text + streamed text = the whole sequence decoded;
    without it the first word lost its space ("w10 w11w306 ...")."""
    rng = random.Random(rng_seed)
    tok = _Words()
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(1, 30))]
    out = [rng.randrange(3, 320) for _ in range(rng.randint(1, 20))]
    state = OutputState(tok, [], context=prompt)
    text = "".join(state.push(t) for t in out) + state.release(final=True)
    assert tok.decode(prompt) + text == tok.decode(prompt + out)
    assert text.startswith(" ")


def test_the_engine_streams_the_first_word_with_its_space(tmp_path, rng_seed):
    make_tiny("mixtral", tmp_path, rng_seed)
    _word_tokenizer(tmp_path)
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=1024)
    rng = random.Random(rng_seed)
    prompt = " ".join(f"w{rng.randrange(3, 320)}" for _ in range(rng.randint(2, 12)))
    ids = engine.tokenizer.encode(prompt)
    out = engine.generate(ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    whole = engine.tokenizer.decode(ids + out.token_ids)
    assert out.text == whole[len(engine.tokenizer.decode(ids)) :]
    # The first word keeps its space. A random model may open with a non-word (<unk>, <s>,
    # </s>: ids below 3, plain vocabulary here), which has no space of its own.
    words = [t for t in out.token_ids if t >= 3]
    if words:
        assert f" w{words[0]}" in out.text, out.text
    if out.token_ids[0] >= 3:
        assert out.text.startswith(" "), out.text


def _occurrences(text: str, s: str) -> list[int]:
    return [i for i in range(len(text) - len(s) + 1) if text.startswith(s, i)]


def test_min_tokens_ignores_the_stop_strings_that_end_within_its_tokens(rng_seed):
    """vLLM's rule: after min_tokens tokens, a stop string stops the text where it first ends
    past them (the earliest start among those ending there), straddling the boundary or not;
    one that ends within their text never stops it. One byte is one token and one character
    here, so the boundary is character min_tokens."""
    rng = random.Random(rng_seed)
    text = "".join(rng.choice("abc ") for _ in range(rng.randint(8, 40)))
    for _ in range(30):
        m = rng.randint(1, len(text) - 1)
        stops = []
        for _ in range(rng.randint(1, 3)):  # taken inside, across or past the boundary
            start = rng.randrange(len(text) - 1)
            stops.append(text[start : start + rng.randint(1, 5)])
        ends = [(i + len(s), i) for s in stops for i in _occurrences(text, s) if i + len(s) > m]
        want = (text, False)
        if ends:
            end = min(e for e, _ in ends)
            want = (text[: min(i for e, i in ends if e == end)], True)
        state = OutputState(ByteTokens(), stops, min_tokens=m)
        out = ""
        for b in text.encode():
            out += state.push(b)
            if state.stopped:
                break
        else:
            out += state.release(final=True)
        assert (out, state.stopped) == want, (text, stops, m)
