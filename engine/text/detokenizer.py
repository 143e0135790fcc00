"""IncrementalDetokenizer: token ids in, text deltas out, one token at a time.

Decoding the whole sequence after every token costs O(n) per token; decoding each token alone
is wrong twice over: byte-level BPE splits multi-byte characters across tokens (a lone piece
decodes to U+FFFD), and SentencePiece-style decoders drop a leading space at the start of a
decode. The prefix/read-offset method of vLLM and TGI fixes both with a small window:

    prefix_text = decode(ids[prefix:read])      already emitted, decoded with some context
    new_text    = decode(ids[prefix:])          the same context plus the pending tokens
    delta       = new_text[len(prefix_text):]   emitted unless new_text ends in U+FFFD

Once new_text ends on a whole character, the decoder state is reset there (UTF-8 is
self-synchronising), so decode(all) == emitted + decode(rest) and the window can move on.

Skipped special tokens never enter the window. Skipping drops them before the decoder runs, so
they change no decode; but a window that opened on one (it was the last token emitted) decoded
the next word as the start of a text, and SentencePiece decoders then stripped its leading
space: "is" + "</s>" + "▁the" streamed as "isthe". `keep_special` names special tokens that
are not skipped (the output parsers' markers, engine/text/markers.py): the backend skips all
special tokens or none, so with some kept the others are dropped here and decoding keeps the
rest. Either way what is skipped is `tokenizer.special_token_ids` less the kept ones (the
tokens the config names included, which the bounded path below always took as empty).

One addition: a stream of invalid bytes (a broken model emitting continuation bytes) ends in
U+FFFD forever, which would grow the window without bound. An incomplete character is at most
3 bytes and every token in the window carries at least one byte, so once more than
`_MAX_PENDING` tokens are pending, text that stops 3 tokens before the end and is already a
prefix of new_text cannot change any more, and is emitted.

Limit: byte-fallback decoders (SentencePiece `<0xNN>` tokens) turn a whole run of byte tokens
into U+FFFD when any byte of it is invalid, so invalid bytes arriving later can change text
already emitted; for such a stream the deltas may differ from `decode(all)`. Valid text, and
any stream on byte-level BPE, always adds up exactly.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# Pending tokens tolerated while the text ends in U+FFFD before the bounded path kicks in.
_MAX_PENDING = 8
# Prompt tokens kept as decoding context (enough for any leading-space rule).
_CONTEXT_TOKENS = 5
# Bytes a trailing incomplete UTF-8 character can hold (a 4-byte character minus one).
_MAX_PARTIAL_BYTES = 3


class _Decoder(Protocol):
    special_token_ids: frozenset[int]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    # Optional: `token_bytes(id)`, the bytes a token stands for (Tokenizer.token_bytes); a
    # decoder without it never holds a prompt's last tokens back (`unfinished_tail`).


def unfinished_tail(tokenizer: _Decoder, ids: Sequence[int]) -> tuple[int, bool]:
    """(tokens, crossing) at the end of `ids` that hold an unfinished UTF-8 character: the
    last `tokens` ids carry exactly its bytes, or (`crossing`) the first of them carries
    whole characters before them too. (0, False) when the ids end on a whole character, on
    invalid bytes or a literal U+FFFD (those stand for themselves), or the tokenizer cannot
    say its tokens' bytes."""
    last = list(ids[-_MAX_PARTIAL_BYTES:])
    # (one token more: a whole 4-byte character's last 3 bytes alone decode to U+FFFD)
    probe = list(ids[-_MAX_PARTIAL_BYTES - 1 :])
    if not last or not tokenizer.decode(probe, skip_special_tokens=False).endswith(REPLACEMENT):
        return 0, False  # a whole character: the token table (Tokenizer.token_bytes, built
        # on first use, ~1 s for a large vocabulary) is not needed
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is None:
        return 0, False
    tail = [token_bytes(i) for i in last]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(b"".join(tail), final=False)
    unfinished = len(decoder.getstate()[0])  # a valid character's first 1-3 bytes, or none
    covered, tokens = 0, 0
    while covered < unfinished and tokens < len(tail):
        tokens += 1
        covered += len(tail[-tokens])
    if unfinished == 0 or covered < unfinished:
        return 0, False
    return tokens, covered > unfinished


class IncrementalDetokenizer:
    """Streams text for one sequence. `context` seeds the window with the last few prompt
    tokens (not emitted) so the first generated token decodes as it would mid-sequence.
    `keep_special`: special tokens left in the text although the others are skipped."""

    def __init__(
        self,
        tokenizer: _Decoder,
        skip_special_tokens: bool = True,
        context: Iterable[int] = (),
        keep_special: frozenset[int] = frozenset(),
        show_cut: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._show_cut = show_cut
        # Tokens that decode to nothing: dropped on arrival, so the window never holds one.
        self._empty_ids = (
            tokenizer.special_token_ids - keep_special if skip_special_tokens else frozenset()
        )
        # With specials kept the backend must not skip (it would skip those too); the others
        # are already out of the window.
        self._skip = skip_special_tokens and not keep_special
        # The window ids[0:] starts with context that is already emitted (or was never meant
        # to be); ids[:read] have been emitted, ids[read:] are pending.
        sent = list(context)
        # Judged on the context as sent: a skipped special token after the cut bytes ends
        # the character there, as the echo of the same ids reads it (echo.py)
        tail = unfinished_tail(tokenizer, sent)
        context = [i for i in sent if i not in self._empty_ids]
        if tail[0] == 0 and len(context) < len(sent):
            # ... so those bytes leave the window: joined to the reply's across the dropped
            # special, they made a character the prefix text counted as U+FFFD, and the
            # reply's first character vanished
            ended, crossing = unfinished_tail(tokenizer, context)
            if ended and not crossing:
                context = context[:-ended]
        self._ids, self._read, self._prefix_text, self._cut_text = self._window(context, *tail)
        # A prompt's cut character is never emitted alone: only with a generated token that
        # completes it (the whole character), or breaks it (then as the prompt's decode
        # already showed it: `_cut_text`, the U+FFFD standing for it, is not the reply's).
        # `show_cut`: the reader saw the prompt without it (the legacy completions' echo),
        # so the reply shows it in all cases: whole, or as U+FFFD (at the end, if no token).
        self._context_only = bool(self._cut_text)
        self._parts: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """Everything emitted so far (joined on each call: read it at the end, not per token)."""
        return "".join(self._parts)

    @property
    def pending(self) -> bool:
        """Whether tokens are held back: the text ends inside a character (or a decoder's
        leading-space quirk), which a later token completes."""
        return len(self._ids) > self._read

    @property
    def window(self) -> int:
        """Tokens currently kept for decoding (bounded; exposed for tests)."""
        return len(self._ids)

    def _context_window(self, context: list[int]) -> list[int]:
        """The last few context tokens, starting on a whole character: a window opening in
        the middle of one decodes to U+FFFD, and byte-fallback decoders then turn the whole
        run of byte tokens it belongs to (reply included) into U+FFFD."""
        start = max(0, len(context) - _CONTEXT_TOKENS)
        while start > 0 and len(context) - start < 4 * _CONTEXT_TOKENS:
            if not self._decode(context[start:]).startswith(REPLACEMENT):
                break
            start -= 1
        return context[start:]

    def _window(
        self, context: list[int], held: int, cross: bool
    ) -> tuple[list[int], int, str, str]:
        """The decoding window the context leaves, how many of its tokens are read, the text
        they stand for, and the U+FFFD the prompt's decode shows for a character it cuts
        ("" when it ends on a whole one).

        A prompt of token ids may end inside a character (a reply cut by max_tokens in an
        emoji, continued): read as emitted, the prefix held one U+FFFD per stray byte on
        byte-fallback decoders, and that many of the reply's characters were cut from its
        first delta ("and more" for "😀 and more"). The tokens holding just that unfinished
        character stay pending instead, so the generated token that completes it emits it
        whole, as vLLM's stream does; the window is placed on the whole characters before
        them (a byte-fallback decoder turns a run of byte tokens with a cut character in it
        into U+FFFD). A token holding whole characters and the start of the cut one (a
        byte-level merge) is read, its U+FFFD left out of the prefix text. A context ending
        in U+FFFD for another reason (the character itself, invalid bytes) is read as it is:
        those stand for themselves."""
        read = len(context) - (0 if cross else held)
        window = self._context_window(context[:read])
        prefix = self._decode(window)
        if cross and prefix.endswith(REPLACEMENT):
            prefix = prefix[:-1]  # (byte-level: one U+FFFD for the unfinished bytes)
            return window, len(window), prefix, REPLACEMENT
        cut = self._decode(context[read:]) if held else ""
        return window + context[read:], len(window), prefix, cut

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes (often "", never half a character)."""
        if self._finished:
            raise RuntimeError("push() after flush(): this detokenizer's sequence has ended")
        if token_id in self._empty_ids:
            return ""  # skipped: no text, and no place in the window (module doc)
        self._ids.append(int(token_id))
        self._context_only = False
        new_text = self._decode(self._ids)
        if not new_text.endswith(REPLACEMENT) and len(new_text) >= len(self._prefix_text):
            return self._emit(new_text, len(self._ids))
        if len(self._ids) - self._read > _MAX_PENDING:
            return self._emit_settled(new_text)
        return ""

    def _past_the_cut(self, delta: str) -> str:
        """The reply's first text without the prompt's cut character, where a generated token
        broke it rather than completing it (the prompt's decode showed its U+FFFD)."""
        if self._cut_text and delta.startswith(self._cut_text) and not self._show_cut:
            delta = delta[len(self._cut_text) :]
        self._cut_text = ""
        return delta

    def _emit(self, upto_text: str, upto: int) -> str:
        """Emit `upto_text` (the decode of ids[:upto]) past the prefix; the window moves on."""
        delta = self._past_the_cut(upto_text[len(self._prefix_text) :])
        # The old read offset becomes the new window start: it is decoding context only.
        # Dropping everything before it keeps memory and decode cost constant per token.
        del self._ids[: self._read]
        self._read = upto - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        if delta:
            self._parts.append(delta)
        return delta

    def _emit_settled(self, new_text: str) -> str:
        """The bounded path: emit text that no future token can change (see module doc)."""
        # Every token in the window carries a byte, so the last 3 hold any incomplete character.
        cut = len(self._ids) - _MAX_PARTIAL_BYTES
        if cut <= self._read:
            return ""
        settled = self._decode(self._ids[:cut])
        if len(settled) < len(self._prefix_text) or not new_text.startswith(settled):
            return ""
        return self._emit(settled, cut)

    def flush(self) -> str:
        """End of sequence: emit whatever is held (trailing U+FFFD included, as decode does)."""
        if self._finished:
            return ""
        self._finished = True
        if self._context_only:  # the prompt's cut character, and no token after it
            delta, self._cut_text = (self._cut_text if self._show_cut else ""), ""
            if delta:
                self._parts.append(delta)
            return delta
        new_text = self._decode(self._ids)
        delta = self._past_the_cut(new_text[len(self._prefix_text) :])
        if delta:
            self._parts.append(delta)
        return delta
