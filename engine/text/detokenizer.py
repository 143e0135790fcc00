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

from collections.abc import Iterable
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
    ) -> None:
        self._tok = tokenizer
        # Tokens that decode to nothing: dropped on arrival, so the window never holds one.
        self._empty_ids = (
            tokenizer.special_token_ids - keep_special if skip_special_tokens else frozenset()
        )
        # With specials kept the backend must not skip (it would skip those too); the others
        # are already out of the window.
        self._skip = skip_special_tokens and not keep_special
        # The window ids[0:] starts with context that is already emitted (or was never meant
        # to be); ids[:read] have been emitted, ids[read:] are pending.
        self._ids, self._read = self._window([i for i in context if i not in self._empty_ids])
        self._prefix_text = self._decode(self._ids[: self._read])
        # Context tokens left pending (the prompt ends inside a character) are never emitted
        # alone: only with a generated token that completes or breaks their character.
        self._context_only = self.pending
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

    def _window(self, context: list[int]) -> tuple[list[int], int]:
        """The decoding window the context leaves, and how many of its tokens are read. A
        prompt of token ids may end inside a character (a reply cut by max_tokens in an
        emoji, continued): its last pieces (at most 3) then stay pending, so the generated
        token that completes the character emits it whole, as vLLM's stream does. Read as
        emitted, the prefix held one U+FFFD per stray byte on byte-fallback decoders, and
        that many of the reply's characters were cut from its first delta ("and more" for
        "😀 and more"). The window is placed on the whole characters: a byte-fallback decoder
        turns a whole run of byte tokens with a cut character in it into U+FFFD."""
        for read in range(len(context), max(0, len(context) - _MAX_PARTIAL_BYTES) - 1, -1):
            window = self._context_window(context[:read])
            if not self._decode(window).endswith(REPLACEMENT):
                return window + context[read:], len(window)
        window = self._context_window(context)  # invalid bytes, not a cut character
        return window, len(window)

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

    def _emit(self, upto_text: str, upto: int) -> str:
        """Emit `upto_text` (the decode of ids[:upto]) past the prefix; the window moves on."""
        delta = upto_text[len(self._prefix_text) :]
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
        if self._context_only:  # the prompt's broken character: none of this reply's text
            return ""
        new_text = self._decode(self._ids)
        delta = new_text[len(self._prefix_text) :]
        if delta:
            self._parts.append(delta)
        return delta
