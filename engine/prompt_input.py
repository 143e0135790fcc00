"""A request's prompt and anchors checked and turned into token ids, before anything runs: bad
input raises InvalidRequestError (or ContextLengthError) naming the problem, so it can never
disturb other requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freetoken_agent.engine.outputs import ContextLengthError, InvalidRequestError
from freetoken_agent.engine.request import Recurrence

Prompt = str | Sequence[int]


def encode_prompt(prompt: Prompt, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """Token ids of `prompt` (a string, a list of ids or a tensor of ids)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model folder has no tokenizer: pass token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, torch.Tensor):
        ids = [int(t) for t in prompt.reshape(-1).tolist()]
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"a prompt is a string or a list of token ids: {e}") from e
    if not ids:
        raise InvalidRequestError("the prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            + (f" ({len(bad)} such ids)" if len(bad) > 1 else "")
        )
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens; this engine's context holds "
            f"{max_model_len} tokens (prompt + output), so at most "
            f"{max_model_len - 1} prompt tokens fit"
        )
    return ids


def snapshot_plan(
    ids: list[int], anchors: Sequence[int], recurrence: Recurrence | None
) -> list[int]:
    """The prompt boundaries where a hybrid model's prefill checkpoints its recurrent state
    (the anchors, as the checkpoint mode places them); none for attention-only models."""
    try:
        marks = [int(a) for a in anchors]
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"anchors are token offsets (ints): {e}") from e
    bad = [a for a in marks if not 0 <= a <= len(ids)]
    if bad:
        raise InvalidRequestError(
            f"anchor {bad[0]} lies outside the prompt's {len(ids)} tokens (0..{len(ids)})"
        )
    return recurrence.mode.prompt_boundaries(len(ids), marks) if recurrence is not None else []
