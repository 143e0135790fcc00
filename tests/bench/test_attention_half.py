"""bench attention-half times the engine's attention block kernel against the decoder's five
steps on the bench's own inputs (an identity page table: position pos in slot pos): both rows
compute the same (h, s) and the same new K/V there (Triton's interpreter runs the kernel's
phases on the CPU)."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.bench.attention_half import (
    block,
    engine_steps,
    make_cache,
    make_layer,
    rope_tables,
)
from freetoken_agent.kernels.attention_block import block_tiles
from freetoken_agent.kernels.triton.attention_block import new_scratch

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_the_bench_rows_compute_the_same_block(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    h, heads, kv_heads, d = 64, 4, 2, 16
    pos = int(torch.randint(0, 50, (1,), generator=gen))
    layer = make_layer(h, heads, kv_heads, d, torch.float32, "cpu", gen)
    cache = make_cache(pos, pos + 1, kv_heads, d, torch.float32, "cpu", gen)
    cos, sin = rope_tables(d, pos + 1, torch.float32, "cpu")
    x, r = torch.randn(1, h, generator=gen), torch.randn(1, h, generator=gen)
    ref = make_cache(pos, pos + 1, kv_heads, d, torch.float32, "cpu", gen)
    ref.k, ref.v = cache.k.clone(), cache.v.clone()
    want = engine_steps(x, r, layer, cos, sin, ref, heads)
    tiles = block_tiles(h, heads, kv_heads, d)
    scratch = new_scratch(h, heads, kv_heads, d, 5, tiles, torch.float32, "cpu")
    got = block(x, r, layer, cos, sin, cache, heads, scratch, tiles, persistent=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    for c, w in ((cache.k, ref.k), (cache.v, ref.v)):
        c, w = c.view(-1, kv_heads, d), w.view(-1, kv_heads, d)
        torch.testing.assert_close(c[: pos + 1], w[: pos + 1], atol=1e-4, rtol=1e-4)


def test_rows_beside_copy_take_the_median_round(rng_seed, capsys):
    """The probes' rows (bench/cuda_graph.rows_beside_copy): the median of a row's rounds, its
    bytes over that time, and their share of the copy rate."""
    from freetoken_agent.bench.cuda_graph import rows_beside_copy

    gen = torch.Generator().manual_seed(rng_seed)
    ms = (torch.rand(5, generator=gen) * 0.05 + 0.01).tolist()  # ms a layer, five rounds
    nbytes, hbm = int(torch.randint(10**6, 10**8, (1,), generator=gen)), 4.0e12
    row = rows_beside_copy({"r": ms}, nbytes, hbm, label="x ")["r"]
    median = sorted(ms)[2]
    assert row["us_per_layer"] == pytest.approx(1e3 * median)
    assert row["gb_s"] == pytest.approx(nbytes / (median * 1e-3) / 1e9)
    assert row["of_copy"] == pytest.approx(row["gb_s"] * 1e9 / hbm)
    assert row["rounds_us"] == pytest.approx([1e3 * t for t in ms])
    assert capsys.readouterr().out.startswith("x r")
