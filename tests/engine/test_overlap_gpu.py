"""Overlap scheduling on CUDA (device machine): decode graphs replayed with their ids copied
on the device from the last step's sampled tokens, the tokens read back behind an event, and
offloaded segmented graphs completing the last step at their first stop, give the plain
loop's events. fp32: the plans keep both loops' batches the same (requests end by length, which
the lagged step knows ahead, or a lone request stops), so float noise cannot tell them apart."""

from __future__ import annotations

import random

import pytest
from overlap_runs import Plan, both_loops
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.cuda_graphs import DecodeGraphs
from freetoken_agent.engine.direct_graphs import DirectDecodeGraphs
from freetoken_agent.engine.path_graphs import PathDecodeGraphs
from freetoken_agent.engine.segmented_graphs import SegmentedDecodeGraphs

pytestmark = pytest.mark.gpu

CUDA = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 320) for _ in range(n)]


def _loader(path, **options):
    return lambda overlap: Engine.load(path, overlap_schedule=overlap, **CUDA, **options)


def _mixed_plan(rng: random.Random) -> Plan:
    """Three requests at once (greedy, seeded top-k/top-p, seeded temperature) ending by
    length at different steps, and a fourth arriving mid-decode (a drain, then overlap again)."""

    def sp(**kw) -> SamplingParams:
        return SamplingParams(max_tokens=rng.randint(12, 28), ignore_eos=True, **kw)

    first = [
        (_prompt(rng, rng.randint(5, 60)), sp(temperature=0), {}),
        (
            _prompt(rng, rng.randint(5, 60)),
            sp(temperature=0.7, top_k=20, top_p=0.9, seed=rng.randrange(1 << 30)),
            {},
        ),  # fmt: skip
        (_prompt(rng, rng.randint(5, 60)), sp(temperature=1.0, seed=rng.randrange(1 << 30)), {}),
    ]
    return {0: first, rng.randint(4, 9): [(_prompt(rng, 30), sp(temperature=0), {})]}


def test_resident_graphs(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    rng = random.Random(rng_seed)
    _, engine = both_loops(_loader(tmp_path, policy="resident"), _mixed_plan(rng))
    assert isinstance(engine.runner.graphs, DecodeGraphs)
    assert engine.overlap.lagged_steps >= 10 and engine.overlap.drains >= 1
    # A lone request ending at a stop token: its lagged row past the stop is dropped.
    prompt = _prompt(rng, 20)
    free = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stop = free.token_ids[rng.randint(4, 12)]
    sp = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop])
    events, engine = both_loops(_loader(tmp_path, policy="resident"), {0: [(prompt, sp, {})]})
    (got,) = events.values()
    cut = free.token_ids.index(stop) + 1
    assert [e[1] for e in got] == free.token_ids[:cut] and got[-1][4] == "stop"


@pytest.mark.parametrize("policy", ["adaptive", "transfer", "gpu-fill"])
def test_offloaded_segmented_graphs(tmp_path, rng_seed, policy):
    make_tiny("qwen3_moe", tmp_path, rng_seed, num_experts=16, num_experts_per_tok=4)
    rng = random.Random(rng_seed)
    sp = SamplingParams(max_tokens=rng.randint(12, 24), temperature=0, ignore_eos=True)
    prompts = [_prompt(rng, n) for n in (9, 40)]
    resident = Engine.load(tmp_path, policy="resident", **CUDA).generate(prompts, sp)
    plain = _loader(tmp_path, policy=policy, expert_slots=rng.randint(5, 20))

    def load(overlap: bool) -> Engine:
        engine = plain(overlap)
        if policy == "adaptive":  # its segmented graphs are the stops path (it warms on device)
            engine.loaded.bank.adaptive.path_params = {"fixed": "stops"}
        return engine

    events, engine = both_loops(load, {0: [(p, sp, {}) for p in prompts]})
    whole_step = policy == "gpu-fill"  # one graph a step, its layers fill their own misses
    graphs = {"gpu-fill": DirectDecodeGraphs, "adaptive": PathDecodeGraphs}.get(
        policy, SegmentedDecodeGraphs
    )
    assert isinstance(engine.runner.graphs, graphs)
    assert [[e[1] for e in evs] for evs in events.values()] == [o.token_ids for o in resident]
    assert engine.overlap.lagged_steps >= sp.max_tokens - 3
    if whole_step:
        assert engine.stats()["experts"]["fetched"] > 0
    else:
        assert engine.runner.graphs.missed_layers > 0  # stops ran with a step completed inside
