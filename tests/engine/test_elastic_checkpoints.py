"""Elastic memory with a hybrid model: the checkpoints' device tier is on the KV side of the
split. It grows as a session's anchors add checkpoints (up to a 16th of the budget), its rows
counted with the pages and slots; a budget cut shrinks it (the least recently used checkpoints
spill to the host tier) and a follow-up turn still resumes exactly; every pool stays intact."""

from __future__ import annotations

import random

from elastic_engines import elastic_engine
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_checkpoint_rows_follow_the_session_and_the_budget(tmp_path, rng_seed):
    make_tiny("qwen3_5_moe", tmp_path, rng_seed, max_position_embeddings=2048)
    rng = random.Random(rng_seed)
    engine = elastic_engine(tmp_path, "anchors")
    m, pool = engine.memory, engine.loaded.recurrence.checkpoints
    top = m.user_budget
    assert m.checkpoints is pool and pool.resizable
    per = m.tier.row_bytes
    seqs = engine.config.max_num_seqs
    rows_seen, history = [], []
    for _ in range(rng.randint(4, 6)):  # agent turns: history + new tokens, anchored twice
        history += [rng.randrange(3, 320) for _ in range(rng.randint(20, 60))]
        anchors = sorted({len(history), rng.randint(1, len(history) - 1)})
        out = engine.generate(history, SP, anchors=anchors)
        history += out.token_ids
        engine.poll_memory()  # the idle safe point: the tier settles to its demand
        engine.check_integrity()
        rows_seen.append(pool.device_rows)
        cap = (m.budget // 16) // per
        assert pool.device_rows == max(1, min(cap, pool.device_used + seqs))
        assert m.held_bytes() <= m.budget
    assert rows_seen == sorted(rows_seen) and rows_seen[-1] > rows_seen[0]
    records = [r for r in m.trace.records if r.reason == "checkpoints"]
    assert records and records[-1].checkpoint_bytes == pool.device_bytes

    # A cut to the floor and a few rows: slots are already at their fewest, so the tier
    # shrinks and the least recently used checkpoints spill to the host tier.
    held = pool.device_used
    keep = rng.randint(1, 3)
    engine.set_gpu_budget(m.floor + (keep - 1) * per)
    assert 1 <= pool.device_rows <= keep + 1 < rows_seen[-1]  # cached KV may come first
    st = pool.stats()
    assert st["spilled"] + st["dropped"] >= held - pool.device_rows > 0
    assert m.held_bytes() <= m.budget
    engine.check_integrity()

    # The budget back: the session goes on exactly (resuming where its checkpoints and KV
    # survived), and the next turns' checkpoints grow the tier again.
    engine.set_gpu_budget(top)
    follow = history + [rng.randrange(3, 320) for _ in range(rng.randint(5, 30))]
    out = engine.generate(follow, SP, anchors=[len(follow)])
    cold = Engine.load(tmp_path, device="cpu", progress=False, checkpoints="none")
    assert out.token_ids == cold.generate(follow, SP).token_ids
    engine.check_integrity()
    for _ in range(2):
        follow += out.token_ids + [rng.randrange(3, 320) for _ in range(rng.randint(5, 30))]
        out = engine.generate(follow, SP, anchors=[len(follow)])
        engine.poll_memory()
        engine.check_integrity()
    assert pool.device_rows > keep + 1
    assert pool.device_rows == max(1, min((m.budget // 16) // per, pool.device_used + seqs))
