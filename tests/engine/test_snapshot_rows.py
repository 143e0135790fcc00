"""snapshot_rows: where a prefill chunk ends and which of its boundaries get the checkpoint
rows there are, on random boundaries, chunk lengths and row counts."""

from __future__ import annotations

import math
import random

from freetoken_agent.engine.snapshot_rows import MIN_KEPT, chunk_length, kept_boundaries


def _case(rng: random.Random) -> tuple[list[int], int, int, int]:
    start, n = rng.randrange(0, 500), rng.randrange(1, 300)
    k = rng.randrange(0, min(n, 40) + 1)
    boundaries = sorted(rng.sample(range(start + 1, start + n + 1), k))
    return boundaries, start, n, rng.randrange(0, 12)


def test_kept_boundaries_spread_over_the_chunk(rng_seed):
    """All of them when they fit; else exactly `rows`, sorted, the first and the last among
    them (one row: the deepest), no two kept ones further apart in the list than the even
    spacing allows."""
    rng = random.Random(rng_seed)
    for _ in range(2000):
        boundaries, _, _, rows = _case(rng)
        kept = kept_boundaries(boundaries, rows)
        k = len(boundaries)
        if k <= rows:
            assert kept == boundaries
            continue
        assert len(kept) == rows and kept == sorted(set(kept)) and set(kept) <= set(boundaries)
        if rows == 1:
            assert kept == [boundaries[-1]]
        elif rows > 1:
            assert kept[0] == boundaries[0] and kept[-1] == boundaries[-1]
            places = [boundaries.index(b) for b in kept]
            spacing = math.ceil((k - 1) / (rows - 1))
            gaps = [b - a for a, b in zip(places, places[1:], strict=False)]
            assert max(gaps) <= spacing, (boundaries, rows)


def test_a_chunk_ends_early_only_at_a_boundary_that_keeps_most_of_it(rng_seed):
    """The chunk keeps its length when its boundaries fit the rows; with no row free, it ends
    right before its first boundary (keeping it for the next step), unless that leaves no
    token; otherwise it ends exactly at the last boundary that gets a row when that keeps at
    least MIN_KEPT of its tokens, and keeps its length when it would not."""
    rng = random.Random(rng_seed)
    cuts = 0
    for _ in range(4000):
        boundaries, start, n, rows = _case(rng)
        length = chunk_length(boundaries, start, n, rows)
        if len(boundaries) <= rows:
            assert length == n
            continue
        if rows < 1:
            short = boundaries[0] - 1 - start
            assert length == (short if short >= 1 else n), (boundaries, start, n)
            assert not [b for b in boundaries if b <= start + length] or length == n
            continue
        end = boundaries[rows - 1]
        if end - start >= MIN_KEPT * n:
            assert length == end - start and length <= n
            inside = [b for b in boundaries if b <= start + length]
            assert len(inside) == rows  # every one of them gets a row
            cuts += 1
        else:
            assert length == n
    assert cuts > 0  # the draws reached the early end
