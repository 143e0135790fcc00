"""A step's host arrays (runner.build_inputs): the decode fast path and the general path give
what a plain per-token construction gives, from page tables kept as cached arrays
(Request.page_array) that follow the page lists as the scheduler grows and replaces them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from freetoken_agent.engine.kv.pool import SCRATCH_PAGE
from freetoken_agent.engine.request import Request, ScheduledChunk
from freetoken_agent.engine.runner import build_inputs
from freetoken_agent.engine.sampling_params import SamplingParams


def _plain(chunks: list[ScheduledChunk], s: int) -> dict:
    """The arrays built token by token from the page lists."""
    ids, pos, slots = [], [], []
    for c in chunks:
        for j, tok in enumerate(c.token_ids):
            p = c.start + j
            ids.append(tok), pos.append(p), slots.append(c.request.pages[p // s] * s + p % s)
    width = max(1, *(len(c.request.pages) for c in chunks))
    table = [c.request.pages + [SCRATCH_PAGE] * (width - len(c.request.pages)) for c in chunks]
    q = [len(c.token_ids) for c in chunks]
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, page_table=table,
                cu_q_lens=[0, *np.cumsum(q).tolist()],
                kv_lens=[c.start + len(c.token_ids) for c in chunks], max_q_len=max(q),
                max_kv_len=max(c.start + len(c.token_ids) for c in chunks),
                state_slots=[c.request.state_slot for c in chunks])  # fmt: skip


@pytest.mark.parametrize("decode", [True, False])
def test_step_arrays_match_a_plain_construction_as_pages_change(rng_seed, decode):
    rng = random.Random(rng_seed)
    s = rng.choice([1, 4, 16])
    requests = [Request(f"r{i}", [1], SamplingParams()) for i in range(rng.randint(1, 5))]
    free = list(range(1, 100000))
    rng.shuffle(free)
    for req in requests:
        req.pages, req.state_slot = (
            [free.pop() for _ in range(rng.randint(1, 40))],
            rng.randrange(9),
        )
    for _ in range(30):
        chunks = []
        for req in requests:  # as the scheduler and kv/vacate.py change pages between steps
            what = rng.random()
            if what < 0.4:
                req.pages.append(free.pop())
            elif what < 0.55:
                req.pages.extend(free.pop() for _ in range(rng.randint(1, 6)))
            elif what < 0.7:  # a new list (prefix reuse, vacate's moves, preemption)
                req.pages = [free.pop() for _ in range(rng.randint(1, 40))]
            capacity = len(req.pages) * s
            n = 1 if decode else rng.randint(1, min(capacity, 9))
            chunks.append(ScheduledChunk(req, rng.randrange(capacity - n + 1),
                                         [rng.randrange(500) for _ in range(n)], True))  # fmt: skip
        got, want = build_inputs(chunks, s), _plain(chunks, s)
        for name, value in want.items():
            assert np.asarray(getattr(got, name)).tolist() == value, name
        assert got.snap_slots is None
        for req in requests:
            req.check_page_mirror()


def test_the_mirror_check_catches_a_page_changed_in_place(rng_seed):
    rng = random.Random(rng_seed)
    req = Request("r", [1], SamplingParams())
    req.pages = rng.sample(range(1000), rng.randint(2, 30))
    assert req.page_array().tolist() == req.pages
    req.pages[rng.randrange(len(req.pages))] = 1000 + rng.randrange(9)  # never done: replaced
    with pytest.raises(AssertionError, match="mirror stale"):
        req.check_page_mirror()
