"""Per-request text state: streaming detokenization and stop strings.

Text is released only when it can no longer change: the detokenizer holds back incomplete UTF-8
characters, and while stop strings are set the last (longest stop - 1) characters are held too,
since they could be the start of a stop string that the next token completes.

With min_tokens (vLLM's), a stop string is searched for only once more than min_tokens tokens
were pushed, and only where it ends in the text those later tokens added: one that ends within
the first min_tokens tokens' text never stops the request, later neither; one that starts there
and ends after does (vLLM's detokenizer moves its search offset past the min_tokens-th token's
text and looks back len(stop) - 1 characters from it, as here).

With include_stop_str_in_output (vLLM's) the text is cut after the stop string instead of
before it: the client sees what ended its output.
"""

from __future__ import annotations

from collections.abc import Sequence

from freetoken_agent.engine.text.detokenizer import IncrementalDetokenizer
from freetoken_agent.engine.text.tokenizer import Tokenizer


class OutputState:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: list[str],
        context: Sequence[int] = (),
        keep_special: frozenset[int] = frozenset(),
        min_tokens: int = 0,
        include_stop: bool = False,
        show_cut: bool = False,
    ) -> None:
        """`context`: the prompt's ids, so that the first generated token decodes as it does
        after them (SentencePiece decoders drop a word's leading space at the start of a
        decode: without it "is" + " Paris" streamed as "isParis"). `keep_special`: special
        tokens kept in the text, the others being skipped (the parsers' markers, which the
        engine picks: engine/text/markers.py). `min_tokens`: the tokens pushed before stop
        strings count (SamplingParams.min_tokens). `include_stop`: the stop string stays in the
        text (SamplingParams.include_stop_str_in_output). `show_cut`: a character the prompt's
        ids cut is the reply's to show, even broken (Engine.submit's `prompt_echoed`)."""
        self.detok = (
            IncrementalDetokenizer(
                tokenizer, context=context, keep_special=keep_special, show_cut=show_cut
            )
            if tokenizer is not None
            else None
        )
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.pushed = 0  # tokens pushed (the ones that end the request by id are not)
        self.text = ""  # all decoded text so far (cut at a stop string once found)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that cut the text, once one did

    @property
    def mid_character(self) -> bool:
        """Whether the output so far ends inside a character (its detokenizer holds tokens)."""
        return self.detok is not None and self.detok.pending

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that is now final. Sets `stopped` when a stop string
        appears (the text is cut just before it, or just after it with `include_stop`)."""
        if self.detok is None:
            return ""
        before = len(self.text)
        self.text += self.detok.push(token_id)
        self.pushed += 1
        if self._cut_at_stop(before):
            return self.release(final=True)
        return self.release(final=False)

    def _cut_at_stop(self, before: int) -> bool:
        """Cut the text before the first stop string that ends past `before` (the text's
        length before what was just added) and set `stopped`; whether one did. Not while no
        more than min_tokens tokens were pushed (the text they added is never searched again)."""
        # (with min_tokens 0, text a final flush brings before any token was pushed too: a
        # prompt's cut character the reply shows, Engine.submit's prompt_echoed)
        if not self.stop or (self.min_tokens and self.pushed <= self.min_tokens):
            return False
        # A stop string s can start up to len(s) - 1 characters before the new text.
        found = (self.text.find(s, max(0, before - len(s) + 1)) for s in self.stop)
        cut = min((i for i in found if i >= 0), default=-1)
        if cut >= 0:
            # Which one (the Anthropic API's stop_sequence): of two a token completes at one
            # place, the first listed.
            self.stop_string = next(s for s in self.stop if self.text.startswith(s, cut))
            self.text = self.text[: cut + len(self.stop_string) if self.include_stop else cut]
            self.stopped = True
        return cut >= 0

    def release(self, final: bool) -> str:
        """The text now final. With `final` (the sequence ends) the detokenizer's held
        characters come out too (an incomplete one as U+FFFD, as a whole decode gives it),
        and a stop string they complete still cuts the text and sets `stopped`."""
        if final and self.detok is not None and not self.stopped:
            before = len(self.text)
            self.text += self.detok.flush()
            self._cut_at_stop(before)
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
