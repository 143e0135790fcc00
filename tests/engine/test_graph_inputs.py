"""The decode graphs' static inputs (engine/graph_inputs.py): one packed copy a step puts the
step's rows and the padding rows where the graphs read them (CPU tensors here; the device
tests replay real graphs on it)."""

from __future__ import annotations

import random

import numpy as np
import torch

from freetoken_agent.engine.graph_inputs import GraphInputs
from freetoken_agent.engine.kv.pool import SCRATCH_PAGE
from freetoken_agent.engine.runner import StepInputs


def _step(rng: random.Random, b: int, max_pages: int, s: int) -> StepInputs:
    n_pages = [rng.randint(1, max_pages) for _ in range(b)]
    width = max(n_pages)
    table = np.full((b, width), SCRATCH_PAGE, dtype=np.int32)
    for row, n in zip(table, n_pages, strict=True):
        row[:n] = rng.sample(range(1, 10000), n)
    kv = np.array([rng.randint((n - 1) * s + 1, n * s) for n in n_pages], dtype=np.int32)
    pos = kv.astype(np.int64) - 1
    slots = np.array([table[i, p // s] * s + p % s for i, p in enumerate(pos)], dtype=np.int64)
    return StepInputs(
        input_ids=np.array([rng.randrange(50000) for _ in range(b)], dtype=np.int64),
        positions=pos, slot_mapping=slots, page_table=table,
        cu_q_lens=np.arange(b + 1, dtype=np.int32), kv_lens=kv, max_q_len=1,
        max_kv_len=int(kv.max()), state_slots=np.array(rng.sample(range(1, 99), b)),
        snap_slots=None,
    )  # fmt: skip


def test_each_load_puts_the_step_and_its_padding_where_the_graphs_read(rng_seed):
    rng = random.Random(rng_seed)
    n, max_pages, s = rng.choice([1, 4, 8]), rng.randint(1, 40), rng.choice([1, 16])
    io = GraphInputs(n, max_pages, s, torch.device("cpu"))
    for _ in range(20):
        b = rng.randint(1, n)
        bs = rng.randint(b, n)  # the padded size of the graph that replays
        step = _step(rng, b, max_pages, s)
        before = io.page_table.clone()
        io.load(step, bs)
        for name in ("input_ids", "positions", "slot_mapping", "kv_lens", "state_slots"):
            got = getattr(io, name)
            assert got[:b].tolist() == getattr(step, name).tolist(), name
        width = step.page_table.shape[1]
        assert io.page_table[:b, :width].tolist() == step.page_table.tolist()
        # Padding rows: the scratch page with one token, nothing of a live sequence.
        pad = slice(b, bs)
        assert (io.page_table[pad, 0] == SCRATCH_PAGE).all() and (io.kv_lens[pad] == 1).all()
        assert (io.slot_mapping[pad] == SCRATCH_PAGE * s).all()
        assert not io.input_ids[pad].any() and not io.positions[pad].any()
        assert not io.state_slots[pad].any()
        # Columns past a row's pages keep what they held: the kernels read only kv_len's pages.
        assert torch.equal(io.page_table[:b, width:], before[:b, width:])
