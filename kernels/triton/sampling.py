"""Temperature, top-k, top-p and the draw of a decode step's tokens in one launch.

torch's ops for the same work (engine/layers/sampler.py's CPU path) cost 50-100 launches a call
(top-k selection and sorting 151,936 logits are each many kernels): 0.9-1.7 ms of host time a
step on the H200 host, against ~25 us for a greedy argmax (bench/sampler_profile.py).

Semantics (the CPU path's): x = logits / T per row. Top-k keeps x >= the k-th largest (ties at
the k-th kept). Top-p then keeps x >= the smallest x of the shortest descending prefix whose
probability (over what top-k kept) reaches top_p (ties at that boundary kept). So each row keeps
{x >= tau} for one threshold tau. The draw is the Gumbel-max trick: argmax over the kept of
x + Gumbel noise, the noise a Philox stream keyed by (the row's seed, token id), so a seeded
request's tokens do not depend on its batch. Greedy rows (T = 0) take the first largest.

B x S programs (S = ceil(V / SLICE)): each slice's max and sum of exp(x - max), and its CAND
largest as packed keys (order-preserving int32 of x, then the token id: ties go to the lower
id). Then each row's last slice program to finish (told by an atomic counter; a second launch
for the rows measured the same device time and ~25 us more host time, NOTES seventeenth
session) draws the row: the union of the slices' candidates, sorted, holds every token above
L, the largest CAND-th value of any slice. tau_k (k <= CAND) and tau_p come from the
candidates when they are above L (logits of a trained model: nearly always), and the draw then
runs over the candidates only; otherwise tau is searched over the whole row (a bisection of
the row's order-preserving keys by one program, 32 passes: exact but slow, ~1.8 ms a
151,936-logit row; flat rows or k > CAND). Measured on the H200 and dropped: a 16-way search,
~2x slower on flat rows (3945 vs 1979 us at b=1, 4075 vs 2107 at b=4); a bitonic merged top-64,
not faster than the whole sort (Qwen3 b=1 287 vs 267 us, CLI 231 vs 244, b=4 321 vs 383).

A row whose allowed logits hold a NaN or +inf, or no finite value (engine/layers/sampler.py's
NOT_FINITE rows), is flagged by its slices (a negative sum in `stats`, where sums are >= 0) and
the drawing program: its token is 0, a valid id for the next step to be fed, and its reported
token -1.

Shapes: logits [B, V] fp32 (rows `stride` apart, unit stride inside); allowed [B, V] bool or
None; table [B, 4] float64 (temperature, top_p, top_k (0: off), seed); returns tokens [B]
int64, reported [B] int64 (tokens, -1 at flagged rows) and tau [B] fp32 (-inf: nothing cut).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SLICE = 4096  # logits a launch-1 program reads (one block in registers)
CAND = 64  # largest kept per slice: top-k up to 64 is read from the candidates
BLOCK = 4096  # logits a launch-2 pass reads at a time
MAX_VOCAB = 2147483647
# A packed key's low half holds LOW - token id: among ties the lower id sorts first.
LOW = tl.constexpr(MAX_VOCAB)
NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))


@triton.jit
def _key(x):
    """float32 -> int32 whose signed order is the floats' order."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _value(k):
    """The inverse of _key."""
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(logits, allowed, row, stride, a_stride, offs, V, t, HAS_ALLOWED: tl.constexpr):
    """x = logits / t at `offs` (IEEE division: the CPU path's values), -inf past V or where
    not allowed."""
    inside = offs < V
    x = tl.load(logits + row * stride + offs, mask=inside, other=NEG_INF)
    x = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * t)
    if HAS_ALLOWED:
        ok = tl.load(allowed + row * a_stride + offs, mask=inside, other=0)
        x = tl.where(ok != 0, x, NEG_INF)
    # -0.0 as +0.0: the packed keys order by bits, where -0.0 sorts below +0.0, and ties must
    # go to the lower id as torch's argmax gives them (a `where`, which no compiler folds).
    x = tl.where(x == 0.0, 0.0, x)
    return tl.where(inside, x, NEG_INF)


@triton.jit
def _row_temperature(table, row):
    t = tl.load(table + row * 4).to(tl.float32)
    return tl.where(t > 0, t, 1.0)


@triton.jit
def _slice_candidates(logits, allowed, table, cand, stats, tokens, reported, taus, done, V, S,
                      stride, a_stride, SLICE: tl.constexpr, CAND: tl.constexpr,
                      S_PAD: tl.constexpr, CAND_PAD: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_ALLOWED: tl.constexpr):  # fmt: skip
    """A program a row and slice. The row's last slice to finish (a counter in `done`,
    acquire-release at GPU scope, so the others' candidates are visible to it) then draws the
    row and puts its counter back to 0 for the next call."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    t = _row_temperature(table, row)
    offs = s * SLICE + tl.arange(0, SLICE)
    x = _scaled(logits, allowed, row, stride, a_stride, offs, V, t, HAS_ALLOWED)
    m = tl.max(x, 0)
    z = tl.sum(tl.where(x > NEG_INF, tl.exp(x - m), 0.0), 0)
    not_finite = tl.sum(((x != x) | (x == POS_INF)).to(tl.int32), 0)  # NaN or +inf, allowed
    z = tl.where(not_finite > 0, -1.0, z)  # the slice's flag (a sum is never negative)
    packed = (_key(x).to(tl.int64) << 32) | (LOW - offs.to(tl.int64))
    top = tl.sort(packed, descending=True)  # all SLICE keys; the CAND largest are kept
    i = tl.arange(0, SLICE)
    tl.store(cand + (row * S + s) * CAND + i, top, mask=i < CAND)
    tl.store(stats + (row * S + s) * 2, m)
    tl.store(stats + (row * S + s) * 2 + 1, z)
    if tl.atomic_add(done + row, 1, sem="acq_rel", scope="gpu") == S - 1:
        tl.store(done + row, 0)
        _draw(row, logits, allowed, table, cand, stats, tokens, reported, taus, V, S, stride,
              a_stride, CAND, S_PAD, CAND_PAD, BLOCK, HAS_ALLOWED)  # fmt: skip


@triton.jit
def _count_at_least(logits, allowed, row, stride, a_stride, V, t, tau,
                    BLOCK: tl.constexpr, HAS_ALLOWED: tl.constexpr):  # fmt: skip
    n = 0
    for start in range(0, V, BLOCK):
        x = _scaled(logits, allowed, row, stride, a_stride, start + tl.arange(0, BLOCK), V, t,
                    HAS_ALLOWED)  # fmt: skip
        n += tl.sum(((x >= tau) & (x > NEG_INF)).to(tl.int32), 0)
    return n


@triton.jit
def _mass_at_least(logits, allowed, row, stride, a_stride, V, t, tau, M,
                   BLOCK: tl.constexpr, HAS_ALLOWED: tl.constexpr):  # fmt: skip
    mass = 0.0
    for start in range(0, V, BLOCK):
        x = _scaled(logits, allowed, row, stride, a_stride, start + tl.arange(0, BLOCK), V, t,
                    HAS_ALLOWED)  # fmt: skip
        mass += tl.sum(tl.where((x >= tau) & (x > NEG_INF), tl.exp(x - M), 0.0), 0)
    return mass


@triton.jit
def _bisect(logits, allowed, row, stride, a_stride, V, t, lo_value, M, floor, goal,
            BY_MASS: tl.constexpr, BLOCK: tl.constexpr, HAS_ALLOWED: tl.constexpr):  # fmt: skip
    """The largest x-value tau >= lo_value with count(x >= tau) >= goal (BY_MASS False) or
    sum over x >= max(tau, floor) of exp(x - M) >= goal (True): a bisection over the
    order-preserving keys, exact in 32 passes. lo_value must satisfy it."""
    lo = _key(lo_value).to(tl.int64)
    hi = _key(M).to(tl.int64) + 1  # above the row's largest: nothing is kept there
    for _ in range(32):
        mid = (lo + hi) >> 1
        tau = _value(mid.to(tl.int32))
        if BY_MASS:
            ok = _mass_at_least(logits, allowed, row, stride, a_stride, V, t,
                                tl.maximum(tau, floor), M, BLOCK, HAS_ALLOWED) >= goal  # fmt: skip
        else:
            ok = _count_at_least(logits, allowed, row, stride, a_stride, V, t, tau, BLOCK,
                                 HAS_ALLOWED) >= goal  # fmt: skip
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return _value(lo.to(tl.int32))


@triton.jit
def _gumbel(seed, ids):
    return -tl.log(-tl.log(tl.rand(seed, ids)))


@triton.jit
def _draw(row, logits, allowed, table, cand, stats, tokens, reported, taus, V, S, stride, a_stride,
          CAND: tl.constexpr, S_PAD: tl.constexpr, CAND_PAD: tl.constexpr,
          BLOCK: tl.constexpr, HAS_ALLOWED: tl.constexpr):  # fmt: skip
    """A row's threshold and token from its slices' candidates and sums."""
    t_asked = tl.load(table + row * 4).to(tl.float32)
    t = tl.where(t_asked > 0, t_asked, 1.0)
    top_p = tl.load(table + row * 4 + 1).to(tl.float32)
    k = tl.load(table + row * 4 + 2).to(tl.int32)
    seed = tl.load(table + row * 4 + 3).to(tl.int32)

    # The candidates, descending; padding sorts last (-inf, id LOW).
    i = tl.arange(0, CAND_PAD)
    floor_key = _key(tl.full((CAND_PAD,), NEG_INF, tl.float32)).to(tl.int64) << 32
    packed = tl.load(cand + row * S * CAND + i, mask=i < S * CAND, other=0)
    packed = tl.where(i < S * CAND, packed, floor_key)
    top = tl.sort(packed, descending=True)
    vals = _value((top >> 32).to(tl.int32))
    low = top & 0xFFFFFFFF
    ids = (-low + LOW).to(tl.int32)  # tensor first: TRITON_INTERPRET keeps LOW - x a constexpr
    M = tl.max(vals, 0)
    first = tl.sum(tl.where(i == 0, ids, 0), 0)

    # The row's mass (relative to M) from the slices' sums.
    j = tl.arange(0, S_PAD)
    ms = tl.load(stats + (row * S + j) * 2, mask=j < S, other=NEG_INF)
    zs = tl.load(stats + (row * S + j) * 2 + 1, mask=j < S, other=0.0)
    Z = tl.sum(tl.where(ms > NEG_INF, zs * tl.exp(ms - M), 0.0), 0)
    # A slice saw NaN or +inf, or no slice holds a finite allowed logit: nothing to draw from.
    flagged = (tl.sum((zs < 0).to(tl.int32), 0) > 0) | (tl.max(ms, 0) == NEG_INF)
    # L: a token that is not a candidate is <= its slice's CAND-th largest, so <= L.
    lows = tl.load(cand + (row * S + j) * CAND + CAND - 1, mask=j < S, other=0)
    lows = tl.where(j < S, _value((lows >> 32).to(tl.int32)), NEG_INF)
    L = tl.max(lows, 0)

    tau_k = tl.full((), NEG_INF, tl.float32)
    Z_k = Z
    if (k > 0) & (k < V):
        if k <= CAND:
            tau_k = tl.max(tl.where(i == k - 1, vals, NEG_INF), 0)
        else:
            tau_k = _bisect(logits, allowed, row, stride, a_stride, V, t, tau_k, M, tau_k, k,
                            False, BLOCK, HAS_ALLOWED)  # fmt: skip
        if tau_k > L:  # every token >= tau_k is a candidate
            Z_k = tl.sum(tl.where(vals >= tau_k, tl.exp(vals - M), 0.0), 0)
        else:
            Z_k = _mass_at_least(logits, allowed, row, stride, a_stride, V, t, tau_k, M, BLOCK,
                                 HAS_ALLOWED)  # fmt: skip
    tau = tau_k
    if top_p < 1.0:
        goal = top_p * Z_k
        p = tl.where((vals >= tau_k) & (vals > NEG_INF), tl.exp(vals - M), 0.0)
        reached = tl.cumsum(p, 0) >= goal
        tau_p = tl.max(tl.where(reached, vals, NEG_INF), 0)
        if tau_p <= L:  # the prefix reaches a value a non-candidate may share: bisect the row
            tau_p = _bisect(logits, allowed, row, stride, a_stride, V, t, tau_k, M, tau_k, goal,
                            True, BLOCK, HAS_ALLOWED)  # fmt: skip
        tau = tl.maximum(tau_k, tau_p)

    token = first
    if t_asked > 0:
        if tau > L:  # every kept token is a candidate
            score = tl.where(vals >= tau, vals + _gumbel(seed, ids), NEG_INF)
            at = tl.argmax(score, 0)
            token = tl.sum(tl.where(i == at, ids, 0), 0)
        else:
            best = tl.full((), NEG_INF, tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = _scaled(logits, allowed, row, stride, a_stride, offs, V, t, HAS_ALLOWED)
                score = tl.where((x >= tau) & (x > NEG_INF), x + _gumbel(seed, offs), NEG_INF)
                blk = tl.max(score, 0)
                token = tl.where(blk > best, start + tl.argmax(score, 0), token)
                best = tl.maximum(blk, best)
    token = tl.where(flagged, 0, token)  # whatever the draw made of NaNs: a valid id
    tl.store(tokens + row, token.to(tl.int64))
    tl.store(reported + row, tl.where(flagged, -1, token).to(tl.int64))
    tl.store(taus + row, tau)


# Per device: launch 1's scratch and the rows' counters (zero between calls), grown as needed.
# Calls are ordered on one stream (the engine's), so one set serves every call.
_scratch: dict[torch.device, dict[str, torch.Tensor]] = {}


def _buffers(device: torch.device, n_cand: int, n_stats: int, rows: int) -> dict:
    held = _scratch.setdefault(device, {})
    for name, size, dtype in (("cand", n_cand, torch.int64), ("stats", n_stats, torch.float32),
                              ("done", rows, torch.int32)):  # fmt: skip
        if name not in held or held[name].numel() < size:
            held[name] = torch.zeros(max(size, 2 * held[name].numel() if name in held else 0),
                                     dtype=dtype, device=device)  # fmt: skip
    return held


class Drawn(NamedTuple):
    tokens: torch.Tensor  # [B] int64, valid ids
    reported: torch.Tensor  # [B] int64: tokens, -1 at rows whose logits are not finite
    taus: torch.Tensor  # [B] fp32, the threshold each row kept above (-inf: nothing cut)


def sample_rows(
    logits: torch.Tensor,  # [B, V] fp32, unit stride inside a row
    table: torch.Tensor,  # [B, 4] float64: temperature (0: greedy), top_p, top_k, seed
    allowed: torch.Tensor | None = None,  # [B, V] bool
    slice_size: int = SLICE,
    cand: int = CAND,
) -> Drawn:
    """Each row's token (see the module docstring) with the threshold it kept above.
    `slice_size` and `cand` (powers of two, cand < slice_size) are the tests' to shrink, so
    that the fallbacks run on small rows."""
    B, V = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert V < MAX_VOCAB, "token ids must fit the packed key's low half"
    S = triton.cdiv(V, slice_size)
    device = logits.device
    held = _buffers(device, B * S * cand, B * S * 2, B)
    tokens = torch.empty(B, dtype=torch.int64, device=device)
    reported = torch.empty(B, dtype=torch.int64, device=device)
    taus = torch.empty(B, dtype=torch.float32, device=device)
    has_allowed = allowed is not None
    a = allowed if has_allowed else logits  # unread when HAS_ALLOWED is False
    a_stride = allowed.stride(0) if has_allowed else 0
    pad = triton.next_power_of_2
    _slice_candidates[(B, S)](logits, a, table, held["cand"], held["stats"], tokens, reported,
                              taus, held["done"], V, S, logits.stride(0), a_stride,
                              SLICE=slice_size, CAND=cand, S_PAD=pad(S), CAND_PAD=pad(S * cand),
                              BLOCK=BLOCK, HAS_ALLOWED=has_allowed, num_warps=8)  # fmt: skip
    return Drawn(tokens, reported, taus)
