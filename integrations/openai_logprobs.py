"""Token log-probabilities in OpenAI's shapes, for the server's routes and ChatFreeToken.

The engine reports one TokenLogprob per generated token (engine/outputs.py: the model's raw
log-probabilities, before temperature or any other processing). Written out here:

chat      {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
          "bytes"}, ...]}, ...], "refusal": None}: `choices[0].logprobs` of a chat completion,
          and ChatFreeToken's `response_metadata["logprobs"]` (where ChatOpenAI puts it)
text      {"tokens", "token_logprobs", "top_logprobs": [{token: logprob, ...} | None, ...],
          "text_offset"}: the legacy completions' form (`top_logprobs` None for a token when
          none were asked; ids that decode alike share one key there, holding the larger).
          With `echo` the prompt's tokens come first, the first of them with null
          token_logprobs and top_logprobs (nothing precedes it: an `UnscoredToken`)
prompt    vLLM's `prompt_logprobs`: [None, {"<token id>": {"logprob", "rank",
          "decoded_token"}, ...}, ...], one per prompt token, each holding the prompt token
          and the k most likely at its position (`PromptLogprobs`)

A token's `bytes` are the bytes it stands for (engine/text/token_bytes.py: the vocabulary
piece read through the tokenizer's decoder, special tokens as their text, an EOS as
"<|im_end|>"), as OpenAI gives them: a client joins the bytes of a character split across
tokens. Its string is those bytes decoded, so a token holding part of a multi-byte character
reads U+FFFD (as in vLLM) while its bytes are the real ones (vLLM sends U+FFFD's), and a
SentencePiece token keeps its word-start space (decoded alone, the decoder strips it), so the
strings of a reply's tokens join to its text. Without a tokenizer a token's string is
"token_id:N" (vLLM's spelling of the same) and its bytes that string's.

Lining up: one entry per token the engine accepted, in order, whatever text it made: a token
whose text was held back (a partial character, a possible stop string's start) has its entry
where it came; an EOS or a stop id has one though it adds no text; so do the tokens a stop
string cut from the text. A stream sends each token's entry with the first chunk that goes
out at or after it (`Pending`), so a chunk's entries are the tokens accepted since the chunk
before: text held back, a tool call that goes out whole, the tokens after the last text go
with the chunk that carries their text or with the last chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.engine.sampling_params import MAX_LOGPROBS, SamplingParamsError


class TokenStrings:
    """token id -> its string and its bytes (see the module docstring), cached: the same ids
    come back."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def _table(self) -> Any | None:
        # The engine's Tokenizer builds its TokenBytes once, when a token is first asked for
        # (every request makes a TokenStrings; few ask for logprobs).
        return getattr(self.tokenizer, "token_bytes", None)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            table = self._table()
            if table is not None:
                text = table(token_id).decode("utf-8", "replace")
            elif self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def bytes_of(self, token_id: int) -> bytes:
        table = self._table()
        return table(token_id) if table is not None else self(token_id).encode("utf-8")


def _chat_item(strings: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    token, data = strings(token_id), list(strings.bytes_of(token_id))
    return {"token": token, "logprob": logprob, "bytes": data}


def chat_entry(entry: TokenLogprob, strings: TokenStrings) -> dict[str, Any]:
    """One token's entry of a chat `logprobs.content`."""
    item = _chat_item(strings, entry.token_id, entry.logprob)
    item["top_logprobs"] = [_chat_item(strings, t, lp) for t, lp in entry.top]
    return item


def chat_logprobs(entries: Iterable[TokenLogprob], strings: TokenStrings) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` object."""
    return {"content": [chat_entry(e, strings) for e in entries], "refusal": None}


@dataclasses.dataclass(slots=True, frozen=True)
class UnscoredToken:
    """A token without a log-probability: an echoed prompt's first (no position precedes it)."""

    token_id: int


def with_top(entry: TokenLogprob, k: int) -> TokenLogprob:
    """`entry` with its k most likely only (the engine computed them for the largest k that
    one request's fields ask: echo's logprobs and vLLM's prompt_logprobs may differ)."""
    return entry if len(entry.top) <= k else dataclasses.replace(entry, top=entry.top[:k])


class PromptLogprobs:
    """vLLM's `prompt_logprobs` of one request (k alternatives a token), from the engine's
    prompt entries (TokenEvent.prompt_logprobs). Each position's dict holds the prompt token
    first, with its rank, then the k most likely with theirs (1..k): a token among both keeps
    its place and takes its top-k entry, as vLLM's dict is built. Keys are token ids written
    as strings (JSON's object keys)."""

    def __init__(self, strings: TokenStrings, k: int) -> None:
        self.strings = strings
        self.k = k

    def _item(self, logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.strings(token_id)}

    def write(self, entries: Sequence[TokenLogprob | None] | None) -> list[dict | None] | None:
        if entries is None:  # the request ended before its prompt was computed
            return None
        out: list[dict | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            position = {str(e.token_id): self._item(e.logprob, e.rank, e.token_id)}
            for rank, (t, lp) in enumerate(e.top[: self.k], start=1):
                position[str(t)] = self._item(lp, rank, t)
            out.append(position)
        return out


class TextLogprobs:
    """The legacy completions' `logprobs` objects of one completion, whole or chunk by chunk.
    `text_offset`: each token's offset in the completion's text, the characters the tokens
    before it released (a token whose text is held back, a character split across tokens or
    a stop string's prefix, points where its text begins; vLLM sums the tokens' lone decodes,
    which drift from the text at the first such token). `top`: whether alternatives were asked
    (logprobs > 0); then each token's `top_logprobs` holds the k most likely and the sampled
    token, as OpenAI's "up to logprobs + 1" entries; without, it is None."""

    def __init__(self, strings: TokenStrings, top: bool) -> None:
        self.strings = strings
        self.top = top

    def block(self, entries: Iterable[tuple[TokenLogprob | UnscoredToken, int]]) -> dict[str, Any]:
        """`entries`: each token's (TokenLogprob, text offset); an UnscoredToken's values are
        null (OpenAI's first echoed prompt token)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}  # fmt: skip
        for e, offset in entries:
            token = self.strings(e.token_id)
            out["tokens"].append(token)
            out["text_offset"].append(offset)
            scored = not isinstance(e, UnscoredToken)
            out["token_logprobs"].append(e.logprob if scored else None)
            tops = None
            if self.top and scored:
                tops = {}
                for t, lp in e.top:  # most likely first: a string met again keeps its first
                    tops.setdefault(self.strings(t), lp)
                tops.setdefault(token, e.logprob)
            out["top_logprobs"].append(tops)
        return out


class Pending:
    """A stream's entries not sent yet: `add` as they come, `take` for the next chunk."""

    def __init__(self) -> None:
        self._held: list[TokenLogprob] = []

    def add(self, entry: TokenLogprob) -> None:
        self._held.append(entry)

    def take(self) -> list[TokenLogprob]:
        held, self._held = self._held, []
        return held


def logprob_count(value: Any, field: str) -> int | None:
    """A count of alternatives (`top_logprobs`, the legacy completions' `logprobs`): None or
    an integer in [0, MAX_LOGPROBS]; SamplingParamsError naming `field` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        text = f"{field} must be an integer in [0, {MAX_LOGPROBS}], got {value!r:.40}"
        raise SamplingParamsError([(field, text)])
    return value


def chat_logprobs_setting(asked: Any, top: Any) -> int | None:
    """SamplingParams.logprobs from the chat API's `logprobs` (a bool) and `top_logprobs`
    (alternatives a token; above 0 only with logprobs true, as OpenAI takes them; 0 or null
    alone ask for nothing): None when not asked. The server's bodies and ChatFreeToken's
    options alike; SamplingParamsError naming the field at fault."""
    if asked is not None and not isinstance(asked, bool):
        raise SamplingParamsError(
            [("logprobs", f"logprobs must be true or false, got {asked!r:.40}")]
        )
    count = logprob_count(top, "top_logprobs")
    if count and not asked:
        text = (
            f"top_logprobs={count} needs logprobs: true (it asks for the alternatives of each "
            "token's log-probability)"
        )
        raise SamplingParamsError([("top_logprobs", text)])
    return (count or 0) if asked else None
