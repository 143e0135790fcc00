"""Choice i's sampling, for a request with several choices (OpenAI's `n`): the server's
(server/choices.py) and ChatFreeToken's (langchain_choices.py).

Each choice is an engine request of its own. With a seed, choice i is seeded seed + i, as vLLM
seeds the child requests it fans such a request out into: the choices differ, each is the
single request of its seed, and the whole comes back the same on every call. Unseeded choices
draw from the engine's generator, greedy ones are identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from freetoken_agent.engine.sampling_params import SEED_END, SamplingParams

# The most choices (`n`) one request may ask for. Each is an engine request of its own, running
# beside the others (vLLM sets no limit): a cap keeps one request from taking half the engine's
# batch (max_num_seqs, 32 by default) and its KV pool on its own.
MAX_CHOICES = 16


def choice_count(value: Any) -> int:
    """OpenAI's `n` (None: 1): an integer in [1, MAX_CHOICES]; ValueError otherwise."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {value!r:.40}")
    return value


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: the request's, seeded seed + index. Past the seeds torch
    takes ([-2**63, 2**64)) it wraps round to the negative ones."""
    if sampling.seed is None or index == 0:
        return sampling
    seed = sampling.seed + index
    return dataclasses.replace(sampling, seed=seed if seed < SEED_END else seed - 2**64)
