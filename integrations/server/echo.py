"""The legacy completions' `echo`: the prompt goes first in the choice's text and, with
`logprobs`, its tokens' entries first in the choice's logprobs (OpenAI's legacy behaviour and
vLLM's), in the whole response or in the first chunk of a stream.

The echoed text: a string prompt as it was sent; a token-id prompt decoded, special tokens kept
(they are part of what was sent, and HF's decode keeps them too). Each prompt token's
text_offset is where its text starts in the echoed text, so the generated tokens' offsets
follow from its length: for a string, the tokenizer's own offsets (a tokenizer-added bos sits
at 0); for ids, the characters the tokens before it decode to, counted as the generated
tokens' offsets are (the streaming detokenizer's releases); a character the prompt's ids cut
is left to the reply (engine/text/detokenizer.py). The first prompt token has no
log-probability (no position precedes it): null in token_logprobs and top_logprobs, as OpenAI
wrote it (`UnscoredToken`).

Shapes: P prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from freetoken_agent.engine.outputs import TokenEvent, TokenLogprob
from freetoken_agent.engine.text.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    unfinished_tail,
)
from freetoken_agent.integrations.openai_logprobs import UnscoredToken, with_top

Entry = tuple[TokenLogprob | UnscoredToken, int]  # a token's entry and its text offset


def reply_offset(event: TokenEvent, released: int) -> int:
    """Where `event`'s token's text begins in the reply: the engine's place for it (text held
    back before it, for a possible stop string, counts), else (an engine that gives none) the
    characters `released` before it."""
    return released if event.text_offset is None else event.text_offset


@dataclass(slots=True)
class Echo:
    """The echoed prompt as a run's first piece: its text and, when logprobs were asked, each
    prompt token's entry and offset (a stream sends both in its first chunk)."""

    text: str
    logprobs: list[Entry]


@dataclass(slots=True)
class EchoedPrompt:
    ids: list[int]  # [P] the prompt's tokens, as submitted
    text: str
    offsets: list[int]  # [P] each token's offset in `text`

    def piece(self, entries: Sequence[TokenLogprob | None] | None, k: int | None) -> Echo:
        """The Echo of this prompt; `entries`: the engine's prompt entries (None: the request
        ended before its prompt was computed, so there are none to give), written with the
        completion's `k` alternatives (None: logprobs not asked)."""
        if k is None or entries is None:
            return Echo(self.text, [])
        written: list[Entry] = []
        for token, entry, offset in zip(self.ids, entries, self.offsets, strict=True):
            written.append((UnscoredToken(token) if entry is None else with_top(entry, k), offset))
        return Echo(self.text, written)


def echoed_prompt(
    prompt: str | list[int], tokenizer: Any | None, leave_cut: bool = True
) -> EchoedPrompt:
    """The prompt's ids (as TextRun submits them), echoed text and offsets. A string needs the
    tokenizer (the caller has refused it without one); ids without one echo as "" (the engine
    gives no text then either). `leave_cut`: a character the ids cut is left to the reply
    (submitted with Engine.submit's `prompt_echoed`, which shows it whole or as U+FFFD); not
    when nothing is generated (max_tokens 0), where the echo shows it as the decode does."""
    if isinstance(prompt, str):
        ids, offsets = tokenizer.encode_with_offsets(prompt, add_special_tokens=True)
        return EchoedPrompt(ids, prompt, offsets)
    if tokenizer is None:
        return EchoedPrompt(list(prompt), "", [0] * len(prompt))
    held, crossing = unfinished_tail(tokenizer, prompt) if leave_cut else (0, False)
    # The cut character's tokens are not decoded here (a byte-fallback decoder would show
    # the whole run of byte tokens before them as U+FFFD); they point at the echo's end.
    shown = prompt[: len(prompt) - held] if held and not crossing else prompt
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    offsets, released = [], 0
    for token in shown:
        offsets.append(released)
        released += len(detok.push(token))
    detok.flush()
    text = detok.text
    if crossing:  # a token of whole characters and the cut one's start: its U+FFFD (one, a
        text = text.removesuffix(REPLACEMENT)  # byte-level decode's) is the reply's
    offsets += [len(text)] * (len(prompt) - len(shown))
    return EchoedPrompt(list(prompt), text, offsets)
