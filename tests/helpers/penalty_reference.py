"""The logits processors written out plainly in numpy (float64), for the engine-level tests on
the CPU and on CUDA: what logit_bias and the penalties make of one row of logits, and greedy
decoding that scores the growing sequence from scratch and applies them."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from freetoken_agent import SamplingParams

Scorer = Callable[[list[int]], np.ndarray]  # token ids -> logits [T, V] at every position


def processed(
    row: np.ndarray, prompt: Sequence[int], output: Sequence[int], sp: SamplingParams
) -> np.ndarray:
    """One row [V] after logit_bias (added), the repetition penalty over the prompt and the
    output, then the frequency and presence penalties over the output alone."""
    row = np.array(row, dtype=np.float64)
    for token, bias in (sp.logit_bias or {}).items():
        row[token] += bias
    rep = sp.repetition_penalty
    for token in set(prompt) | set(output):
        row[token] = row[token] / rep if row[token] > 0 else row[token] * rep
    for token, count in Counter(output).items():
        row[token] -= sp.presence_penalty + sp.frequency_penalty * count
    return row


def reference_greedy(score: Scorer, prompt: list[int], sp: SamplingParams, n: int) -> list[int]:
    """n tokens of greedy decoding with `sp`'s processors, each from a fresh scoring."""
    out: list[int] = []
    for _ in range(n):
        last = score(prompt + out)[-1]
        out.append(int(np.argmax(processed(last, prompt, out, sp))))
    return out


def worst_choice_gap(
    score: Scorer, prompt: list[int], sp: SamplingParams, tokens: list[int]
) -> float:
    """Along the engine's own tokens (teacher forcing), the largest amount by which a chosen
    token's processed logit falls short of its row's largest: 0 when each is an argmax. For
    devices whose decode and scoring logits differ by float noise."""
    logits = score(prompt + tokens[:-1])  # [T, V]: row len(prompt) - 1 + k picks token k
    worst = 0.0
    for k, token in enumerate(tokens):
        row = processed(logits[len(prompt) - 1 + k], prompt, tokens[:k], sp)
        worst = max(worst, float(row.max() - row[token]))
    return worst


def random_penalties(rng: random.Random, vocab: int, **fixed) -> SamplingParams:
    """SamplingParams with strong random penalties (each present or not, at least one) and
    sometimes a logit_bias, so that they change what a tiny model writes; greedy unless
    `fixed` (other fields, which win) says otherwise."""
    options: dict = {}
    while (
        not options.get("presence_penalty")
        and not options.get("frequency_penalty")
        and (options.get("repetition_penalty", 1) == 1)
    ):
        if rng.random() < 0.6:
            options["presence_penalty"] = rng.choice([-1, 1]) * rng.uniform(0.5, 2)
        if rng.random() < 0.6:
            options["frequency_penalty"] = rng.choice([-1, 1]) * rng.uniform(0.3, 2)
        if rng.random() < 0.6:
            options["repetition_penalty"] = rng.choice([rng.uniform(1.2, 2), rng.uniform(0.5, 0.8)])
    if rng.random() < 0.5:
        options["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(4)}
    return SamplingParams(**{"temperature": 0, "ignore_eos": True, **options, **fixed})
