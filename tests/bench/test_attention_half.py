"""bench attention-half's probe computes what the engine's attention half of a layer computes
for one decode token (the engine's kernels called as the decoder calls them, their plain-torch
twins on the CPU): the outputs, the new K/V in the cache, the counters back at 0. Its phases
run as three launches in Triton's interpreter (a grid-wide wait cannot: programs run one after
another there); the one persistent launch runs on CUDA only."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.bench.attention_half import (
    DEFAULT_TILES,
    attention_half,
    engine_steps,
    make_cache,
    make_layer,
    new_scratch,
    rope_tables,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# A small shape whose tiles still take several rounds of the programs' loops: NQKV = 128 rows
# in 8 blocks x 2 slices over 7 programs, o_proj 4 blocks x 2 slices, two K steps a tile.
SMALL = dict(h=64, heads=4, kv_heads=2, d=16)
SMALL_TILES = dict(BN1=16, KS1=2, BK=16, BL=16, BN3=16, KS3=2)


def _case(gen: torch.Generator, dtype: torch.dtype, device: str, pos: int, shape: dict):
    layer = make_layer(shape["h"], shape["heads"], shape["kv_heads"], shape["d"], dtype, device,
                       gen)  # fmt: skip
    cache = make_cache(pos, pos + 8, shape["kv_heads"], shape["d"], dtype, device, gen)
    cos, sin = rope_tables(shape["d"], pos + 8, dtype, device)
    x = torch.randn(1, shape["h"], generator=gen).to(dtype).to(device)
    r = torch.randn(1, shape["h"], generator=gen).to(dtype).to(device)
    return layer, cache, cos, sin, x, r


def _check(got, want, got_cache, want_cache, pos, tol):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float().cpu(), w.float().cpu(), atol=tol, rtol=tol)
    kv = got_cache.k.shape[2:]
    for g, w in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        g, w = g.view(-1, *kv).float().cpu(), w.view(-1, *kv).float().cpu()
        torch.testing.assert_close(g[: pos + 1], w[: pos + 1], atol=tol, rtol=tol)
        assert g[pos + 1 :].isnan().all(), "a slot past the new token was written"


@pytest.mark.parametrize("stream", [0, 1], ids=["tile-loops", "stream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_phases_are_the_engines_attention_half(rng_seed, dtype, stream):
    """Random positions from 0 (only the new token) to several splits' tiles, splits that
    outnumber the cached tokens now and then; fp16 rounds where the engine rounds, with sums
    in other orders (an ulp of fp16 at a rounding point, carried through the norm)."""
    gen = torch.Generator().manual_seed(rng_seed)
    pos = int(torch.randint(0, 70, (1,), generator=gen))
    splits = int(torch.randint(1, 4, (1,), generator=gen))
    layer, cache, cos, sin, x, r = _case(gen, dtype, "cpu", pos, SMALL)
    ref_cache = make_cache(0, 1, 1, 1, dtype, "cpu", gen)
    ref_cache.k, ref_cache.v = cache.k.clone(), cache.v.clone()
    for name in ("pos", "page_table", "cu_q_lens", "kv_lens"):
        setattr(ref_cache, name, getattr(cache, name))
    want = engine_steps(x, r, layer, cos, sin, ref_cache, SMALL["heads"])
    scratch = new_scratch(SMALL["h"], SMALL["heads"], SMALL["kv_heads"], SMALL["d"], 7, splits,
                          SMALL_TILES, dtype, "cpu")  # fmt: skip
    got = attention_half(x, r, layer, cos, sin, cache, SMALL["heads"], scratch,
                         persistent=False, tiles={**SMALL_TILES, "STREAM": stream})  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _check(got, want, cache, ref_cache, pos, tol)
    assert (scratch.count == 0).all(), scratch.count


def test_a_second_launch_on_the_same_scratch_is_the_engines(rng_seed):
    """The counters a launch leaves (all 0) serve the next: a second token at pos + 1 on the
    same scratch and cache, fp32."""
    gen = torch.Generator().manual_seed(rng_seed)
    pos = int(torch.randint(3, 40, (1,), generator=gen))
    layer, cache, cos, sin, x, r = _case(gen, torch.float32, "cpu", pos, SMALL)
    scratch = new_scratch(SMALL["h"], SMALL["heads"], SMALL["kv_heads"], SMALL["d"], 7, 2,
                          SMALL_TILES, torch.float32, "cpu")  # fmt: skip
    attention_half(x, r, layer, cos, sin, cache, SMALL["heads"], scratch, persistent=False,
                   tiles=SMALL_TILES)  # fmt: skip
    ref = make_cache(0, 1, 1, 1, torch.float32, "cpu", gen)
    ref.k, ref.v = cache.k.clone(), cache.v.clone()
    for c in (cache, ref):
        c.pos, c.kv_lens = c.pos * 0 + pos + 1, c.kv_lens * 0 + pos + 2
    ref.page_table, ref.cu_q_lens = cache.page_table, cache.cu_q_lens
    x2 = torch.randn(1, SMALL["h"], generator=gen)
    want = engine_steps(x2, r, layer, cos, sin, ref, SMALL["heads"])
    got = attention_half(x2, r, layer, cos, sin, cache, SMALL["heads"], scratch,
                         persistent=False, tiles=SMALL_TILES)  # fmt: skip
    _check(got, want, cache, ref, pos + 1, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_the_persistent_launch_is_the_phases_on_cuda(rng_seed, ahead):
    """At the 30B shape in bf16 on every SM: the one launch gives the three launches' bits
    (the same sums in the same order), within bf16 roundings of the engine's, and leaves the
    counters at 0; twice in a row."""
    gen = torch.Generator().manual_seed(rng_seed)
    s = dict(h=2048, heads=32, kv_heads=4, d=128)
    pos = int(torch.randint(100, 1500, (1,), generator=gen))
    dt = torch.bfloat16
    layer, cache, cos, sin, x, r = _case(gen, dt, "cuda", pos, s)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    scratch = new_scratch(s["h"], s["heads"], s["kv_heads"], s["d"], programs, 8, DEFAULT_TILES,
                          dt, "cuda")  # fmt: skip
    ref = make_cache(0, 1, 1, 1, dt, "cuda", gen)
    ref.k, ref.v = cache.k.clone(), cache.v.clone()
    for name in ("pos", "page_table", "cu_q_lens", "kv_lens"):
        setattr(ref, name, getattr(cache, name))
    want = engine_steps(x, r, layer, cos, sin, ref, s["heads"])
    phases = attention_half(x, r, layer, cos, sin, cache, s["heads"], scratch, persistent=False)
    for _ in range(2):
        got = attention_half(x, r, layer, cos, sin, cache, s["heads"], scratch, persistent=True,
                             ahead=ahead)  # fmt: skip
        torch.cuda.synchronize()
        for g, p in zip(got, phases, strict=True):
            assert torch.equal(g, p)
        assert (scratch.count == 0).all(), scratch.count
    _check(got, want, cache, ref, pos, 5e-2)
