"""Logits processors: what a request's own bias and history do to its logits before sampling.

Per row, in this order (as vLLM applies them): `logit_bias` is added; the repetition penalty
(HF, vLLM) divides the positive logits of the tokens in the prompt or generated so far by it and
multiplies their negative ones; the frequency and presence penalties (OpenAI) subtract
frequency * count[t] + presence * (count[t] > 0), counting the generated tokens only; last,
while fewer than `min_tokens` tokens were sampled (vLLM's), the ids that would end the request
(EOS unless ignore_eos, stop_token_ids while stops apply: `SamplingParams.end_ids`) are set to
-inf. The constraint mask and the sampler (temperature, min_p, top-k, top-p) come after
(runner.sample_tokens, layers/sampler.py).

min_tokens counts the tokens sampled before this one (`Request.num_sampled`, counted at the
draw), not the host's accepted ones, for the reason the penalties count on the device: under
overlap a drawn token may not be accepted yet. A grammar that allows nothing but an end id
(its output is complete but it did not stop by itself) wins over min_tokens: the end is not held
back for that row, and the request ends short of min_tokens. Holding it would leave the row
nothing to sample (reported as non-finite logits, a failure of a valid request), and breaking
the grammar would give output it does not accept. The check reads the row's packed mask on the
host (O(W)), only for constrained rows still short of min_tokens.

Why the counts live on the device. A penalised request holds a `TokenHistory` (on its
Request), built when it first samples, from its prompt and output ids; each step's sampled
tokens are added to it on the device right after the draw (`count_sampled`), from the sampled
tensor itself, with no wait for the host and no per-step copy of counts built on the host
(O(V) per row). Nor does it depend on when the host reads a token: under overlap scheduling
(overlap.py) step N's token is accepted on the host only after step N+1 is launched (today just
before N+1 samples), and counts taken from the host's output ids would silently go wrong if
sampling ever ran ahead of that accept (as it would inside a captured graph). Invariant: it
counts the request's output ids plus its token in flight, if one is. It holds at the build (a
request samples for the first time with nothing of it in flight) and through preemption, which
it survives: a request is preempted only with no step in flight (the overlapped loop drains
before any step that may preempt), and its re-prefill samples the next token, not again the
ones it recomputes. A token sampled for a request that its previous token just finished
(overlap's dropped row) is neither processed nor counted: its history is gone
(`RequestOutcomes.finish`) and the token is never used.

Cost. Rows asking for nothing are untouched, and a batch where none asks costs one Python pass
over its requests, no launch. A penalised batch adds about ten launches over its P rows ([P, V]
each), one more per biased row and one count update per penalised row; each penalised request
holds 4V bytes of counts (and V more with a repetition penalty) until it finishes. A row whose
end is held back adds one launch, until its min_tokens-th token is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from freetoken_agent.engine.constrained import allows, allows_only
from freetoken_agent.engine.device_index import on_device
from freetoken_agent.engine.outputs import LogitBiasError
from freetoken_agent.engine.request import Request, Status
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.engine.thinking_budget import (
    DONE,
    BudgetState,
    ThinkingMarkers,
    budget_state,
    forced_token,
)

# B rows that sample this step, P of them penalised, V vocab, n biased ids of one request,
# e ids that end it, W = ceil(V / 32) words of a packed grammar mask


@dataclass(slots=True)
class TokenHistory:
    """One request's processor state on the device, in the logits' dtype."""

    generated: torch.Tensor | None  # [V] counts of the generated tokens (None: no penalty)
    in_prompt: torch.Tensor | None  # [V] bool, the prompt's tokens (None: no repetition penalty)
    bias_ids: torch.Tensor | None  # [n] int64 (None: no logit_bias)
    bias_values: torch.Tensor | None  # [n]
    one: torch.Tensor  # [1] 1, what a sampled token adds to its count
    # [e] int64: the ids min_tokens holds back (None: no min_tokens, or no such id in the
    # vocabulary), and the same ids on the host for the grammar's check.
    end_ids: torch.Tensor | None = None
    end_list: tuple[int, ...] = ()
    budget: BudgetState | None = None  # the thinking budget's state (thinking_budget.py)


def check_logit_bias(sampling: SamplingParams, vocab: int) -> None:
    """Refuse a logit_bias naming an id outside the vocabulary when the engine takes the
    request: inside a step, its index_add would fail the whole batch."""
    outside = sorted(t for t in sampling.logit_bias or () if t >= vocab)
    if outside:
        raise LogitBiasError(
            f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})"
        )


def history_of(
    req: Request,
    vocab: int,
    dtype: torch.dtype,
    device: torch.device,
    eos_token_ids: frozenset[int] = frozenset(),
    thinking: ThinkingMarkers | None = None,
) -> TokenHistory:
    """`req`'s history, built on its first call from its prompt and output ids (see the module
    docstring for why those hold every token it sampled)."""
    if req.token_history is not None:
        return req.token_history
    sp = req.sampling
    one = torch.ones(1, dtype=dtype, device=device)
    generated = in_prompt = bias_ids = bias_values = None
    if sp.penalised:
        generated = torch.zeros(vocab, dtype=dtype, device=device)
        if req.output_ids:
            out = on_device(req.output_ids, torch.int64, device)
            generated.index_add_(0, out, one.expand(len(req.output_ids)))
    if sp.repetition_penalty != 1:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_prompt.index_fill_(0, on_device(req.prompt_ids, torch.int64, device), True)
    if sp.logit_bias:
        bias_ids = on_device(list(sp.logit_bias), torch.int64, device)
        bias_values = on_device([float(v) for v in sp.logit_bias.values()], dtype, device)
    history = TokenHistory(generated, in_prompt, bias_ids, bias_values, one)
    if sp.min_tokens > 0:
        # A stop id past the vocabulary is never sampled, and its index would fail the step.
        history.end_list = tuple(t for t in sp.end_ids(eos_token_ids) if t < vocab)
        if history.end_list:
            history.end_ids = on_device(list(history.end_list), torch.int64, device)
    if sp.thinking_token_budget is not None and thinking is not None:
        history.budget = budget_state(req, thinking)
    req.token_history = history
    return history


def apply_processors(
    logits: torch.Tensor,  # [B, V], changed in place
    reqs: list[Request],
    eos_token_ids: frozenset[int] = frozenset(),
    masks: Mapping[str, np.ndarray] | None = None,
    thinking: ThinkingMarkers | None = None,
) -> list[tuple[int, TokenHistory]]:
    """Apply each row's bias and penalties to `logits`, hold back the end of the rows short
    of their min_tokens (the model's `eos_token_ids`; `masks`: the constrained rows' packed
    grammar masks, [W] int32 by request id, which win over min_tokens), and force the close of
    the think blocks whose budget is spent (`thinking`: the model's markers); returns the
    penalised rows and their histories, whose counts `count_sampled` updates after the draw.
    Nothing happens (no launch) when no row asks."""
    # A finished request's row (overlap's dropped row) is never used: left as it is.
    rows = [
        i
        for i, r in enumerate(reqs)
        if r.sampling.processes_logits and r.status is not Status.FINISHED
    ]
    if not rows:
        return []
    vocab, dtype, device = logits.shape[-1], logits.dtype, logits.device
    histories = [history_of(reqs[i], vocab, dtype, device, eos_token_ids, thinking) for i in rows]
    for i, h in zip(rows, histories, strict=True):
        if h.bias_ids is not None:
            logits[i].index_add_(0, h.bias_ids, h.bias_values)
    penalised = [(i, h) for i, h in zip(rows, histories, strict=True) if h.generated is not None]
    if penalised:
        _penalise(logits, [reqs[i].sampling for i, _ in penalised], penalised)
    for i, h in zip(rows, histories, strict=True):
        if h.end_ids is not None and _holds_end(reqs[i], h, masks or {}):
            logits[i].index_fill_(0, h.end_ids, float("-inf"))
        if h.budget is not None and h.budget.state != DONE:
            _force_close(logits[i], reqs[i], h.budget, thinking, (masks or {}).get(reqs[i].id))
    return penalised


def _force_close(
    row: torch.Tensor,  # [V]
    req: Request,
    state: BudgetState,
    thinking: ThinkingMarkers,
    mask: np.ndarray | None,
) -> None:
    """The budget's forced token, if this step has one: every other logit -inf. A grammar
    that does not allow it wins: the close waits, or the budget is dropped (thinking_budget.py)."""
    token = forced_token(req, state, thinking)
    if token is None:
        return
    if mask is not None and not allows(mask, token):
        state.refused(len(req.output_ids))
        return
    row.fill_(float("-inf"))  # the sampled log-probabilities are the raw logits': unchanged
    row[token] = 0.0


def _holds_end(req: Request, h: TokenHistory, masks: Mapping[str, np.ndarray]) -> bool:
    """Whether `req`'s end is held back this step: fewer than min_tokens tokens were sampled
    before this one, and its grammar, if any, allows some id besides the end ones."""
    if req.num_sampled >= req.sampling.min_tokens:
        return False
    mask = masks.get(req.id)
    return mask is None or not allows_only(mask, h.end_list)


def _penalise(logits: torch.Tensor, params: list, rows: list[tuple[int, TokenHistory]]) -> None:
    """The penalties of the P penalised rows, as one [P, V] block. A row's penalty it does not
    ask for is an exact no-op (x / 1, x * 1, x - 0 * count)."""
    device, dtype = logits.device, logits.dtype
    index = on_device([i for i, _ in rows], torch.int64, device)  # [P]
    counts = torch.stack([h.generated for _, h in rows])  # [P, V]
    generated = counts > 0  # [P, V]
    block = logits.index_select(0, index)  # [P, V]
    if any(p.repetition_penalty != 1 for p in params):
        no_prompt = None  # rows without a repetition penalty: no prompt tokens to mark
        prompts = []
        for _, h in rows:
            if h.in_prompt is None and no_prompt is None:
                no_prompt = torch.zeros_like(generated[0])
            prompts.append(h.in_prompt if h.in_prompt is not None else no_prompt)
        seen = generated | torch.stack(prompts)  # [P, V]
        rep = on_device([p.repetition_penalty for p in params], dtype, device)[:, None]  # [P, 1]
        repeated = torch.where(block > 0, block / rep, block * rep)
        block = torch.where(seen, repeated, block)
    freq_pres = [[p.frequency_penalty, p.presence_penalty] for p in params]
    coef = on_device(freq_pres, dtype, device)  # [P, 2]
    block = block - coef[:, 0:1] * counts - coef[:, 1:2] * generated
    logits.index_copy_(0, index, block)


def count_sampled(
    penalised: list[tuple[int, TokenHistory]],
    tokens: torch.Tensor,  # [B] int64 on the device, the rows' sampled tokens
) -> None:
    """Add each penalised row's sampled token to its request's counts, on the device, from the
    sampled tensor (no host wait, no copy)."""
    for i, h in penalised:
        h.generated.index_add_(0, tokens[i : i + 1], h.one)
