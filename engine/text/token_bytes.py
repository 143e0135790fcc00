"""TokenBytes: the bytes one token stands for, read from the tokenizer's own decoder spec.

A token decoded alone is not its bytes: a byte-level BPE token holding part of a multi-byte
character decodes to U+FFFD, and a SentencePiece decoder strips the word-start space of a
text's first token (`Strip(" ", 1, 0)`), so " the" decodes alone as "the". OpenAI's logprobs
give each token's real UTF-8 bytes so that a client can join characters split across tokens
(and the token strings then join to the text). This maps a token id to those bytes:

- added tokens (special or not): their content, through the decoder's steps below as the
  tokenizer's own decode takes them (a SentencePiece "▁<EOT>" reads " <EOT>");
- a ByteLevel decoder (GPT-2, Qwen, Llama 3): the vocabulary piece through the inverse of
  GPT-2's bytes-to-unicode table;
- SentencePiece decoders (a Sequence of Replace, ByteFallback, Fuse, Strip; or Metaspace):
  `<0xHH>` pieces are that byte, other pieces have their Replace steps applied (the "▁"
  word-start mark becomes a space), Strip left out (it acts on a whole text's ends only);
- anything else: the token decoded alone, as before.
"""

from __future__ import annotations

import json
import re

import tokenizers

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: the printable character each byte is written
    as in a ByteLevel vocabulary (printable Latin-1 bytes as themselves, the other 68 shifted
    past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


class TokenBytes:
    """token id -> its bytes (see the module docstring), cached per id."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        is_sequence = decoder.get("type") == "Sequence"
        steps = decoder.get("decoders", []) if is_sequence else [decoder]
        kinds = {step.get("type") for step in steps}
        self._byte_level = _unicode_to_byte() if "ByteLevel" in kinds else None
        self._replaces: list[tuple[str, str]] = []
        for step in steps:
            if step.get("type") == "Replace" and "String" in (step.get("pattern") or {}):
                self._replaces.append((step["pattern"]["String"], step.get("content", "")))
            elif step.get("type") == "Metaspace":
                self._replaces.append((step.get("replacement", "\u2581"), " "))
        self._pieces = bool({"ByteFallback", "Metaspace"} & kinds) or bool(self._replaces)

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        piece = added if added is not None else self._backend.id_to_token(token_id)
        if piece is not None and self._byte_level is not None:
            if all(c in self._byte_level for c in piece):
                return bytes(self._byte_level[c] for c in piece)
            if added is not None:  # characters outside the byte table: as written
                return added.encode("utf-8")
        elif piece is not None and self._pieces:
            byte = _BYTE_PIECE.fullmatch(piece) if added is None else None
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            for pattern, content in self._replaces:
                piece = piece.replace(pattern, content)
            return piece.encode("utf-8", "replace")
        elif added is not None:
            return added.encode("utf-8")
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
