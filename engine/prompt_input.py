"""A request's prompt and anchors checked and turned into token ids, before anything runs: bad
input raises InvalidRequestError (or ContextLengthError) naming the problem, so it can never
disturb other requests."""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence

import torch

from freetoken_agent.engine.outputs import ContextLengthError, InvalidRequestError, shown_number
from freetoken_agent.engine.request import Recurrence

# A surrogate code point in a str (surrogateescape'd bytes, a lone JSON escape) is no Unicode
# text: the tokenizer cannot encode it (a TypeError deep inside, not a refusal naming it).
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

Prompt = str | Sequence[int]


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def context_length_error(n: int, max_model_len: int) -> ContextLengthError:
    """The refusal of a prompt of `n` tokens that does not fit a context of `max_model_len`
    (prompt + output: at least one output token must fit). One wording for every layer that
    checks it: the engine, and a chat rendering checked before its anchors are located."""
    error = ContextLengthError(
        f"the prompt has {n} tokens; this engine's context holds "
        f"{max_model_len} tokens (prompt + output), so at most "
        f"{max_model_len - 1} prompt tokens fit"
    )
    error.prompt_tokens, error.max_prompt_tokens = n, max_model_len - 1
    return error


def token_ids(values, what: str, max_len: int | None = None) -> list[int]:
    """`values` as a list of ints, each an integer already: a float or a bool (which int() would
    turn into 5 or 1) is refused, naming it, rather than silently truncated. With `max_len` (a
    context length), a list that cannot fit it is refused before any per-item work: Engine.submit
    runs this under the service's lock, where scanning a million items stalls every stream."""
    try:
        items = list(values)
    except TypeError as e:
        raise InvalidRequestError(f"{what}: {e}") from e
    if max_len is not None and len(items) >= max_len:
        raise context_length_error(len(items), max_len)
    if all(type(v) is int for v in items):  # the usual list of ints (no bool), ~10x faster
        return items
    for i, v in enumerate(items):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and _integer_dtype(v.dtype):
            items[i] = v = v.item()  # one id as a 0-d tensor (a 1-D tensor's items)
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise InvalidRequestError(f"{what}: item {i} is {v!r:.40} ({type(v).__name__})")
    return [int(v) for v in items]


def encode_prompt(prompt: Prompt, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """Token ids of `prompt` (a string, a list of ids or a tensor of ids).

    The length is checked before anything that costs per token (the vocabulary scan, a list's
    type checks, a tensor's conversion): Engine.submit runs under the service's lock, so an
    over-long prompt must be refused in time proportional to the context, not to its size."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model folder has no tokenizer: pass token ids")
        if (lone := LONE_SURROGATE.search(prompt)) is not None:  # no text: encoding fails
            raise InvalidRequestError(
                f"the prompt holds a lone UTF-16 surrogate {lone.group()!r} at character "
                f"{lone.start()} (text decoded from bytes that were not UTF-8?)"
            )
        # With the model's own specials (a Llama/Mistral bos), as transformers, vLLM and
        # llama.cpp encode a raw prompt: those models were trained with it at the start.
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, torch.Tensor):
        if not _integer_dtype(prompt.dtype):
            raise InvalidRequestError(f"token ids are integers: got a {prompt.dtype} tensor")
        if prompt.dim() > 1:  # flattening [B, T] would run B prompts as one
            raise InvalidRequestError(
                f"a prompt tensor holds one prompt's ids (1-D), got shape {tuple(prompt.shape)}"
            )
        if prompt.numel() >= max_model_len:
            raise context_length_error(prompt.numel(), max_model_len)
        ids = prompt.tolist() if prompt.dim() else [prompt.item()]
    else:
        ids = token_ids(prompt, "a prompt is a string or a list of token ids", max_model_len)
    if len(ids) >= max_model_len:
        raise context_length_error(len(ids), max_model_len)
    if not ids:
        raise InvalidRequestError("the prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {shown_number(bad[0])} is outside the vocabulary [0, {vocab_size})"
            + (f" ({len(bad)} such ids)" if len(bad) > 1 else "")
        )
    return ids


def snapshot_plan(
    ids: list[int], anchors: Sequence[int], recurrence: Recurrence | None
) -> list[int]:
    """The prompt boundaries where a hybrid model's prefill checkpoints its recurrent state
    (the anchors, as the checkpoint mode places them); none for attention-only models."""
    marks = token_ids(anchors, "anchors are token offsets (ints)")
    bad = [a for a in marks if not 0 <= a <= len(ids)]
    if bad:
        raise InvalidRequestError(
            f"anchor {bad[0]} lies outside the prompt's {len(ids)} tokens (0..{len(ids)})"
        )
    return recurrence.mode.prompt_boundaries(len(ids), marks) if recurrence is not None else []
