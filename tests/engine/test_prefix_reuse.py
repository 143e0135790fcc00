"""Prefix reuse through the radix cache: only the suffix is prefilled, outputs equal a cold run,
and evicted pages really return to the allocator."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture
def setup(tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    return tmp_path, random.Random(rng_seed)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 320) for _ in range(n)]


def test_shared_prefix_prefills_only_suffix(setup):
    path, rng = setup
    engine = Engine.load(path, device="cpu", progress=False, kv_tokens=4096)
    prefix = _tokens(rng, 200)
    a, b = _tokens(rng, 30), _tokens(rng, 25)
    b[0] = (a[0] + 1) % 317 + 3  # the suffixes differ from their first token
    first = engine.generate(prefix + a, GREEDY)
    assert first.stats["reused_tokens"] == 0
    assert first.stats["prefilled_tokens"] == 230
    second = engine.generate(prefix + b, GREEDY)
    assert second.stats["reused_tokens"] == 200
    assert second.stats["prefilled_tokens"] == 25
    engine.check_integrity()
    cold = Engine.load(path, device="cpu", progress=False, kv_tokens=4096)
    assert cold.generate(prefix + b, GREEDY).token_ids == second.token_ids
    stats = engine.stats()["tokens"]
    assert stats["reused"] == 200 and stats["prefilled"] == 255


def test_follow_up_turn_reuses_generated_tokens(setup):
    """A chat follow-up (prompt + answer + new message) reuses the answer's KV too."""
    path, rng = setup
    engine = Engine.load(path, device="cpu", progress=False, kv_tokens=4096)
    prompt = _tokens(rng, 50)
    answer = engine.generate(prompt, GREEDY).token_ids
    follow = prompt + answer + _tokens(rng, 9)
    out = engine.generate(follow, GREEDY)
    # Everything but the last answer token (whose K/V was never computed) is reused.
    assert out.stats["reused_tokens"] == len(prompt) + len(answer) - 1
    cold = Engine.load(path, device="cpu", progress=False, kv_tokens=4096)
    assert cold.generate(follow, GREEDY).token_ids == out.token_ids


def test_eviction_frees_pages(setup):
    path, rng = setup
    # 24 usable pages of 16 tokens: every request evicts earlier ones' cached pages.
    engine = Engine.load(path, device="cpu", progress=False, kv_pages=25, max_num_seqs=4)
    alloc, radix = engine.kv.allocator, engine.radix
    for _ in range(12):
        engine.generate(_tokens(rng, rng.randrange(20, 200)), GREEDY)
        engine.check_integrity()
        assert alloc.n_free + radix.n_pages == alloc.capacity
    # Concurrent requests under pressure: preemption and eviction, still consistent.
    outs = engine.generate([_tokens(rng, rng.randrange(30, 120)) for _ in range(6)], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    engine.check_integrity()
    assert alloc.n_free + radix.n_pages == alloc.capacity
    freed = radix.reset()
    assert radix.n_pages == 0 and alloc.n_free == alloc.capacity and freed > 0
    engine.check_integrity()


def test_preempted_requests_match_unpressured_run(setup):
    path, rng = setup
    # The four short prompts (3-4 pages of 16 tokens each) come first: at least three are
    # admitted together, and their 40-token decodes outgrow the 14 pages (each grows to 6-7).
    # The two long ones wait behind them. (Shuffled all together, a long prompt third in line
    # held the queue behind two short ones that fit, and nothing was preempted: seed 88513644.)
    prompts = [_tokens(rng, rng.randrange(40, 60)) for _ in range(4)]
    prompts += [_tokens(rng, rng.randrange(100, 150)) for _ in range(2)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = Engine.load(path, device="cpu", progress=False, kv_tokens=8192)
    ref = [o.token_ids for o in roomy.generate(prompts, sp)]
    tight = Engine.load(path, device="cpu", progress=False, kv_pages=14, max_num_seqs=6)
    got = [o.token_ids for o in tight.generate(prompts, sp)]
    assert got == ref
    assert tight.stats()["requests"]["preemptions"] > 0
    tight.check_integrity()


def test_a_full_pool_evicts_a_batch_at_a_time(tmp_path, rng_seed):
    """Once the pool is full of cached prefixes, a decoding request crossing into a new page
    evicts: each eviction walks the whole tree, so a crossing frees a batch of the coldest
    pages (1/EVICT_BATCH of the pool) and the next crossings take them without a walk (it
    walked once per crossing). The tokens are a fresh engine's."""
    from freetoken_agent.engine.scheduler import EVICT_BATCH

    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed, max_position_embeddings=4096)
    engine = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=8192,
                         max_model_len=2048)  # fmt: skip
    pool = engine.kv.allocator
    batch = pool.capacity // EVICT_BATCH
    assert batch >= 4, "the pool is too small to batch: the test is void"
    fill = SamplingParams(max_tokens=1, temperature=0)
    while pool.n_free > engine.kv.page_size:  # distinct prefixes until the pool is full
        engine.generate([rng.randrange(3, 320) for _ in range(rng.randint(100, 300))], fill)
    walks = []
    evict = engine.scheduler.radix.evict

    def counted(n_pages):
        walks.append(n_pages)
        return evict(n_pages)

    engine.scheduler.radix.evict = counted
    prompt = [rng.randrange(3, 320) for _ in range(rng.randint(20, 60))]
    sp = SamplingParams(max_tokens=rng.randint(8, 12) * engine.kv.page_size, temperature=0,
                        ignore_eos=True)  # fmt: skip
    out = engine.generate(prompt, sp)
    crossings = sp.max_tokens // engine.kv.page_size
    assert len(walks) <= 1 + crossings // batch, (walks, crossings, batch)
    fresh = Engine.load(tmp_path, device="cpu", progress=False, kv_tokens=8192,
                        max_model_len=2048)  # fmt: skip
    assert out.token_ids == fresh.generate(prompt, sp).token_ids
    engine.check_integrity()
