"""Turns the last-position logits of each sampling sequence into one token each.

Greedy rows (temperature ~0, or top_k 1) take the argmax, the lowest id on an exact tie (so
top_k 1 does not share a tie as larger k do). The others are scaled by temperature, cut by
top-k then top-p, and drawn with the exponential-race trick (argmax of p / Exp(1) noise,
equivalent to a multinomial draw) so that a seeded request draws its noise from its own
generator: its tokens do not depend on which other requests share the batch. Top-k keeps the
ties at its k-th largest, top-p those at its nucleus's smallest: each row keeps the logits at
or above one threshold.

On CUDA the whole of it is one Triton launch (kernels/triton/sampling.py: torch's ops were
50-100 launches and 0.9-1.7 ms of host time a step), the noise from a Philox stream seeded per
row and step from the request's generator; on the CPU torch's ops below, the same semantics.

`allowed` (constrained decoding, see engine/constrained.py) bans tokens per row before anything
else, so greedy and sampled rows alike pick only allowed ids; rows left all True are untouched.
The logits come here already processed (logit_bias and penalties: engine/logits_processors.py).

`min_p` (vLLM's) keeps, after temperature, the tokens whose probability is at least min_p times
the row's largest: logit >= rowmax + T * ln(min_p), rowmax over the row's allowed tokens. It is a
mask over the logits in torch, before the draw on both devices (the kernel is left as it is);
greedy rows skip it (their argmax always passes), and a batch without it pays nothing.

A row whose logits are not finite where it may pick (a NaN or +inf among its allowed logits, or
no finite allowed logit at all: fp16 overflow, broken weights, a kernel fault) has no token to
draw. Its token is still some valid id, because under overlap scheduling the device feeds it to
the next step before the host reads it; beside it the row is reported as NOT_FINITE, which the
engine turns into an error for that request alone. The check reads the row's largest allowed
logit, which NaN and +inf reach, so it costs the greedy path three small launches over [B]
values (`max` gives the argmax and that value in one pass; a subtraction, a compare and a fill)
and the kernel path nothing extra.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from freetoken_agent.engine.token_logprobs import StepLogprobs

F32 = torch.float32
NOT_FINITE = -1  # a reported token: the row's logits were not finite (see the module docstring)

# B sequences that sample this step, V vocab


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [B] int64, valid ids: what the next step may be fed
    reported: torch.Tensor  # [B] int64: tokens, NOT_FINITE where a row could not be sampled
    # The asking rows' log-probabilities (engine/token_logprobs.py: the runner attaches them);
    # None when no row asks.
    logprobs: StepLogprobs | None = None


def sample(
    logits: torch.Tensor,  # [B, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    allowed: torch.Tensor | None = None,  # [B, V] bool; None = no constraint on any row
) -> Sampled:
    """`generators` are CPU generators (None: torch's default). Never waits for the device."""
    if allowed is None and all(p.greedy for p in params):
        largest, tokens = logits.max(dim=-1)  # NaN and +inf propagate to the row's max
        return Sampled(tokens, _reported(tokens, largest))
    if not logits.is_cuda and allowed is not None:  # masked once, for the draw and the check
        logits, allowed = logits.masked_fill(~allowed, float("-inf")), None
    logits = cut_below_min_p(logits, params, allowed)
    if logits.is_cuda:
        return _sample_on_device(logits, params, generators, allowed)
    tokens = sample_with_torch(logits, params, generators)
    return Sampled(tokens, _reported(tokens, logits.amax(dim=-1)))


def cut_below_min_p(
    logits: torch.Tensor,  # [B, V]
    params: list[SamplingParams],
    allowed: torch.Tensor | None = None,  # [B, V] bool
) -> torch.Tensor:
    """`logits` with -inf where a sampled row's min_p drops the token: below rowmax +
    T * ln(min_p), which is p < min_p * p_max after temperature T. The same tensor when no row
    asks. A row whose largest allowed logit is NaN or +inf gets a NaN or +inf floor and keeps
    what the not-finite check must see."""
    offsets = [
        p.temperature * math.log(p.min_p) if p.min_p > 0 and not p.greedy else -math.inf
        for p in params
    ]
    if all(o == -math.inf for o in offsets):
        return logits
    pickable = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    floor = pickable.amax(dim=-1, keepdim=True)  # [B, 1]
    floor = floor + on_device(offsets, logits.dtype, logits.device)[:, None]  # -inf: no cut
    return logits.masked_fill(logits < floor, float("-inf"))


def not_finite_message(position: int, dtype: torch.dtype) -> str:
    """The error of a request whose row was reported NOT_FINITE at output `position`."""
    hint = "float16 overflows where bfloat16 does not; " if dtype == torch.float16 else ""
    return (
        f"the model's logits were not finite (NaN or inf) at output token {position}, so no "
        f"token could be sampled: a numerical fault of the model in {str(dtype)[6:]} "
        f"({hint}broken weights or a kernel fault)"
    )


def _reported(tokens: torch.Tensor, largest: torch.Tensor) -> torch.Tensor:
    """`tokens`, NOT_FINITE where the row's largest pickable logit is not finite. x - x is 0
    for a finite x and NaN for NaN and +-inf: three small launches where `torch.isfinite`
    takes four and `torch.where` a fifth (the greedy step measured 8 launches and ~108 us with them
    on the H200, ~25 us before the check)."""
    return tokens.masked_fill((largest - largest) != 0, NOT_FINITE)


def _sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    allowed: torch.Tensor | None,
) -> Sampled:
    from freetoken_agent.kernels.triton.sampling import sample_rows

    rows = kernel_rows(params, generators, logits.shape[-1])
    table = on_device(rows, torch.float64, logits.device)  # [B, 4]
    drawn = sample_rows(logits.float().contiguous(), table, allowed)
    return Sampled(drawn.tokens, drawn.reported)


def kernel_rows(
    params: list[SamplingParams], generators: list[torch.Generator | None], vocab: int
) -> list[list[float]]:
    """The sampling kernel's table rows: temperature (0: greedy), top_p, top_k (0: off; a k
    of the vocabulary or more cuts nothing, and would not fit the kernel's int32), and a fresh
    31-bit Philox seed a sampled row and step, drawn on the host from its generator."""
    rows = []
    for p, g in zip(params, generators, strict=True):
        seed = 0 if p.greedy else int(torch.randint(0, 2**31 - 1, (), generator=g))
        top_k = p.top_k if p.top_k < vocab else 0
        rows.append([0.0 if p.greedy else p.temperature, p.top_p, top_k, seed])
    return rows


def sample_with_torch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    allowed: torch.Tensor | None = None,
    may_wait: bool = True,
) -> torch.Tensor:  # [B] int64
    """torch's ops (the CPU path; on CUDA the benchmarks' reference). `may_wait` False: every
    top-p row is sorted whole instead of reading back whether its candidates hold its nucleus
    (on CUDA a wait for the logits)."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy_ids = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_ids
    device = logits.device
    # Per-row values through pinned memory (device_index.py): `torch.tensor(..., device=cuda)`
    # copies from pageable memory, which waits for everything queued (under overlap
    # scheduling, the decode step just launched).
    temps = on_device([p.temperature if not p.greedy else 1.0 for p in params], F32, device)
    scaled = logits / temps[:, None]
    top_k = [p.top_k for p in params]
    if any(top_k):
        scaled = _top_k(scaled, top_k)
    if any(p.top_p < 1.0 for p in params):
        top_p = on_device([p.top_p for p in params], F32, device)
        largest = _nucleus_candidates(scaled, top_k, top_p) if may_wait else None
        scaled = _top_p(scaled, top_p, largest)
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    drawn = (probs / noise).argmax(dim=-1)
    is_greedy = on_device([p.greedy for p in params], torch.bool, device)
    return torch.where(is_greedy, greedy_ids, drawn)


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's logits at or above its k-th largest (ties at the k-th kept); rows with
    top_k 0 keep all. The k-th largest comes from a top-k selection over the vocabulary, not a
    sort of it (Qwen's recommended top_k is 20 of 151,936)."""
    vocab = logits.shape[-1]
    limited = [0 < k < vocab for k in top_k]
    if not any(limited):
        return logits
    kmax = max(k for k, lim in zip(top_k, limited, strict=True) if lim)
    largest = logits.topk(kmax, dim=-1).values  # [B, kmax], descending
    at = [k - 1 if lim else 0 for k, lim in zip(top_k, limited, strict=True)]
    at = on_device(at, torch.int64, logits.device)
    kth = largest.gather(1, at[:, None])  # [B, 1] the k-th largest logit
    kth = kth.masked_fill(~on_device(limited, torch.bool, logits.device)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


TOP_P_CANDIDATES = 1024  # largest logits tried before sorting a whole row for top-p


def _nucleus_candidates(
    logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The largest logits of every row, descending, when they surely hold each row's nucleus
    (then ordering them decides top-p as sorting the vocabulary would), else None. Rows all cut
    by top-k: their finite logits. Otherwise the TOP_P_CANDIDATES largest, if they carry top_p
    of every row's mass (at T 0.6-0.7 they nearly always do). One sync either way."""
    vocab = logits.shape[-1]
    if all(0 < k < vocab for k in top_k):
        n = int(torch.isfinite(logits).sum(dim=-1).max())
        return logits.topk(max(1, n), dim=-1)
    if vocab <= TOP_P_CANDIDATES:
        return None
    largest = logits.topk(TOP_P_CANDIDATES, dim=-1)
    mass = torch.exp(largest.values - torch.logsumexp(logits, dim=-1, keepdim=True)).sum(-1)
    return largest if bool((mass >= top_p).all()) else None


def _top_p(
    logits: torch.Tensor,
    top_p: torch.Tensor,
    largest: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (always at least one),
    and the ties at its smallest logit. `largest`: (values, indices) of each row's largest
    logits, descending, known to hold its nucleus (`_nucleus_candidates`): only they are
    ordered, every other token is dropped."""
    if largest is not None:
        sorted_logits, order = largest
        drop = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    # Probabilities over the whole row either way (a subset's softmax would renormalise).
    probs = torch.exp(sorted_logits - torch.logsumexp(logits, dim=-1, keepdim=True))
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop = drop.scatter(1, order, before >= top_p[:, None])
    smallest = logits.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(logits < smallest, float("-inf"))
