"""The CUDA sampling kernel (kernels/triton/sampling.py) against a float64 reference of the CPU
path's semantics: its thresholds, that its tokens lie above them, its draws' distribution, and
seeds independent of the batch."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.engine.layers.sampler import sample
from freetoken_agent.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
INF = float("inf")


def _reference_tau(logits: torch.Tensor, t: float, top_p: float, k: int) -> float:
    """The kept threshold of one row: top-k's k-th largest (ties kept), then top-p's shortest
    prefix over what top-k kept (ties at its last kept)."""
    x = (logits.float() / (t if t > 0 else 1.0)).double()
    finite = x[torch.isfinite(x)]
    tau_k = -INF
    if 0 < k < x.numel() and k <= finite.numel():
        tau_k = finite.topk(k).values[-1].item()
    if top_p >= 1:
        return tau_k
    ordered = finite[finite >= tau_k].sort(descending=True).values
    mass = torch.softmax(ordered, 0).cumsum(0)
    return max(tau_k, ordered[int((mass >= top_p).nonzero()[0])].item())


def _valid_threshold(x: torch.Tensor, tau: float, t: float, top_p: float, k: int) -> bool:
    """Within rounding of the crossing: tau is a value of the row, keeps top_p of the mass
    after top-k, and the tokens strictly above it do not."""
    x = (x.float() / (t if t > 0 else 1.0)).double()
    tau_k = _reference_tau(x.float(), 1.0, 1.0, k)
    kept_k = x[x >= tau_k]
    z = torch.exp(kept_k - kept_k.max()).sum()
    mass = lambda keep: (torch.exp(kept_k[keep] - kept_k.max()).sum() / z).item()  # noqa: E731
    return (
        bool((x == tau).any())
        and mass(kept_k >= tau) >= top_p - 1e-5
        and (mass(kept_k > tau) < top_p + 1e-5)
    )


def _rows(gen: torch.Generator, b: int, v: int) -> tuple[torch.Tensor, list[list[float]]]:
    """Logits from flat to peaked (bf16 values: ties), with temperature, top-p, top-k drawn
    across greedy, k <= 64 (the candidates), k > 64 (the bisection) and none."""
    scale = torch.rand(b, 1, generator=gen) ** 2 * 6 + 0.02
    logits = (torch.randn(b, v, generator=gen) * scale).bfloat16().float()
    rows = []
    for _ in range(b):
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        k = [0, int(torch.randint(1, 65, (1,), generator=gen)),
             int(torch.randint(65, 300, (1,), generator=gen)), 0][kind]  # fmt: skip
        t = 0.0 if kind == 3 else float(torch.rand(1, generator=gen)) * 1.2 + 0.2
        top_p = 1.0 if torch.rand(1, generator=gen) < 0.2 else float(torch.rand(1, generator=gen))
        rows.append([t, max(top_p, 0.01), k, int(torch.randint(0, 2**31 - 1, (1,), generator=gen))])
    return logits, rows


@pytest.mark.parametrize("small_slices", [False, True])
def test_thresholds_and_tokens_match_the_reference(rng_seed, small_slices):
    """Every row's tau is the reference's (or, where fp32 and fp64 mass sums round apart at
    the crossing, a valid threshold), its token is kept (>= tau, allowed), and greedy rows take
    torch's argmax. Small slices (256 logits, 8 candidates) send most rows to the slow path's
    bisection."""
    from freetoken_agent.kernels.triton.sampling import sample_rows

    gen = torch.Generator().manual_seed(rng_seed)
    sizes = dict(slice_size=256, cand=8) if small_slices else {}
    for v in (151936, int(torch.randint(300, 70000, (1,), generator=gen))):
        b = 12
        logits, rows = _rows(gen, b, v)
        allowed = None
        if torch.rand(1, generator=gen) < 0.5:
            allowed = torch.rand(b, v, generator=gen) < 0.7
            allowed[:, int(torch.randint(0, v, (1,), generator=gen))] = True
        table = torch.tensor(rows, dtype=torch.float64, device=CUDA)
        tokens, _, taus = sample_rows(logits.to(CUDA), table, None if allowed is None
                                   else allowed.to(CUDA), **sizes)  # fmt: skip
        tokens, taus = tokens.cpu(), taus.cpu()
        masked = logits if allowed is None else logits.masked_fill(~allowed, -INF)
        for r, (t, top_p, k, _) in enumerate(rows):
            ref = _reference_tau(masked[r], t, top_p, int(k))
            got = taus[r].item()
            assert got == ref or _valid_threshold(masked[r], got, t, top_p, int(k)), (
                v,
                r,
                rows[r],
                got,
                ref,
            )
            x = masked[r] / (t if t > 0 else 1.0)
            tok = int(tokens[r])
            assert torch.isfinite(x[tok]) and x[tok].item() >= got, (v, r, tok)
            if t == 0:
                assert tok == int(masked[r].argmax())


def test_draws_follow_the_kept_distribution(rng_seed):
    """4096 draws from one row (1024 seeds, four rounds) over a full vocabulary with a few
    planted large logits: the frequencies are the softmax over the kept tokens (total variation
    well under what a wrong temperature, cut or noise would give)."""
    from freetoken_agent.kernels.triton.sampling import sample_rows

    gen = torch.Generator().manual_seed(rng_seed)
    v, b = 151936, 1024
    row = torch.randn(v, generator=gen)
    planted = torch.randperm(v, generator=gen)[:12]
    row[planted] = 8 + torch.rand(12, generator=gen) * 3
    t, top_p, k = 0.5 + float(torch.rand(1, generator=gen)), 0.92, 9
    logits = row.expand(b, v).contiguous().to(CUDA)
    counts = torch.zeros(v)
    for _ in range(4):
        seeds = torch.randint(0, 2**31 - 1, (b,), generator=gen).tolist()
        table = torch.tensor([[t, top_p, k, s] for s in seeds], dtype=torch.float64, device=CUDA)
        tokens, _, _ = sample_rows(logits, table)
        counts += torch.bincount(tokens.cpu(), minlength=v).float()
    x = (row / t).double()
    kept = x >= _reference_tau(row, t, top_p, k)
    want = torch.where(kept, torch.softmax(x.masked_fill(~kept, -INF), 0), 0.0)
    assert counts[~kept].sum() == 0
    tv = 0.5 * (counts.double() / counts.sum() - want).abs().sum().item()
    assert tv < 0.05, tv


def test_a_seeded_row_does_not_depend_on_its_batch(rng_seed):
    """The same seed and logits give the same token alone and among other rows, anywhere."""
    from freetoken_agent.kernels.triton.sampling import sample_rows

    gen = torch.Generator().manual_seed(rng_seed)
    v = 151936
    logits, rows = _rows(gen, 8, v)
    rows = [[max(r[0], 0.3), r[1], r[2], r[3]] for r in rows]
    table = torch.tensor(rows, dtype=torch.float64, device=CUDA)
    tokens = sample_rows(logits.to(CUDA), table).tokens
    order = torch.randperm(8, generator=gen)
    table = torch.tensor([rows[i] for i in order], dtype=torch.float64, device=CUDA)
    shuffled, _, _ = sample_rows(logits[order].contiguous().to(CUDA), table)
    assert torch.equal(shuffled.cpu(), tokens.cpu()[order])
    for r in range(8):
        table = torch.tensor([rows[r]], dtype=torch.float64, device=CUDA)
        alone, _, _ = sample_rows(logits[r : r + 1].to(CUDA), table)
        assert int(alone) == int(tokens[r])


def test_sample_on_cuda_seeds_from_cpu_generators(rng_seed):
    """`sample` on CUDA: a request's generator (seeded) replays its tokens; unseeded rows and
    greedy ones beside it change nothing; an allowed mask is honoured."""
    gen = torch.Generator().manual_seed(rng_seed)
    v = 151936
    logits = (torch.randn(3, v, generator=gen) * 2).to(CUDA)
    params = [
        SamplingParams(temperature=0.7, top_p=0.95, top_k=20, seed=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9),
    ]
    runs = []
    for _ in range(2):
        seeded = torch.Generator().manual_seed(rng_seed)
        draws = [sample(logits, params, [seeded, None, None]).tokens for _ in range(12)]
        runs.append([d[0].item() for d in draws])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
    allowed = torch.zeros(3, v, dtype=torch.bool, device=CUDA)
    pick = torch.randint(0, v, (3, 5), generator=gen).to(CUDA)
    allowed.scatter_(1, pick, True)
    tokens = sample(logits, params, [None] * 3, allowed).tokens
    assert all(int(tokens[r]) in pick[r].tolist() for r in range(3))
