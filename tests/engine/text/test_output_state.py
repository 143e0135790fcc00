"""OutputState: stop strings cut the streamed text wherever they complete, the characters the
detokenizer holds until the sequence ends (an incomplete one, flushed as U+FFFD) included."""

from __future__ import annotations

import random

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
