"""The logits processors as a unit (engine/logits_processors.py) and min_p (layers/sampler.py),
against plain numpy written token by token, on fresh random logits and histories. Rows that ask
for nothing stay bit-identical beside rows that do."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from freetoken_agent.engine.layers.sampler import cut_below_min_p, kernel_rows, sample
from freetoken_agent.engine.logits_processors import apply_processors, count_sampled
from freetoken_agent.engine.request import Request, Status
from freetoken_agent.engine.sampling_params import SamplingParams


def _random_params(rng: random.Random, vocab: int, pool: list[int]) -> SamplingParams:
    """Each processor present or not: some rows ask for nothing at all. Biased ids are drawn
    from the history's ids too, where bias and penalties meet."""
    options = {}
    if rng.random() < 0.4:
        options["logit_bias"] = {
            rng.choice([rng.randrange(vocab), rng.choice(pool)]): rng.uniform(-100, 100)
            for _ in range(rng.randint(1, 8))
        }
    if rng.random() < 0.4:
        options["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        options["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        options["repetition_penalty"] = rng.choice([rng.uniform(0.1, 1), rng.uniform(1, 5)])
    return SamplingParams(temperature=rng.choice([0, 0.7, 1.0]), **options)


def _request(rng: random.Random, vocab: int, i: int) -> Request:
    # Histories drawn from a few ids, so tokens repeat and sit in both prompt and output.
    pool = rng.sample(range(vocab), rng.randint(2, 12))
    prompt = [rng.choice(pool) for _ in range(rng.randint(1, 20))]
    output = [rng.choice(pool + [rng.randrange(vocab)]) for _ in range(rng.randint(0, 15))]
    req = Request(f"r{i}", prompt, _random_params(rng, vocab, pool), output_ids=output)
    req.status = Status.RUNNING
    return req


def _reference(row: np.ndarray, req: Request) -> np.ndarray:
    """One row in float64, token by token: bias, repetition (prompt and output), frequency and
    presence (output only)."""
    sp, row = req.sampling, row.astype(np.float64)
    for token, bias in (sp.logit_bias or {}).items():
        row[token] += bias
    if sp.repetition_penalty != 1:
        for token in set(req.prompt_ids) | set(req.output_ids):
            r = sp.repetition_penalty
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
    for token, count in Counter(req.output_ids).items():
        row[token] -= sp.presence_penalty + sp.frequency_penalty * count
    return row


def test_processors_match_the_reference_over_several_steps(rng_seed):
    """A batch of rows with and without processors, decoded for a few steps: each step the
    processed rows equal the reference over the request's output so far (counted on the
    device, from the sampled tokens), the others are untouched bit for bit."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    vocab = rng.randint(20, 300)
    reqs = [_request(rng, vocab, i) for i in range(rng.randint(2, 8))]
    reqs[0].sampling = SamplingParams()  # at least one row asks for nothing
    # And one where everything meets: a biased token only in the prompt, another generated.
    last = reqs[-1]
    only_prompt = next(t for t in range(vocab) if t not in last.output_ids + last.prompt_ids[:1])
    last.prompt_ids.append(only_prompt)
    last.output_ids.append(last.prompt_ids[0])
    bias = {only_prompt: rng.uniform(1, 9), last.prompt_ids[0]: -rng.uniform(1, 9)}
    last.sampling = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5,
                                   repetition_penalty=1.5, logit_bias=bias)  # fmt: skip
    for step in range(rng.randint(2, 5)):
        logits = torch.randn(len(reqs), vocab) * rng.uniform(1, 10)
        logits[:, rng.randrange(vocab)] = 0.0  # a zero logit: neither divided nor multiplied
        before = logits.clone()
        penalised = apply_processors(logits, reqs)
        assert [i for i, _ in penalised] == [i for i, r in enumerate(reqs) if r.sampling.penalised]
        for i, req in enumerate(reqs):
            where = f"row {i}, step {step}, seed {rng_seed}, {req.sampling}"
            if not req.sampling.processes_logits:
                assert torch.equal(logits[i], before[i]), where
                continue
            want = _reference(before[i].numpy(), req)
            np.testing.assert_allclose(logits[i].numpy(), want, rtol=1e-5, atol=1e-4,
                                       err_msg=where)  # fmt: skip
        tokens = torch.tensor([rng.choice(r.prompt_ids + [rng.randrange(vocab)]) for r in reqs])
        count_sampled(penalised, tokens)
        for req, token in zip(reqs, tokens.tolist(), strict=True):
            req.output_ids.append(token)  # what the accept does on the host, later
        for i, h in penalised:
            want = np.bincount(reqs[i].output_ids, minlength=vocab)
            assert np.array_equal(h.generated.numpy(), want), (i, step, rng_seed)


def test_a_batch_without_processors_is_not_touched(rng_seed):
    rng = random.Random(rng_seed)
    vocab = rng.randint(20, 300)
    reqs = [_request(rng, vocab, i) for i in range(rng.randint(1, 6))]
    for r in reqs:
        r.sampling = SamplingParams(temperature=rng.choice([0, 1.0]), top_k=rng.randint(0, 9))
    logits = torch.randn(len(reqs), vocab)
    before = logits.clone()
    assert apply_processors(logits, reqs) == []
    assert torch.equal(logits, before)
    assert all(r.token_history is None for r in reqs)


def test_a_finished_request_s_row_is_neither_processed_nor_counted(rng_seed):
    """Overlap's dropped row: the request ended at its previous token's accept."""
    rng = random.Random(rng_seed)
    vocab = rng.randint(20, 300)
    req = _request(rng, vocab, 0)
    req.sampling = SamplingParams(frequency_penalty=2.0, logit_bias={1: 50.0})
    req.status = Status.FINISHED
    logits = torch.randn(1, vocab)
    before = logits.clone()
    assert apply_processors(logits, [req]) == []
    assert torch.equal(logits, before) and req.token_history is None


def _kept_by_min_p(row: np.ndarray, allowed: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Which tokens min_p keeps, by its definition: probability after temperature at least
    min_p times the largest among the allowed tokens (float64)."""
    scaled = row.astype(np.float64) / sp.temperature
    scaled[~allowed] = -np.inf
    probs = np.exp(scaled - scaled.max())
    return probs >= sp.min_p


def test_min_p_keeps_what_its_definition_keeps(rng_seed):
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    vocab, rows = rng.randint(20, 400), rng.randint(2, 8)
    logits = torch.randn(rows, vocab) * rng.uniform(1, 6)
    allowed = torch.rand(rows, vocab) < rng.uniform(0.3, 1)
    allowed[torch.arange(rows), torch.randint(vocab, (rows,))] = True  # one allowed at least
    allowed[0] = True  # a row the constraint leaves alone
    params = [
        SamplingParams(temperature=rng.uniform(0.2, 2), min_p=rng.choice([0, rng.random(), 1]))
        for _ in range(rows)
    ]
    params[-1] = SamplingParams(temperature=0, min_p=0.5)  # greedy: no effect
    cut = cut_below_min_p(logits, params, allowed)
    for i, sp in enumerate(params):
        where = f"row {i}, seed {rng_seed}, {sp}"
        if sp.min_p == 0 or sp.greedy:
            assert torch.equal(cut[i], logits[i]), where
            continue
        row, ok = logits[i].double().numpy(), allowed[i].numpy()
        kept = torch.isfinite(cut[i]).numpy()
        want = _kept_by_min_p(row, ok, sp)  # the largest allowed logit sets the bar
        # Tokens within float noise of the threshold may go either way.
        margin = np.abs((row - row[ok].max()) / sp.temperature - math.log(sp.min_p))
        sure = ok & (margin > 1e-4)
        assert np.array_equal(kept[sure], want[sure]), where
        assert want.any() and kept[ok].any(), where
        assert torch.equal(cut[i][kept], logits[i][kept]), where  # survivors unchanged


def test_min_p_draws_only_what_it_keeps(rng_seed):
    """Seeded draws of one row: every token drawn is kept by min_p, several are drawn, and a
    row without min_p beside it draws what it draws alone."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    vocab, n = rng.randint(20, 200), 1500
    row = torch.randn(vocab) * 2
    temperature, min_p = rng.uniform(0.7, 1.5), rng.uniform(0.05, 0.3)
    params = [SamplingParams(temperature=temperature, min_p=min_p, seed=1)] * n
    kept = set(np.flatnonzero(_kept_by_min_p(row.numpy(), np.ones(vocab, bool), params[0])))
    gens = [torch.Generator().manual_seed(rng_seed + k) for k in range(n)]
    tokens = sample(row.expand(n, vocab).contiguous(), params, gens).tokens.tolist()
    assert set(tokens) <= kept, (sorted(set(tokens) - kept), rng_seed)
    assert len(set(tokens)) > 1 or len(kept) == 1, rng_seed
    plain = SamplingParams(temperature=temperature, seed=2)
    pair = torch.stack([row, torch.randn(vocab)])
    alone = sample(pair[1:], [plain], [torch.Generator().manual_seed(7)]).tokens
    beside = sample(pair, [params[0], plain], [None, torch.Generator().manual_seed(7)]).tokens
    assert beside[1] == alone[0], rng_seed


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_min_p_leaves_a_not_finite_row_to_be_reported(bad):
    logits = torch.randn(2, 30)
    logits[0, 4] = bad
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * 2
    reported = sample(logits, params, [None, None]).reported
    assert reported[0] == -1 and reported[1] >= 0


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter runs where CUDA is absent; see the gpu twin"
)
def test_the_kernel_draws_only_what_min_p_keeps_interpreted(rng_seed):
    """The CUDA path's composition, in Triton's interpreter: min_p's mask, then the sampling
    kernel with the constraint's allowed rows (small rows and slices: the interpreter is slow).
    On CUDA, test_penalties_gpu.py's twin goes through `sample`."""
    from freetoken_agent.kernels.triton.sampling import sample_rows

    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    b, v = 16, rng.randint(40, 200)
    row = torch.randn(v) * 3
    allowed = (torch.rand(v) < 0.6).expand(b, v).contiguous()
    allowed[:, rng.randrange(v)] = True
    sp = SamplingParams(temperature=rng.uniform(0.5, 1.5), min_p=rng.uniform(0.05, 0.5))
    kept = set(np.flatnonzero(_kept_by_min_p(row.numpy(), allowed[0].numpy(), sp)).tolist())
    logits = cut_below_min_p(row.expand(b, v).contiguous(), [sp] * b, allowed)
    gens = [torch.Generator().manual_seed(rng.getrandbits(31)) for _ in range(b)]
    table = torch.tensor(kernel_rows([sp] * b, gens, v), dtype=torch.float64)
    drawn = sample_rows(logits, table, allowed, slice_size=64, cand=8)
    tokens = set(drawn.reported.tolist())
    assert tokens <= kept, (sorted(tokens - kept), sorted(kept), rng_seed)
