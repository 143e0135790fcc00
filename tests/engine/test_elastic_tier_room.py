"""The checkpoint tier (hybrid models, elastic memory) is sized before the split, on the KV side:
it counted an idle engine's pages as the one it holds, where the split counts the two the
engine always keeps. With a budget's slack within a page of a checkpoint row, the tier took a
second row from the bytes a waiting request's pages needed, the split shrank the KV to make up
for it, and the request failed ("raise the budget") at a budget that serves it with a smaller
or a larger slack."""

from __future__ import annotations

import random

from elastic_engines import elastic_engine
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams


def test_the_tier_leaves_a_waiting_requests_pages_their_room(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_5_moe", tmp_path, rng_seed, max_position_embeddings=1024)
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(90, 120))]
    sp = SamplingParams(max_tokens=rng.randint(8, 20), temperature=0, ignore_eos=True)
    want = Engine.load(tmp_path, device="cpu", progress=False).generate(prompt, sp).token_ids
    engine = elastic_engine(tmp_path, rng.choice(["anchors", "positional:8"]))
    m = engine.memory
    page, row = m.arena.kv_unit.nbytes, m.tier.row_bytes
    assert row > page  # the window below exists
    pages = -(-(len(prompt) + sp.max_tokens) // engine.config.page_size)
    slack = rng.randint(row - page + 1, row - 1)  # one row does not fit beside the pages
    engine.set_gpu_budget(m.floor + pages * page + slack)  # idle: applied at once
    out = engine.generate(prompt, sp)
    assert out.error is None and out.token_ids == want
    engine.check_integrity()
