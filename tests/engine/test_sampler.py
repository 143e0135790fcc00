"""The sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.engine.layers.sampler import sample, sample_with_torch
from freetoken_agent.engine.sampling_params import SamplingParams


def _gens(seeds):
    out = []
    for s in seeds:
        g = torch.Generator()
        g.manual_seed(s)
        out.append(g)
    return out


def test_greedy_is_argmax(rng_seed):
    torch.manual_seed(rng_seed)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(top_k=1)] * 3
    assert torch.equal(sample(logits, params, [None] * 6).tokens, logits.argmax(-1))


def test_temperature_sampling_follows_softmax(rng_seed):
    torch.manual_seed(rng_seed)
    logits = torch.randn(1, 6) * 1.5
    n = 6000
    rows = logits.expand(n, 6).contiguous()
    params = [SamplingParams(temperature=0.8)] * n
    tokens = sample(rows, params, _gens(range(rng_seed, rng_seed + n))).tokens
    freq = torch.bincount(tokens, minlength=6).float() / n
    expected = torch.softmax(logits[0] / 0.8, -1)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_top_k_and_top_p_limit_the_support(rng_seed):
    torch.manual_seed(rng_seed)
    logits = torch.randn(1, 40)
    n = 2000
    rows = logits.expand(n, 40).contiguous()
    top5 = set(logits[0].topk(5).indices.tolist())
    tokens = sample(rows, [SamplingParams(top_k=5)] * n, _gens(range(n))).tokens
    assert set(tokens.tolist()) <= top5
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1].tolist())
    tokens = sample(rows, [SamplingParams(top_p=0.6)] * n, _gens(range(n))).tokens
    assert set(tokens.tolist()) <= nucleus and len(set(tokens.tolist())) > 1


def test_seeded_rows_do_not_depend_on_the_batch(rng_seed):
    torch.manual_seed(rng_seed)
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=1.0, seed=7)] + [SamplingParams(temperature=1.3)] * 3
    draws = []
    for _ in range(2):
        gens = _gens([7]) + [None] * 3
        seq = [sample(logits, params, gens).tokens[0].item() for _ in range(20)]
        draws.append(seq)
    alone = _gens([7])
    seq_alone = [sample(logits[:1], params[:1], alone).tokens[0].item() for _ in range(20)]
    assert draws[0] == draws[1] == seq_alone


def test_top_k_keeps_what_a_full_sort_keeps_ties_included(rng_seed):
    """The k-th largest from a top-k selection, as from a sorted vocabulary: every logit at or
    above it is kept (ties at the k-th, common in bf16 logits, all kept); top_k 0 keeps all."""
    from freetoken_agent.engine.layers.sampler import _top_k

    gen = torch.Generator().manual_seed(rng_seed)
    for _ in range(20):
        b, v = (
            int(torch.randint(1, 6, (1,), generator=gen)),
            int(torch.randint(2, 3000, (1,), generator=gen)),
        )
        logits = torch.randn(b, v, generator=gen).to(torch.bfloat16).float()  # many ties
        ks = [int(k) for k in torch.randint(0, v + 3, (b,), generator=gen)]
        got = _top_k(logits, ks)
        for row, k in enumerate(ks):
            if k <= 0 or k >= v:
                assert torch.equal(got[row], logits[row])
                continue
            kth = logits[row].sort(descending=True).values[k - 1]
            kept = logits[row] >= kth
            assert torch.equal(torch.isfinite(got[row]), kept) and int(kept.sum()) >= k
            assert torch.equal(got[row][kept], logits[row][kept])


@pytest.mark.parametrize("cut_by_top_k", [True, False])
def test_top_p_over_candidates_decides_as_over_the_vocabulary(rng_seed, cut_by_top_k):
    """The nucleus lies among the finite logits after top-k, or among the largest 1024 when
    they carry top_p of the mass: ordering only those drops the same tokens as sorting the
    whole row. When they do not, there are no candidates (the row is sorted)."""
    from freetoken_agent.engine.layers.sampler import (
        TOP_P_CANDIDATES,
        _nucleus_candidates,
        _top_k,
        _top_p,
    )

    gen = torch.Generator().manual_seed(rng_seed)
    seen = set()
    for _ in range(20):
        b = int(torch.randint(1, 6, (1,), generator=gen))
        v = int(torch.randint(TOP_P_CANDIDATES + 1, 8000, (1,), generator=gen))
        scale = float(torch.rand(1, generator=gen)) * 8  # flat to peaked rows
        logits = torch.randn(b, v, generator=gen) * scale  # continuous: no ties to order
        ks = (
            [int(k) for k in torch.randint(1, 60, (b,), generator=gen)] if cut_by_top_k else [0] * b
        )
        logits = _top_k(logits, ks)
        top_p = torch.rand(b, generator=gen) * 0.98 + 0.01
        largest = _nucleus_candidates(logits, ks, top_p)
        seen.add(largest is not None)
        if largest is None:
            continue
        assert torch.equal(_top_p(logits, top_p, largest), _top_p(logits, top_p))
    assert True in seen  # the candidates' path ran


def test_top_k_with_top_p_draws_within_both(rng_seed):
    torch.manual_seed(rng_seed)
    logits = torch.randn(1, 300) * 2
    n_draws = 1500
    rows = logits.expand(n_draws, 300).contiguous()
    params = [SamplingParams(top_k=12, top_p=0.7)] * n_draws
    tokens = set(sample(rows, params, _gens(range(n_draws))).tokens.tolist())
    top12 = logits[0].topk(12)
    probs = torch.softmax(top12.values, -1)
    n = int((probs.cumsum(0) - probs < 0.7).sum())
    nucleus = top12.indices[:n].tolist()
    assert tokens <= set(nucleus)
    # Every nucleus token likely enough to be drawn (>= 30 expected draws) was drawn (a peaked
    # row's nucleus may be one token: a CI run drew seed 116033849, 77% on its first).
    renormalized = probs[:n] / probs[:n].sum()
    likely = {t for t, p in zip(nucleus, renormalized.tolist(), strict=True) if p * n_draws >= 30}
    assert likely and likely <= tokens


def test_sampling_without_waiting_draws_the_same_tokens(rng_seed):
    """The torch path with may_wait=False sorts every top-p row instead of reading back the
    candidates' check: the same tokens from the same generators, top-k or not."""
    gen = torch.Generator().manual_seed(rng_seed)
    for _ in range(10):
        b = int(torch.randint(1, 6, (1,), generator=gen))
        v = int(torch.randint(1100, 5000, (1,), generator=gen))
        logits = torch.randn(b, v, generator=gen) * float(torch.rand(1, generator=gen) * 6 + 0.5)
        params = [
            SamplingParams(
                temperature=float(torch.rand(1, generator=gen)) + 0.3,
                top_p=float(torch.rand(1, generator=gen)) * 0.9 + 0.05,
                top_k=int(torch.randint(0, 40, (1,), generator=gen)),
            )
            for _ in range(b)
        ]
        seeds = [int(torch.randint(0, 1 << 30, (1,), generator=gen)) for _ in range(b)]
        waited = sample_with_torch(logits, params, _gens(seeds))
        free = sample_with_torch(logits, params, _gens(seeds), may_wait=False)
        assert torch.equal(waited, free)


def test_top_p_keeps_the_ties_at_its_smallest_logit(rng_seed):
    """Top-p keeps the shortest descending prefix reaching top_p and every token tied with its
    last: one threshold a row, as the CUDA kernel keeps (bf16 logits: many ties). Where the
    prefix's mass lies within 1e-6 of top_p, float rounding may end it one token either way
    (the fp32 sum against this float64 one): either prefix is right there."""
    from freetoken_agent.engine.layers.sampler import _top_p

    gen = torch.Generator().manual_seed(rng_seed)
    for _ in range(20):
        b, v = (
            int(torch.randint(1, 5, (1,), generator=gen)),
            int(torch.randint(2, 400, (1,), generator=gen)),
        )
        logits = (torch.randn(b, v, generator=gen) * 2).to(torch.bfloat16).float()
        top_p = torch.rand(b, generator=gen) * 0.98 + 0.01
        got = _top_p(logits, top_p)
        for row in range(b):
            ordered = logits[row].double().sort(descending=True).values
            mass = torch.softmax(ordered, 0).cumsum(0)
            p = top_p[row].double()
            first = int((mass >= p - 1e-6).nonzero()[0])  # the prefixes that may reach top_p
            last = int((mass >= min(p + 1e-6, mass[-1])).nonzero()[0])
            allowed = [logits[row] >= ordered[j] for j in range(first, last + 1)]
            kept = torch.isfinite(got[row])
            assert any(torch.equal(kept, want) for want in allowed), (row, first, last)


def test_kernel_rows_carry_each_request_and_fit_the_kernel(rng_seed):
    """The CUDA kernel's table: greedy rows as temperature 0 with no seed drawn, a top_k of the
    vocabulary or more as 0 (off: a k past int32 would wrap in the kernel), and seeds from the
    requests' generators, replayed by a generator seeded alike."""
    from freetoken_agent.engine.layers.sampler import kernel_rows

    r = torch.Generator().manual_seed(rng_seed)
    vocab = int(torch.randint(100, 200_000, (1,), generator=r))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=vocab + int(torch.randint(0, 10**12, (1,), generator=r)),
        ),
        SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
    ]
    seed = int(torch.randint(0, 2**40, (1,), generator=r))
    rows = kernel_rows(params, _gens([seed, seed, seed + 1]), vocab)
    again = kernel_rows(params, _gens([seed, seed, seed + 1]), vocab)
    assert rows == again
    assert rows[0] == [0.0, 1.0, 0, 0]
    assert rows[1][:3] == [0.8, 0.9, 0] and rows[2][:3] == [0.6, 0.95, 20]
    assert all(0 <= row[3] < 2**31 - 1 for row in rows) and rows[1][3] != rows[2][3]


def test_a_tiny_temperature_decodes_greedily(rng_seed):
    """Below 1e-5 (vLLM's threshold) logits / T would overflow fp32 into inf and NaN: such a
    row takes the argmax, as temperature 0 does."""
    gen = torch.Generator().manual_seed(rng_seed)
    logits = torch.randn(3, 500, generator=gen) * 20
    t = float(torch.rand(1, generator=gen)) * 1e-5 * 0.99
    params = [SamplingParams(temperature=t, top_p=0.9), SamplingParams(temperature=1e-40),
              SamplingParams(temperature=t, top_k=5)]  # fmt: skip
    assert all(p.greedy for p in params)
    assert torch.equal(sample(logits, params, _gens([1, 2, 3])).tokens, logits.argmax(-1))
    assert not SamplingParams(temperature=2e-5).greedy
