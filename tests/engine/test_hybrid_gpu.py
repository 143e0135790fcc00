"""Hybrid models (gated DeltaNet + attention) on CUDA, run on the device machine: bf16 parity
with transformers, graph decode equal to eager and to the CPU engine, offloaded policies equal
to resident, and anchor resumption equal to a cold prefill, all through the Triton kernels."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import HYBRID_FAMILIES, make_tiny, max_rel_err

from freetoken_agent import Engine, SamplingParams

pytestmark = pytest.mark.gpu
VOCAB = 320


@pytest.fixture(autouse=True)
def full_precision_reductions():
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag


def _load(path, **options) -> Engine:
    options.setdefault("max_model_len", 1024)
    return Engine.load(path, device="cuda", progress=False, **options)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_bf16_teacher_forced_parity(family, tmp_path, rng_seed):
    hf = make_tiny(family, tmp_path, rng_seed, dtype=torch.bfloat16, initializer_range=0.02)
    hf = hf.cuda()
    engine = _load(tmp_path)
    ids = _tokens(random.Random(rng_seed), 300)
    batch = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        ref = hf(batch).logits[0].float().cpu()
    ours = engine.score(ids)
    err = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{family}: bf16 norm-relative {err:.2e}, argmax agreement {agree:.1%}")
    assert err <= 2e-2
    assert agree >= 0.95


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_graph_decode_equals_eager_and_cpu(family, tmp_path, rng_seed):
    make_tiny(family, tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompts = [_tokens(rng, n) for n in (5, 70, 130, 260)]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    graphed = _load(tmp_path, max_num_seqs=8)
    assert graphed.runner.graphs is not None
    eager = _load(tmp_path, max_num_seqs=8, cuda_graphs=False)
    cpu = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=4096)
    tokens = [[o.token_ids for o in e.generate(prompts, sp)] for e in (graphed, eager, cpu)]
    assert tokens[0] == tokens[1] == tokens[2]
    graphed.check_integrity()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_offloaded_hybrid_matches_resident(family, tmp_path, rng_seed):
    make_tiny(family, tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompts = [_tokens(rng, n) for n in (7, 50, 300)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    opts = dict(max_num_seqs=4)
    want = [o.token_ids for o in _load(tmp_path, policy="resident", **opts).generate(prompts, sp)]
    for policy in ("transfer", "cpu", "adaptive", "direct"):
        engine = _load(tmp_path, policy=policy, expert_slots=3, stream_min_tokens=128, **opts)
        got = [o.token_ids for o in engine.generate(prompts, sp)]
        assert got == want, policy
        assert engine.stats()["experts"]["layers_streamed"] > 0
        engine.check_integrity()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_anchor_resume_on_cuda_equals_cold(family, tmp_path, rng_seed):
    make_tiny(family, tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = _load(tmp_path)
    first = _tokens(rng, 400)
    anchors = sorted(rng.sample(range(1, 400), 8))
    engine.generate(first, sp, anchors=anchors)
    cut = rng.randrange(anchors[2] + 1, 399)
    second = first[:cut] + _tokens(rng, 30)
    second[cut] = (first[cut] + 1 - 3) % (VOCAB - 3) + 3  # diverges exactly at `cut`
    out = engine.generate(second, sp)
    resume = max(a for a in [*anchors, 400] if a <= cut)
    assert out.stats["resumed_tokens"] == resume
    assert out.stats["prefilled_tokens"] == len(second) - resume
    cold = _load(tmp_path, checkpoints="none")
    assert cold.generate(second, sp).token_ids == out.token_ids
    assert max_rel_err(engine.score(second), cold.score(second)) <= 1e-4
    engine.check_integrity()


def test_invalidated_capture_is_retried_and_decodes_right(tmp_path, rng_seed, monkeypatch):
    """A capture the driver invalidates (here: a host sync inside the first capture, as a
    kernel's first launch did on a machine just started) is ended, retried, and the retried
    graphs decode what eager decode does."""
    from freetoken_agent.engine.experts.offload import OffloadedExpertBank

    family = random.Random(rng_seed).choice(HYBRID_FAMILIES)
    make_tiny(family, tmp_path, rng_seed)
    captured = OffloadedExpertBank._captured
    spoiled = []

    def spoil_first_capture(self, *args):
        if torch.cuda.is_current_stream_capturing() and not spoiled:
            spoiled.append(True)
            torch.cuda.synchronize()  # forbidden while capturing: invalidates the capture
        return captured(self, *args)

    monkeypatch.setattr(OffloadedExpertBank, "_captured", spoil_first_capture)
    opts = dict(policy="adaptive", expert_slots=3, stream_min_tokens=128, max_num_seqs=4)
    engine = _load(tmp_path, **opts)
    assert spoiled and engine.runner.graphs is not None and engine.graph_error is None
    rng = random.Random(rng_seed + 1)
    prompts = [_tokens(rng, n) for n in (9, 140)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    eager = _load(tmp_path, cuda_graphs=False, **opts)
    assert [o.token_ids for o in engine.generate(prompts, sp)] == [
        o.token_ids for o in eager.generate(prompts, sp)
    ]
    engine.check_integrity()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_run_ahead_reruns_from_the_step_start_state(family, tmp_path, rng_seed, monkeypatch):
    """hybrid_run_ahead: segments run ahead of the host's miss checks and, after a miss, run
    again from step-start copies of the recurrent state (recurrent_shadow.py). Forced to bet on
    every layer (miss rates held at 0) with few slots, so re-runs happen on most steps; tokens
    and logits stay the resident engine's."""
    from freetoken_agent.engine import segmented_graphs

    monkeypatch.setattr(segmented_graphs, "MISS_EMA", 0.0)  # never stop betting
    make_tiny(family, tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    prompts = [_tokens(rng, n) for n in (7, 50, 90)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    resident = _load(tmp_path, policy="resident", max_num_seqs=4)
    want = [o.token_ids for o in resident.generate(prompts, sp)]
    for slots in (1, rng.randint(2, 6)):
        engine = _load(tmp_path, policy="transfer", expert_slots=slots, max_num_seqs=4,
                       hybrid_run_ahead=True)  # fmt: skip
        graphs = engine.runner.graphs
        assert graphs.shadow is not None and graphs.run_ahead > 0
        assert [o.token_ids for o in engine.generate(prompts, sp)] == want, slots
        assert graphs.reruns > 0, slots  # segments did run again
        engine.check_integrity()
