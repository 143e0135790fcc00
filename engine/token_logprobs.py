"""Token log-probabilities: what a request with `SamplingParams.logprobs` set gets per token.

What they are: log_softmax of the step's logits as the model produced them (fp32, or the
model's float64 in tests), before temperature, top-k/top-p, a grammar's mask or any other
processing: the "raw" log-probabilities (vLLM's default, `logprobs_mode="raw_logprobs"`). They
describe the model, not the sampler: a token a grammar forced may have a low one, and a token
the mask banned may be among the top ones. The top entries are the k largest, sorted, most
likely first (`torch.topk`; ties in whatever order it gives).

Where they are computed: on the device, in `ModelRunner.sample_tokens`, from the logits it
built, for the rows that ask only: `raw_logprobs` before sampling (a gather of those rows, one
log_softmax, one topk), `attach` after it (a gather of the sampled ids). A step where no row
asks does none of it: no launch, no allocation, only a scan of the rows' params on the host
(the greedy decode step is latency-critical).

How they reach the host: never by a wait at sample time. The plain loop reads them where it
reads the tokens (`ModelRunner.run`, which waits for those anyway). Under overlap scheduling
`Overlap._sample` copies them into pinned host buffers (`HostStaging`, alternating like the
token buffers) before it records the event the tokens' copy is behind, and `Overlap._complete`
reads them once it has waited for that event. `entries` turns them into TokenLogprobs, which
`RequestOutcomes.accept` puts on the token's event and the request's output.

The prompt's log-probabilities (prompt_logprobs.py) use the same functions on the rows of a
prefill chunk (`asked_rows`, `gather_tokens` with ranks, `entries`).

Shapes: B rows sampled in the step, R of them asking, V vocab, K the largest k asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.engine.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from freetoken_agent.engine.layers.sampler import Sampled


@dataclass(slots=True)
class RawLogprobs:
    """The asking rows' log-probabilities, computed before sampling (on the device)."""

    rows: list[int]  # the asking rows among the B, ascending
    ks: list[int]  # each asking row's k (0: its token's logprob only)
    index: torch.Tensor | None  # [R] int64 on the device: `rows`; None when every row asks
    logp: torch.Tensor  # [R, V]
    top: tuple[torch.Tensor, torch.Tensor] | None  # ([R, K] values, [R, K] int64 ids); K = 0: None


@dataclass(slots=True)
class StepLogprobs:
    """One step's log-probabilities, on the device or (staged) on the host."""

    rows: list[int]  # the asking rows among the B, ascending
    ks: list[int]  # each asking row's k
    chosen: torch.Tensor  # [R]: the sampled token's (a prompt's: the token scored)
    top_values: torch.Tensor | None  # [R, K], descending
    top_ids: torch.Tensor | None  # [R, K] int64
    ranks: torch.Tensor | None = None  # [R] int64: the chosen tokens' ranks, when asked


def raw_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> RawLogprobs | None:
    """`logits` [B, V] as the model gave them; None (and nothing done) when no row asks. Run
    it before anything processes the logits: they must be the model's own."""
    return asked_rows([p.logprobs for p in params], logits)


def asked_rows(ks: list[int | None], logits: torch.Tensor) -> RawLogprobs | None:
    """`raw_logprobs` of the rows whose k is not None (`ks` [B]: each row's k); the prompt's
    log-probabilities (prompt_logprobs.py) ask with every row."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return None
    index = None
    if len(rows) < len(ks):  # the row indices through pinned memory (device_index.py)
        index = on_device(rows, torch.int64, logits.device)
        logits = logits.index_select(0, index)
    logp = torch.log_softmax(logits, dim=-1)  # [R, V]
    asked = [ks[i] for i in rows]
    k = min(max(asked), logits.shape[-1])
    top = logp.topk(k, dim=-1, sorted=True) if k else None
    return RawLogprobs(rows, asked, index, logp, None if top is None else (top.values, top.indices))


def gather_tokens(raw: RawLogprobs, tokens: torch.Tensor, ranked: bool = False) -> StepLogprobs:
    """The log-probabilities of `tokens` [B] (one a row, on the device) in `raw`; `ranked`:
    with each one's rank too, the count of tokens at least as likely ([R, V] compared: only
    the prompt's entries ask)."""
    if raw.index is not None:
        tokens = tokens.index_select(0, raw.index)
    picked = raw.logp.gather(1, tokens[:, None]).squeeze(1)  # [R]
    ranks = (raw.logp >= picked[:, None]).sum(-1) if ranked else None  # [R]
    values, ids = raw.top if raw.top is not None else (None, None)
    return StepLogprobs(raw.rows, raw.ks, picked, values, ids, ranks)


def attach(sampled: Sampled, raw: RawLogprobs | None) -> Sampled:
    """`sampled` with the log-probabilities of its tokens (itself when no row asked)."""
    if raw is None:
        return sampled
    return sampled._replace(logprobs=gather_tokens(raw, sampled.tokens))


class HostStaging:
    """Pinned host buffers for the overlapped loop's copies, two sets alternating as its token
    buffers do (a set is read before the step after next takes it back). Made on first use:
    an engine whose requests never ask allocates nothing. Off a CUDA device nothing is copied
    (`stage` returns the step's tensors: the CPU computed them in order already)."""

    def __init__(self, max_rows: int, pinned: bool) -> None:
        self.max_rows = max_rows
        self.pinned = pinned
        self._sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None, None]

    def stage(self, step: StepLogprobs | None, slot: int) -> StepLogprobs | None:
        """Enqueue the copy of `step` into set `slot` (non_blocking: valid once the caller's
        event, recorded after this, has completed); what `entries` reads then."""
        if step is None or not self.pinned:
            return step
        if self._sets[slot] is None:
            n = self.max_rows

            def pinned(size: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(size, dtype=dtype, pin_memory=True)

            top = n * MAX_LOGPROBS
            self._sets[slot] = (
                pinned(n, torch.float32),
                pinned(top, torch.float32),
                pinned(top, torch.int64),
            )
        chosen_h, values_flat, ids_flat = self._sets[slot]
        r = len(step.rows)
        # float32 on the host whatever the logits' dtype (a float64 model's: a no-op otherwise).
        chosen_h[:r].copy_(step.chosen, non_blocking=True)
        if step.top_values is None:
            return StepLogprobs(step.rows, step.ks, chosen_h[:r], None, None)
        k = step.top_values.shape[1]
        # Contiguous [r, k] views of flat buffers: a strided destination (a [:r, :k] slice of
        # an [n, 20] buffer) is copied through an unpinned temporary, a copy that waits for
        # the device (the queued step), which would undo the overlap.
        values_h = values_flat[: r * k].view(r, k)
        ids_h = ids_flat[: r * k].view(r, k)
        values_h.copy_(step.top_values, non_blocking=True)
        ids_h.copy_(step.top_ids, non_blocking=True)
        return StepLogprobs(step.rows, step.ks, chosen_h[:r], values_h, ids_h)


def entries(step: StepLogprobs | None, tokens: list[int]) -> list[TokenLogprob | None]:
    """Each of the B rows' TokenLogprob (None for a row that did not ask), `tokens` [B] being
    the step's reported tokens. Reads `step` on the host: a wait for the device unless the
    caller waited already (the plain loop's tokens, the overlapped loop's event)."""
    out: list[TokenLogprob | None] = [None] * len(tokens)
    if step is None:
        return out
    picked = step.chosen.tolist()
    values = step.top_values.tolist() if step.top_values is not None else None
    ids = step.top_ids.tolist() if step.top_ids is not None else None
    ranks = step.ranks.tolist() if step.ranks is not None else [None] * len(picked)
    for j, (row, k) in enumerate(zip(step.rows, step.ks, strict=True)):
        top = () if not k else tuple(zip(ids[j][:k], values[j][:k], strict=True))
        out[row] = TokenLogprob(tokens[row], picked[j], top, ranks[j])
    return out
