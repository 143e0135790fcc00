"""Prompt log-probabilities: what a request with `SamplingParams.prompt_logprobs` set gets for
its prompt (vLLM's `prompt_logprobs`; the legacy completions' `echo` with `logprobs`).

What they are: for each prompt token p >= 1, its log-probability under the model's raw
distribution at position p - 1 (log_softmax of that position's fp32 logits, nothing applied:
token_logprobs.py says what "raw" means), its rank there and the k most likely tokens. Token 0
has none (nothing precedes it): its entry is None, as vLLM's first one. The logits of the last
prompt position are the first generated token's (token_logprobs.py), not an entry here.

Where they are computed: on the device, in `ModelRunner.run`, for each prefill chunk of an
asking request, from the chunk's hidden rows at positions [start, min(end, P - 1)): the rows
that score a prompt token. The logits of a chunk are never held whole ([4096, 152k] fp32 is
2.5 GB, far past the step's workspace, which counts sampling logits for max_num_seqs rows):
at most LOGITS_SLICE_BYTES of them at a time, each slice's logits and log-probabilities freed
once its small results (a value, a rank, k ids and values a row) are taken. They are read on
the host in `run`, which waits for the step's tokens anyway; a chunk that samples nothing waits
for them there, a wait only such requests' steps pay. A prefill chunk has more than one token,
or samples, so it always runs in the plain loop (overlap.py overlaps decode steps only, where no
row scores a prompt token).

Where they are kept: `keep` writes a chunk's entries at their positions of
`Request.prompt_logprobs` (one slot a prompt token), so a preempted request, which computes
again from position 0, replaces them rather than adding them twice. Once the request's first
token is sampled the list is final: the first token's event carries a copy, and a re-prefill
after a later preemption does not compute them again (`scored_rows` is 0 then).

No prefix reuse: cached positions have no logits, so an asking request prefills its whole
prompt (Engine.submit turns its use_prefix_cache off, as vLLM does).

Shapes: T rows of a chunk that score a prompt token, S of them in a slice, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.engine.token_logprobs import StepLogprobs, asked_rows, entries, gather_tokens

if TYPE_CHECKING:
    from freetoken_agent.engine.models.base import MoeCausalLM
    from freetoken_agent.engine.request import Request, ScheduledChunk

# fp32 logits computed at once: with the log-probabilities beside them and the bf16 logits they
# came from, a slice peaks near 2.75x this (~350 MB), within the step's per-token activations,
# which are free once the forward pass is done.
LOGITS_SLICE_BYTES = 128 << 20


@dataclass(slots=True)
class PromptEntries:
    """One chunk's prompt entries: those of prompt tokens [first, first + len(entries))."""

    first: int
    entries: list[TokenLogprob]


def scored_rows(chunk: ScheduledChunk) -> int:
    """How many of the chunk's rows score a prompt token (its first ones): positions below
    P - 1 of a request that asks and has not sampled its first token yet."""
    req = chunk.request
    if req.prompt_logprobs is None or req.output_ids:
        return 0
    end = min(chunk.start + len(chunk.token_ids), len(req.prompt_ids) - 1)
    return max(0, end - chunk.start)


@torch.inference_mode()
def chunk_entries(model: MoeCausalLM, hidden: torch.Tensor, chunk: ScheduledChunk) -> PromptEntries:
    """The entries of the prompt tokens the chunk's first rows score; `hidden` [T, H] are those
    rows (T = `scored_rows(chunk)`)."""
    req, start, n = chunk.request, chunk.start, hidden.shape[0]
    k = req.sampling.prompt_logprobs
    targets = req.prompt_ids[start + 1 : start + 1 + n]  # row i scores the token after it
    on = on_device(targets, torch.int64, hidden.device)  # [T]
    rows = max(1, LOGITS_SLICE_BYTES // (4 * model.spec.vocab_size))
    steps: list[StepLogprobs] = []
    for lo in range(0, n, rows):
        logits = model.compute_logits(hidden[lo : lo + rows])  # [S, V]
        raw = asked_rows([k] * logits.shape[0], logits)
        steps.append(gather_tokens(raw, on[lo : lo + rows], ranked=True))
        del logits, raw  # the next slice reuses their memory
    found: list[TokenLogprob] = []
    for lo, step in zip(range(0, n, rows), steps, strict=True):
        found += entries(step, targets[lo : lo + rows])
    return PromptEntries(start + 1, found)


def keep(req: Request, found: PromptEntries) -> None:
    """Write a chunk's entries at their prompt positions (replacing those of an earlier pass)."""
    end = found.first + len(found.entries)
    assert end <= len(req.prompt_logprobs), f"request {req.id}: entries past its prompt"
    req.prompt_logprobs[found.first : end] = found.entries
