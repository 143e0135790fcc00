"""What a CheckpointPool reports about itself: its figures (`stats`, read into `Engine.stats()`)
and the invariants of its two tiers (`check_integrity`, which the tests assert after random
sequences of pool calls and through `Engine.check_integrity`).

Both only read the pool's tables and change nothing, and neither runs on the scheduler's path,
so they live apart from checkpoints.py, which moves checkpoints between rows and tiers;
`CheckpointPool.stats` and `CheckpointPool.check_integrity` delegate here.
"""

from __future__ import annotations

from freetoken_agent.engine.kv.checkpoint_lanes import lane_spans
from freetoken_agent.engine.kv.checkpoints import DEVICE, HOST, CheckpointPool


def pool_stats(pool: CheckpointPool) -> dict:
    """Rows used and locked in each tier, their bytes, and the pool's counters."""
    device_used = pool.device_rows - len(pool._free[DEVICE])
    host_used = pool.host_rows - len(pool._free[HOST])
    return {
        "bytes_per_checkpoint": pool.bytes_per_checkpoint(
            pool.n_layers, pool.conv_shape, pool.ssm_shape, pool.dtype
        ),
        "device_rows": pool.device_rows,
        "device_used": device_used,
        "device_locked": sum(1 for c in pool._rows[DEVICE] if c is not None and c.locks),
        "host_rows": pool.host_rows,
        "host_used": host_used,
        "host_pinned": pool.pinned,
        "device_bytes": pool.device_bytes,
        "max_device_rows": pool.max_device_rows,
        "host_bytes": pool.host_conv.nbytes + pool.host_ssm.nbytes,
        **pool._counts,
    }


def check_pool_integrity(pool: CheckpointPool) -> None:
    """Every row is used or free, never both; each checkpoint names the row that holds it;
    the tensors have the tiers' shapes and the usable device rows are backed."""
    for tier, size in ((DEVICE, pool.device_rows), (HOST, pool.host_rows)):
        rows, free = pool._rows[tier], pool._free[tier]
        assert len(rows) == size, f"{tier} tier has {len(rows)} row entries, not {size}"
        assert len(set(free)) == len(free), f"duplicate rows in the {tier} free list"
        assert all(0 <= r < size for r in free), f"{tier} free list holds a row out of range"
        used = {r for r, c in enumerate(rows) if c is not None}
        assert not used & set(free), f"a used {tier} row is also on the free list"
        assert len(used) + len(free) == size, f"{tier} rows lost: neither used nor free"
        for r, c in enumerate(rows):
            if c is None:
                continue
            assert c.tier == tier and c.row == r, (
                f"{tier} row {r} holds a checkpoint that says {c.tier} row {c.row}"
            )
            assert c.locks >= 0, "negative lock count"
            assert 0 < c.last_used <= pool._now, "LRU clock from the future"
    live = [c for t in (DEVICE, HOST) for c in pool._rows[t] if c is not None]
    assert len({id(c) for c in live}) == len(live), "one checkpoint holds two rows"
    ids = {id(c) for c in live}
    for c in pool._doomed:
        assert id(c) in ids and c.locks > 0, "a released checkpoint outlived its locks"
    rows = pool.max_device_rows if pool._lanes else pool.device_rows
    assert pool.conv.shape[:2] == pool.ssm.shape[:2] == (pool.n_layers, rows)
    assert pool.device_rows <= rows and (pool.device_rows >= 1 or not pool._lanes)
    # The usable rows are backed; lane row 0 (the views' base) above all.
    assert all(m.is_mapped(lo, hi) for m, lo, hi in lane_spans(pool, 0, pool.device_rows)), (
        "a usable checkpoint row is not backed by memory"
    )
    assert pool.host_conv.shape[:2] == pool.host_ssm.shape[:2] == (pool.host_rows, pool.n_layers)
