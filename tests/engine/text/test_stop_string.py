"""OutputState.stop_string: which stop string cut the text (the Anthropic API's stop_sequence).

The text is cut as soon as a token completes a stop string; if that token completes several,
the one that starts first wins, and of two starting at one place (a token writing "abc" with
stop strings "ab" and "abc") the first listed. With include_stop (vLLM's
include_stop_str_in_output) the text is cut after that stop string instead."""

from __future__ import annotations

import random

from freetoken_agent.engine.output_state import OutputState

WORDS = ["naïve", "café", "hello", "Ω≈", "x", " ", "ab", "abc", "b", "c"]


class WordTokens:
    """A tokenizer whose token ids index WORDS: one token may write several characters."""

    special_token_ids: frozenset[int] = frozenset()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[i] for i in ids)


def _stopped_by(ids: list[int], stop: list[str], include: bool = False) -> tuple[str, str | None]:
    state = OutputState(WordTokens(), stop, include_stop=include)
    out = ""
    for token in ids:
        out += state.push(token)
        if state.stopped:
            return out, state.stop_string
    return out + state.release(final=True), state.stop_string


def _expected(ids: list[int], stop: list[str], include: bool = False) -> tuple[str, str | None]:
    text = ""
    for token in ids:
        text += WORDS[token]
        found = [(text.find(s), i, s) for i, s in enumerate(stop) if s in text]
        if found:
            cut, _, first = min(found)
            return text[: cut + len(first) if include else cut], first
    return text, None


def test_the_stop_string_that_cut_the_text_is_kept(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(100):
        ids = [rng.randrange(len(WORDS)) for _ in range(rng.randint(3, 15))]
        stop = list(dict.fromkeys(rng.choice(WORDS[1:]) for _ in range(rng.randint(1, 3))))
        include = rng.random() < 0.5
        assert _stopped_by(ids, stop, include) == _expected(ids, stop, include), (ids, stop)


def test_one_token_completing_two_gives_the_first_listed():
    abc = [WORDS.index("x"), WORDS.index("abc")]
    assert _stopped_by(abc, ["abc", "ab"]) == ("x", "abc")
    assert _stopped_by(abc, ["ab", "abc"]) == ("x", "ab")
    assert _stopped_by(abc, ["c", "abc"]) == ("x", "abc")  # it starts first
    assert _stopped_by(abc, ["zz"]) == ("xabc", None)
    assert _stopped_by(abc, ["ab", "abc"], include=True) == ("xab", "ab")  # the rest dropped
    assert _stopped_by(abc, ["c", "abc"], include=True) == ("xabc", "abc")
