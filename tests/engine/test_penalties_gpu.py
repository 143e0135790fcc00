"""Logit bias, penalties and min_p on CUDA (device machine): decode steps replayed from captured
graphs under overlap scheduling, where the host reads step N's token only after step N+1 is
launched, the penalised requests' counts updated on the device from the sampled tokens.

fp32 checkpoints. Greedy tokens are held to the numpy reference along the engine's own tokens
(teacher forcing, penalty_reference.worst_choice_gap): the decode graphs and the scoring
prefill differ by float noise, so each chosen token must be its row's argmax within a small
tolerance rather than exactly. The plain and the overlapped loop run the same batches (every
request ends by length), so their events must be equal."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from overlap_runs import both_loops
from penalty_reference import random_penalties, worst_choice_gap
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.cuda_graphs import DecodeGraphs
from freetoken_agent.engine.layers.sampler import sample

pytestmark = pytest.mark.gpu

VOCAB = 320  # tiny_models' vocabulary
CUDA = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4, policy="resident")
# fp32 decode graph vs scoring prefill (tf32 dots may differ between them): the tiny models'
# logits reach about 2.5, their top two about 0.1 apart; a penalty moves a logit by 0.3 or more.
GAP = 1e-2


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _load(path, overlap: bool) -> Engine:
    return Engine.load(path, overlap_schedule=overlap, **CUDA)


def _count_graphed(engine: Engine) -> list[bool]:
    """Record, per launched step, whether it replayed a decode graph."""
    graphed: list[bool] = []
    launch = engine.runner.launch

    def counted(*args, **kwargs):
        step = launch(*args, **kwargs)
        graphed.append(step.graphed)
        return step

    engine.runner.launch = counted
    return graphed


def test_greedy_penalties_match_the_reference_under_overlap_and_graphs(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    n = rng.randint(12, 24)
    plain = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    # One penalised over its output for sure, one over its prompt too (see the CPU twin).
    params = [
        random_penalties(rng, VOCAB, max_tokens=n, presence_penalty=rng.uniform(1, 2)),
        random_penalties(rng, VOCAB, max_tokens=n, repetition_penalty=rng.uniform(1.5, 3)),
    ]
    sampled = random_penalties(rng, VOCAB, max_tokens=n, temperature=0.8, min_p=0.05,
                               seed=rng.randrange(1 << 30))  # fmt: skip
    engine = _load(tmp_path, True)
    assert isinstance(engine.runner.graphs, DecodeGraphs), engine.graph_error
    # Each prompt ends with what the model writes after it (tiny models repeat themselves).
    prompts = [_prompt(rng, rng.randint(5, 60)) for _ in range(4)]
    ahead = engine.generate(prompts, plain)
    prompts = [p + o.token_ids[:8] for p, o in zip(prompts, ahead, strict=True)]
    unpenalised = [o.token_ids for o in engine.generate(prompts[:2], plain)]
    graphed, lagged = _count_graphed(engine), engine.overlap.lagged_steps
    outs = engine.generate(prompts, [*params, plain, sampled])
    assert engine.overlap.lagged_steps - lagged >= n - 3
    assert sum(graphed) >= n - 3, graphed
    assert [o.token_ids for o in outs[:2]] != unpenalised, f"nothing penalised (seed {rng_seed})"
    score = lambda ids: engine.score(ids).double().numpy()  # noqa: E731
    for prompt, sp, out in zip(prompts, [*params, plain], outs, strict=False):
        assert len(out.token_ids) == n
        gap = worst_choice_gap(score, prompt, sp, out.token_ids)
        assert gap <= GAP, (gap, sp, rng_seed)
    assert all(r.token_history is None for r in engine._requests.values())


def test_both_loops_agree_with_processors_on_cuda(tmp_path, rng_seed):
    """Greedy and seeded sampled rows with penalties, bias and min_p, and a plain row; a
    fourth request arriving mid-decode (a drain, then overlap again)."""
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)

    def sp(**kw) -> SamplingParams:
        return random_penalties(rng, VOCAB, max_tokens=rng.randint(12, 28), **kw)

    first = [
        (_prompt(rng, rng.randint(5, 60)), sp(), {}),
        (_prompt(rng, rng.randint(5, 60)),
         sp(temperature=0.7, top_k=20, top_p=0.9, min_p=0.1, seed=rng.randrange(1 << 30)), {}),
        (_prompt(rng, rng.randint(5, 60)),
         SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), {}),
    ]  # fmt: skip
    plan = {0: first, rng.randint(4, 9): [(_prompt(rng, 30), sp(), {})]}
    events, engine = both_loops(lambda overlap: _load(tmp_path, overlap), plan)
    assert engine.overlap.lagged_steps >= 10 and engine.overlap.drains >= 1
    assert len(events) == 4


def test_a_large_bias_forces_a_token_on_cuda(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    engine = _load(tmp_path, True)
    forced = rng.randrange(3, VOCAB)
    n = rng.randint(8, 16)
    for temperature in (0, 1.0):
        sp = SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True,
                            logit_bias={forced: 100}, seed=rng.randrange(1 << 30))  # fmt: skip
        out = engine.generate(_prompt(rng, rng.randint(3, 30)), sp).token_ids
        assert out == [forced] * n, (out, forced, rng_seed)


def test_min_p_on_the_kernel_path(rng_seed):
    """The sampling kernel draws only tokens min_p keeps (its mask is applied before it), the
    constraint's allowed set deciding the row's largest probability."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    vocab, n = rng.randint(50, 2000), 512
    row = torch.randn(vocab, device="cuda") * 3
    allowed = torch.rand(vocab, device="cuda") < 0.5
    allowed[rng.randrange(vocab)] = True
    temperature, min_p = rng.uniform(0.5, 1.5), rng.uniform(0.05, 0.5)
    scaled = row.double().cpu().numpy() / temperature
    ok = allowed.cpu().numpy()
    scaled[~ok] = -np.inf
    kept = set(np.flatnonzero(np.exp(scaled - scaled.max()) >= min_p).tolist())
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * n
    gens = [torch.Generator().manual_seed(rng_seed + k) for k in range(n)]
    logits = row.expand(n, vocab).contiguous()
    drawn = sample(logits, params, gens, allowed.expand(n, vocab).contiguous()).reported
    tokens = set(drawn.tolist())
    assert tokens <= kept, (sorted(tokens - kept), rng_seed)
    assert len(tokens) > 1 or len(kept) == 1, rng_seed
