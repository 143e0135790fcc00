"""The thinking budget on CUDA (device machine): decode steps replayed from captured graphs
under overlap scheduling, on the demo model (its tokenizer has the think tokens), resident and
offloaded (transfer: every miss fetched, so the tokens do not depend on timing). After
`budget` tokens of the block the forced close follows (unless the model closed it itself);
alone, a budgeted request's first `budget` tokens are the unbudgeted one's; the plain and the
overlapped loop give the same events."""

from __future__ import annotations

import random

import pytest
from overlap_runs import both_loops
from thinking_model import forced_close_at

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.thinking_budget import MAX_WAIT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("policy", ["resident", "transfer"])
def test_the_forced_close_on_cuda(tmp_path, rng_seed, policy):
    rng = random.Random(rng_seed)
    path = ensure_demo_model(tmp_path)
    options = dict(device="cuda", progress=False, max_model_len=512, max_num_seqs=4,
                   policy=policy)  # fmt: skip
    if policy == "transfer":  # a few slots: misses fetched every step
        options["expert_slots"] = rng.randint(3, 10)

    def load(overlap: bool) -> Engine:
        return Engine.load(path, overlap_schedule=overlap, **options)

    engine = load(False)
    assert engine.runner.graphs is not None  # the decode steps replay graphs
    m = engine.thinking
    tail = engine.tokenizer.encode("<|im_start|>assistant\n<think>\n")
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(3, 20))] + tail
               for _ in range(3)]  # fmt: skip
    budgets = [rng.randint(0, 12) for _ in prompts]
    most = max(budgets) + MAX_WAIT + len(m.forced) + rng.randint(1, 6)
    common = {"temperature": 0, "ignore_eos": True, "max_tokens": most}
    plan = {0: [(p, SamplingParams(thinking_token_budget=b, **common), {})
                for p, b in zip(prompts, budgets, strict=True)]}  # fmt: skip
    events, lagged = both_loops(load, plan)
    assert lagged.overlap.lagged_steps > 0
    got = [events[rid] for rid in sorted(events, key=lambda r: int(r.split("-")[1]))]
    tokens = [[t for _, t, *_ in e if t is not None] for e in got]
    for t, b in zip(tokens, budgets, strict=True):
        assert len(t) == most
        if m.close_id not in t[:b]:  # not closed by the model: the close follows the budget
            forced_close_at(t, m.forced, b, MAX_WAIT, engine.tokenizer.decode)
    # Alone, the same request without a budget gives the same tokens up to the budget (the
    # same shapes on the same graphs: nothing differs before the first forced token).
    alone = engine.generate(prompts[0], SamplingParams(**common)).token_ids
    budgeted = engine.generate(
        prompts[0], SamplingParams(thinking_token_budget=budgets[0], **common)
    ).token_ids
    assert budgeted[: budgets[0]] == alone[: budgets[0]], rng_seed
