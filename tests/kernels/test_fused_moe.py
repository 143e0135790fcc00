"""Fused MoE: reference vs a float64 loop, Triton (interpreted on CPUs) vs reference, determinism.

Shape legend: T tokens, H hidden, I expert width, N bank rows, K top-k, P = T * K pairs.
Interpreted tests use fp32/fp16 (the interpreter gets bf16 wrong); bf16 runs in the gpu tests.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from sm90_compile import compiled_json

from freetoken_agent.kernels import fused_moe as dispatcher
from freetoken_agent.kernels.fused_moe import PATH_LIMITS, fused_moe
from freetoken_agent.kernels.reference import fused_moe as fused_moe_reference

triton_moe = pytest.importorskip("freetoken_agent.kernels.triton.fused_moe")

# Small tiles so the interpreter walks several H / I steps, row blocks and masked tails.
SMALL_DECODE = dict(BLOCK_M=16, BLOCK_I=16, BLOCK_H=32, BLOCK_N=16, BLOCK_K=16, SUM_BLOCK=32)
SMALL_PREFILL = dict(
    BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, DOWN_BLOCK_N=32, DOWN_BLOCK_K=16, SUM_BLOCK=32
)
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative norm error


def make_inputs(
    seed: int,
    t: int,
    h: int,
    i: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    *,
    used_rows: int | None = None,
    skip: float = 0.0,
    device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Random hidden [T, H], banks, distinct rows per token drawn from `used_rows` of the N rows
    (the rest get no tokens), a fraction `skip` of the pairs set to -1, softmax weights."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g)
    # std 2/sqrt(fan_in) (0.044 at H=2048) keeps gate, act and out O(1) at every size.
    w13 = torch.randn(n, 2 * i, h, generator=g) * (2 / h**0.5)
    w2 = torch.randn(n, h, i, generator=g) * (2 / i**0.5)
    rows = torch.randperm(n, generator=g)[: used_rows or n]
    ids = rows[torch.rand(t, len(rows), generator=g).topk(k, dim=1).indices]  # [T, K]
    ids[torch.rand(t, k, generator=g) < skip] = -1
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)  # [T, K] fp32
    cast = lambda x: x.to(device=device, dtype=dtype).contiguous()
    return cast(hidden), cast(w13), cast(w2), ids.to(device), weights.to(device)


def naive_f64(hidden, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """Token by token, pair by pair, in float64."""
    t, h = hidden.shape
    i = w13.shape[1] // 2
    out = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        x = hidden[tok].cpu().double()
        for j, row in enumerate(topk_ids[tok].tolist()):
            if row < 0:
                continue
            w = w13[row].cpu().double()
            act = F.silu(w[:i] @ x) * (w[i:] @ x)  # [I]
            out[tok] += float(topk_weights[tok, j]) * (w2[row].cpu().double() @ act)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double().cpu()
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def run(path: str, inputs, tiles=None) -> torch.Tensor:
    """Call a Triton path (or the dispatcher) on a NaN-poisoned out and check all of it was set."""
    out = poisoned(inputs[0])
    if path == "dispatch":
        got = fused_moe(*inputs, out=out, force_triton=True)
    else:
        fn = triton_moe.fused_moe_decode if path == "decode" else triton_moe.fused_moe_prefill
        got = fn(*inputs, out=out, tiles=tiles)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "kernel left part of out unwritten"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("t", "skip"), [(1, 0.0), (6, 0.3)])
def test_reference_matches_float64_loop(rng_seed, dtype, t, skip):
    inputs = make_inputs(rng_seed, t, 48, 24, 10, 3, dtype, used_rows=5, skip=skip)
    out = poisoned(inputs[0])
    assert fused_moe_reference(*inputs, out=out) is out
    assert torch.isfinite(out).all()
    want = naive_f64(*inputs)
    assert rel_err(out, want) < TOL[dtype]
    assert out.abs().max() > 0.3  # O(1) values: the comparison means something
    skipped = (inputs[3] < 0).all(dim=1)
    assert (out[skipped] == 0).all()


# (T, H, I, N, K, used_rows, skip): T=1; duplicates (few used rows); skipped ids; rows with no
# tokens (used_rows < N); T not a multiple of BLOCK_M; H, I not multiples of the tiles.
CASES = [
    (1, 64, 32, 12, 4, None, 0.0),
    (7, 64, 32, 12, 3, 4, 0.25),
    (37, 64, 32, 12, 2, 3, 0.1),  # groups of ~25 pairs: more than one BLOCK_M of 16
    (5, 40, 24, 9, 3, 6, 0.2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}K{c[4]}")
def test_triton_matches_reference(rng_seed, dtype, path, case):
    t, h, i, n, k, used, skip = case
    inputs = make_inputs(rng_seed, t, h, i, n, k, dtype, used_rows=used, skip=skip)
    if dtype == torch.float16:  # both id dtypes the contract allows
        inputs = (*inputs[:3], inputs[3].int(), inputs[4])
    got = run(path, inputs, SMALL_DECODE if path == "decode" else SMALL_PREFILL)
    want = fused_moe_reference(*inputs)
    assert rel_err(got, want) < TOL[dtype], f"seed={rng_seed}"
    if path == "decode":  # act kept to ~16 bits (hi + lo): only the output rounding remains
        exact = naive_f64(*inputs)
        assert rel_err(got, exact) <= 1.5 * rel_err(exact.to(dtype), exact) + 1e-6
    skipped = (inputs[3] < 0).all(dim=1)
    assert (got[skipped] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["decode", "prefill", "reference"])
def test_add_joins_the_sum_before_rounding_and_is_consumed(rng_seed, dtype, path):
    """`add` (the offloaded bank's CPU part) is summed with the experts' output in fp32 and
    rounded once, then left zero: a second call without new content adds nothing."""
    t, h, i, n, k, used, skip = CASES[1 + rng_seed % 3]
    inputs = make_inputs(rng_seed, t, h, i, n, k, dtype, used_rows=used, skip=skip)
    g = torch.Generator().manual_seed(rng_seed)
    part = torch.randn(t, h, generator=g).to(dtype)
    tiles = SMALL_DECODE if path == "decode" else SMALL_PREFILL

    def call(**add):
        if path == "reference":
            return fused_moe_reference(*inputs, **add)
        fn = triton_moe.fused_moe_decode if path == "decode" else triton_moe.fused_moe_prefill
        return fn(*inputs, tiles=tiles, **add)

    add = part.clone()
    got = call(add=add)
    assert not add.any(), "add was not consumed"
    exact = naive_f64(*inputs) + part.double()
    assert rel_err(got, exact) < TOL[dtype], f"seed={rng_seed}"
    if path != "reference":
        assert rel_err(got, fused_moe_reference(*inputs, add=part.clone())) < TOL[dtype]
    assert torch.equal(call(add=add), call())  # consumed: the next call adds zeros


def partial_launches(call, inputs, parts: int, seed: int) -> torch.Tensor:
    """The sum in `parts` launches over a random partition of the bank's rows, as the prefill
    streamer makes them (kernels/moe_parts.py): each but the last writes the unrounded sum into
    one of two fp32 buffers, adding the other's; the last adds it and rounds once."""
    hidden, w13, w2, ids, weights = inputs
    g = torch.Generator().manual_seed(seed)
    part_of = torch.randint(0, parts, (w13.shape[0],), generator=g).to(ids.device)  # [N]
    sums = [poisoned(hidden.float()), poisoned(hidden.float())]  # each written before read
    out = None
    for p in range(parts):
        mine = torch.where(ids >= 0, part_of[ids.clamp(min=0)] == p, False)
        part_ids = torch.where(mine, ids, torch.full_like(ids, -1)).contiguous()
        last = p == parts - 1
        add = None if p == 0 else sums[(p - 1) % 2]
        out = call(hidden, w13, w2, part_ids, weights,
                   out=poisoned(hidden) if last else sums[p % 2], add=add)  # fmt: skip
        assert add is None or not add.any(), "a launch left its add unconsumed"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["decode", "prefill", "reference"])
def test_partial_sums_in_fp32_round_once(rng_seed, dtype, path):
    """`out` in fp32 holds the sum unrounded, and the same buffer as the next launch's `add`
    accumulates: launches over parts of the rows give the one launch's result within fp32
    rounding of the sum's order (one rounding to the dtype at the end)."""
    t, h, i, n, k, used, skip = CASES[rng_seed % len(CASES)]
    inputs = make_inputs(rng_seed, t, h, i, n, k, dtype, used_rows=used, skip=skip)
    tiles = SMALL_DECODE if path == "decode" else SMALL_PREFILL

    def call(*args, **kw):
        if path == "reference":
            return fused_moe_reference(*args, **kw)
        fn = triton_moe.fused_moe_decode if path == "decode" else triton_moe.fused_moe_prefill
        return fn(*args, tiles=tiles, **kw)

    whole = call(*inputs)
    got = partial_launches(call, inputs, 2 + rng_seed % 3, rng_seed)
    exact = naive_f64(*inputs)
    assert rel_err(got, exact) < TOL[dtype], f"seed={rng_seed}"
    # One rounding at the end: the fp32 sums differ only in their order, so in fp16 nearly
    # every element rounds as the single launch's does (rounding each part would move most).
    if dtype == torch.float32:
        assert rel_err(got, whole) < 1e-6, f"seed={rng_seed}"
    else:
        assert (got != whole).float().mean().item() <= 0.02, f"seed={rng_seed}"


def test_out_must_not_be_add(rng_seed):
    inputs = make_inputs(rng_seed, 3, 64, 32, 12, 2, torch.float32)
    acc = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="out must not be its add"):
        fused_moe(*inputs, out=acc, add=acc)


def test_add_must_match_hidden(rng_seed):
    inputs = make_inputs(rng_seed, 3, 64, 32, 12, 2, torch.float32)
    with pytest.raises(AssertionError, match="add must be"):
        fused_moe(*inputs, add=torch.zeros(3, 32))


def test_all_pairs_skipped(rng_seed):
    inputs = list(make_inputs(rng_seed, 3, 64, 32, 6, 2, torch.float32))
    inputs[3] = torch.full_like(inputs[3], -1)
    for path in ("decode", "prefill"):
        assert (run(path, inputs) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dispatcher_default_tiles_both_paths(rng_seed, dtype):
    limit = PATH_LIMITS["decode_max_pairs"]
    for t, k in [(2, 4), (limit // 4 + 3, 4)]:  # P under and over the decode limit
        inputs = make_inputs(rng_seed + t, t, 64, 32, 12, k, dtype, used_rows=8, skip=0.1)
        assert rel_err(run("dispatch", inputs), fused_moe_reference(*inputs)) < TOL[dtype]


def test_dispatcher_picks_path(monkeypatch):
    called = []
    for name in ("fused_moe_decode", "fused_moe_prefill"):
        monkeypatch.setattr(triton_moe, name, lambda *a, name=name, **kw: called.append(name))
    limit = PATH_LIMITS["decode_max_pairs"]
    for pairs in (1, limit, limit + 1):
        ids = torch.zeros(pairs, 1, dtype=torch.int64)
        fused_moe(torch.zeros(pairs, 8), None, None, ids, None, force_triton=True)
    assert called == ["fused_moe_decode", "fused_moe_decode", "fused_moe_prefill"]
    # Without CUDA tensors or force_triton, the dispatcher is the reference.
    inputs = make_inputs(0, 3, 16, 8, 4, 2, torch.float32)
    assert torch.equal(dispatcher.fused_moe(*inputs), fused_moe_reference(*inputs))


def test_prefill_chunks(rng_seed):
    # A batch longer than CHUNK_PAIRS runs in token chunks that must tile out exactly.
    inputs = make_inputs(rng_seed, 11, 64, 32, 8, 3, torch.float32, used_rows=6, skip=0.1)
    got = run("prefill", inputs, {**SMALL_PREFILL, "CHUNK_PAIRS": 12})
    assert rel_err(got, fused_moe_reference(*inputs)) < TOL[torch.float32]


def batch_around(seed: int, token: tuple[torch.Tensor, ...], n: int, t: int, pos: int):
    """A batch of t random tokens with `token` (hidden [1,H], ids [1,K], weights [1,K]) at pos;
    every other token reuses its rows (shuffled) so that its row groups are shared."""
    x, ids, wts = token
    h, k = x.shape[1], ids.shape[1]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(x.dtype)
    others = torch.rand(t, n, generator=g).topk(k, dim=1).indices  # [T, K]
    for r in range(0, t, 2):
        others[r] = ids[0, torch.randperm(k, generator=g)]
    hidden[pos], others[pos] = x[0], ids[0]
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    weights[pos] = wts[0]
    return hidden, others.contiguous(), weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_token_bits_independent_of_batch(rng_seed, dtype, path):
    tiles = SMALL_DECODE if path == "decode" else SMALL_PREFILL
    x, w13, w2, ids, wts = make_inputs(rng_seed, 1, 64, 32, 12, 4, dtype, skip=0.2)
    alone = run(path, (x, w13, w2, ids, wts), tiles)
    for t, pos in [(5, 3), (9, 0)]:
        hidden, bids, bwts = batch_around(rng_seed + t, (x, ids, wts), 12, t, pos)
        batch = (hidden, w13, w2, bids, bwts)
        first = run(path, batch, tiles)
        assert torch.equal(first[pos], alone[0]), f"seed={rng_seed} T={t}"
        assert torch.equal(run(path, batch, tiles), first), "two runs of one batch differ"


# ---------------------------------------------------------------- device (H200, bf16)

REAL = dict(h=2048, i=768, n=128, k=8)


@pytest.fixture(scope="module")
def real_banks():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"bank seed={seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, i, n = REAL["h"], REAL["i"], REAL["n"]
    w13 = (torch.randn(n, 2 * i, h, device="cuda", generator=g) * (2 / h**0.5)).bfloat16()
    w2 = (torch.randn(n, h, i, device="cuda", generator=g) * (2 / i**0.5)).bfloat16()
    return w13, w2


def real_tokens(seed: int, t: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, REAL["h"], generator=g).bfloat16().cuda()
    ids = torch.rand(t, REAL["n"], generator=g).topk(REAL["k"], dim=1).indices.cuda()
    weights = torch.softmax(torch.randn(t, REAL["k"], generator=g), dim=1).cuda()
    return hidden, ids, weights


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16, 64, 2048])
def test_gpu_bf16_real_shape(rng_seed, real_banks, t):
    w13, w2 = real_banks
    hidden, ids, wts = real_tokens(rng_seed, t)
    ids[0, 1] = -1  # a skipped pair rides along
    want = fused_moe_reference(hidden.float(), w13.float(), w2.float(), ids, wts)
    decode_ok = t * REAL["k"] <= triton_moe.DECODE_MAX_PAIRS
    paths = ["dispatch", "prefill"] + (["decode"] if decode_ok else [])
    for path in paths:
        got = run(path, (hidden, w13, w2, ids, wts))
        err = rel_err(got, want)
        print(f"T={t} {path}: relative error {err:.2e}")
        assert err < 1e-2, f"{path} T={t} seed={rng_seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_gpu_token_bits_independent_of_batch(rng_seed, real_banks, path):
    w13, w2 = real_banks
    x, ids, wts = real_tokens(rng_seed, 1)
    alone = run(path, (x, w13, w2, ids, wts))
    for t in (4, 16):
        token = (x.cpu(), ids.cpu(), wts.cpu())
        hidden, bids, bwts = batch_around(rng_seed + t, token, REAL["n"], t, t - 1)
        got = run(path, (hidden.cuda(), w13, w2, bids.cuda(), bwts.cuda()))
        assert torch.equal(got[t - 1], alone[0]), f"{path} T={t} seed={rng_seed}"


@pytest.mark.gpu
@pytest.mark.parametrize(("path", "t"), [("dispatch", 1), ("dispatch", 4), ("prefill", 64)])
def test_gpu_cuda_graph(rng_seed, real_banks, path, t):
    # The decode path must capture; the prefill path has no host sync either, checked here too.
    w13, w2 = real_banks
    hidden, ids, wts = real_tokens(rng_seed, t)
    out = torch.empty_like(hidden)
    fn = fused_moe if path == "dispatch" else triton_moe.fused_moe_prefill
    side = torch.cuda.Stream()  # warm up (compile) off the capture, as torch's docs advise
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(hidden, w13, w2, ids, wts, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(hidden, w13, w2, ids, wts, out=out)
    # New inputs in the same buffers: the graph must read ids and weights on the device.
    new_hidden, new_ids, new_wts = real_tokens(rng_seed + 1, t)
    new_ids[0, 0] = -1
    hidden.copy_(new_hidden), ids.copy_(new_ids), wts.copy_(new_wts)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = fn(new_hidden, w13, w2, new_ids, new_wts)
    assert torch.equal(out, eager)


# ---------------------------------------------------------------- strided banks (arena slots)


def arena_banks(w13: torch.Tensor, w2: torch.Tensor, pages: int = 3):
    """The banks copied into the slots of an elastic arena (engine/arena.py): rows at stride
    3*I*H with w13 and w2 interleaved, the lowest slots below the boundary left poisoned.
    Returns the whole-arena views ([S_max, 2I, H], [S_max, H, I]) and the first slot."""
    from freetoken_agent.engine.arena import ElasticArena, KVUnit, SlotUnit

    n, h, i = w13.shape[0], w13.shape[2], w2.shape[2]
    kv = KVUnit(1, 2, 1, 8, w13.dtype)
    slot = SlotUnit(h, i, w13.dtype)
    nbytes = pages * kv.nbytes + (n + 1) * slot.nbytes + 5  # a gap slot and an odd tail
    arena = ElasticArena(nbytes, w13.device, kv, slot)
    arena.set_boundary(arena.boundary_for(n_slots=n))
    first = arena.first_slot
    assert arena.map_for(arena.kv_pages, first)
    arena.slot_buffer[first * slot.nbytes :].fill_(0xFF)  # NaN in every float dtype
    arena.w13[first:] = w13
    arena.w2[first:] = w2
    assert arena.w13.stride(0) == 3 * i * h and not arena.w13.is_contiguous()
    return arena.w13, arena.w2, first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["decode", "prefill", "reference"])
def test_strided_arena_banks_match_contiguous(rng_seed, dtype, path):
    hidden, w13, w2, ids, wts = make_inputs(rng_seed, 6, 40, 24, 7, 3, dtype, skip=0.2)
    s13, s2, first = arena_banks(w13, w2)
    rows = torch.where(ids < 0, ids, ids + first)  # [T, K] absolute slot ids
    if path == "reference":
        got = fused_moe_reference(hidden, s13, s2, rows, wts, out=poisoned(hidden))
        want = fused_moe_reference(hidden, w13, w2, ids, wts)
    else:
        tiles = SMALL_DECODE if path == "decode" else SMALL_PREFILL
        got = run(path, (hidden, s13, s2, rows, wts), tiles)
        want = run(path, (hidden, w13, w2, ids, wts), tiles)
    assert torch.isfinite(got).all() and torch.equal(got, want), f"seed={rng_seed}"
    assert got.abs().max() > 0.1
    # a sub-range of the views (the streamer's lent staging) is strided the same way
    got = fused_moe_reference(hidden, s13[first:], s2[first:], ids, wts)
    assert torch.equal(got, fused_moe_reference(hidden, w13, w2, ids, wts))


def test_strided_rows_must_be_dense(rng_seed):
    hidden, w13, w2, ids, wts = make_inputs(rng_seed, 2, 32, 16, 4, 2, torch.float32)
    with pytest.raises(AssertionError, match="dense rows"):
        triton_moe.fused_moe_decode(hidden, w13.transpose(1, 2).contiguous().transpose(1, 2),
                                    w2, ids, wts)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 64])
def test_gpu_strided_arena_banks_bf16(rng_seed, real_banks, t):
    w13, w2 = real_banks
    s13, s2, first = arena_banks(w13, w2)
    hidden, ids, wts = real_tokens(rng_seed, t)
    ids[0, 1] = -1
    rows = torch.where(ids < 0, ids, ids + first)
    paths = ["dispatch", "prefill"] + (["decode"] if t * REAL["k"] <= 128 else [])
    for path in paths:
        got = run(path, (hidden, s13, s2, rows, wts))
        assert torch.equal(got, run(path, (hidden, w13, w2, ids, wts))), f"{path} T={t}"


# ---------------------------------------------------------------- host banks (direct reads)


def split_banks(seed: int, t: int, k: int, dtype: torch.dtype, device: str = "cpu"):
    """A slot bank and a host bank of random experts, and ids sending each pair to a slot row,
    a host row (`host_ids`) or nowhere (-1); with the same pairs on one combined bank
    [slots; host rows] for comparison: (hidden, slots13, slots2, host13, host2, ids, wts,
    combined13, combined2, combined_ids)."""
    from freetoken_agent.kernels.reference import host_ids

    g = torch.Generator().manual_seed(seed)
    n_slots, n_host = int(torch.randint(3, 9, (1,), generator=g)), 11
    hidden, w13, w2, _, wts = make_inputs(seed, t, 48, 24, n_slots + n_host, k, dtype)
    n = n_slots + n_host
    rows = torch.rand(t, n, generator=g).topk(k, dim=1).indices  # [T, K] distinct per token
    rows[torch.rand(t, k, generator=g) < 0.15] = -1
    # Token 0 reads one slot row and one host row whatever the draw: both sources in play.
    a, b = (
        int(torch.randint(n_slots, (1,), generator=g)),
        n_slots + int(torch.randint(n_host, (1,), generator=g)),
    )
    rows[0] = torch.tensor([a, b, *[r for r in rows[0].tolist() if r not in (a, b)][: k - 2]])
    on_host = rows >= n_slots
    ids = torch.where(on_host, host_ids(rows - n_slots), rows)  # -1 stays -1
    host13, host2 = w13[n_slots:].clone(), w2[n_slots:].clone()
    if device != "cpu":
        host13, host2 = host13.pin_memory(), host2.pin_memory()
    dev = lambda x: x.to(device)  # noqa: E731
    return (dev(hidden), dev(w13[:n_slots]), dev(w2[:n_slots]), host13, host2, dev(ids),
            dev(wts), dev(w13), dev(w2), dev(rows))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 5])
def test_host_bank_pairs_equal_one_combined_bank(rng_seed, dtype, t):
    """Pairs read from the host bank compute exactly what they compute from a device bank
    holding the same rows: the decode kernels' bits do not depend on where a row lives; the
    reference agrees, and skipped pairs add nothing."""
    hidden, s13, s2, h13, h2, ids, wts, c13, c2, c_ids = split_banks(rng_seed, t, 4, dtype)
    assert (ids <= -2).any() and (ids >= 0).any()  # both sources in play
    got = poisoned(hidden)
    fused_moe(hidden, s13, s2, ids, wts, out=got, host_w13=h13, host_w2=h2, force_triton=True)
    want = run("decode", (hidden, c13, c2, c_ids, wts), SMALL_DECODE)
    got_small = triton_moe.fused_moe_decode(hidden, s13, s2, ids, wts, tiles=SMALL_DECODE,
                                            host_w13=h13, host_w2=h2)  # fmt: skip
    assert torch.equal(got_small, want)
    ref = fused_moe_reference(hidden, s13, s2, ids, wts, host_w13=h13, host_w2=h2)
    assert torch.equal(ref, fused_moe_reference(hidden, c13, c2, c_ids, wts))
    assert rel_err(got, ref) < TOL[dtype]
    skipped = (ids == -1).all(dim=1)
    assert (got[skipped] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 5])
def test_fill_through_stores_the_host_rows_it_reads_into_their_slots(rng_seed, dtype, t):
    """Fill-through (`fill_slot_of`): the pairs compute what they compute without it, bit for
    bit, and afterwards each host row that was given a slot sits in that slot of both banks,
    whole; a host row given none (-1) is only read; every other slot is untouched. The
    reference does the same."""
    hidden, s13, s2, h13, h2, ids, wts, *_ = split_banks(rng_seed, t, 4, dtype)
    g = torch.Generator().manual_seed(rng_seed + 1)
    used = sorted(set((-ids[ids < -1] - 2).tolist()))
    spare = len(used) + 1  # victims: slots no pair reads (the plan's rule: not this layer's)
    s13 = torch.cat([s13, torch.randn(spare, *s13.shape[1:], generator=g).to(dtype)])
    s2 = torch.cat([s2, torch.randn(spare, *s2.shape[1:], generator=g).to(dtype)])
    slot_of = torch.full((h13.shape[0],), -1, dtype=torch.int32)
    victims = torch.randperm(spare, generator=g)[: len(used)] + (s13.shape[0] - spare)
    given = {lid: int(v) for lid, v in zip(used, victims.tolist(), strict=False)}
    if len(given) > 1:  # one used host row left without a slot: read only
        given.pop(list(given)[int(torch.randint(len(given), (1,), generator=g))])
    for lid, slot in given.items():
        slot_of[lid] = slot
    for impl in ("triton", "reference"):
        b13, b2 = s13.clone(), s2.clone()
        if impl == "triton":
            plain = triton_moe.fused_moe_decode(
                hidden,
                s13.clone(),
                s2.clone(),
                ids,
                wts,
                tiles=SMALL_DECODE,
                host_w13=h13,
                host_w2=h2,
            )
            got = triton_moe.fused_moe_decode(
                hidden,
                b13,
                b2,
                ids,
                wts,
                tiles=SMALL_DECODE,
                host_w13=h13,
                host_w2=h2,
                fill_slot_of=slot_of,
            )
        else:
            plain = fused_moe_reference(
                hidden, s13.clone(), s2.clone(), ids, wts, host_w13=h13, host_w2=h2
            )
            got = fused_moe_reference(hidden, b13, b2, ids, wts, host_w13=h13, host_w2=h2,
                                      fill_slot_of=slot_of)  # fmt: skip
        assert torch.equal(got, plain), impl
        for slot in range(s13.shape[0]):
            lid = next((lid for lid, v in given.items() if v == slot), None)
            want13 = h13[lid] if lid is not None else s13[slot]
            want2 = h2[lid] if lid is not None else s2[slot]
            assert torch.equal(b13[slot], want13) and torch.equal(b2[slot], want2), (impl, slot)


# Compiles the decode kernels for sm_90 (no GPU needed) with and without fill-through, in a
# process of its own (this one imported the kernels under the interpreter).
_COMPILE_FILL = """
import json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.moe_decode import _decode_gate_up_kernel, _decode_down_kernel
def ptx(fn, consts, types):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4)).asm["ptx"]
out = {}
for fill, partial in ((False, False), (True, False), (False, True)):
    up = ptx(_decode_gate_up_kernel, dict(K=8, BLOCK_P=16, BLOCK_M=16, BLOCK_I=32, BLOCK_H=128,
             PREC="tf32", SPLIT=True, HOST=True, FILL=fill, PARTIAL=partial, PDL=0),
             dict(x_ptr="*bf16", w13_ptr="*bf16", ids_ptr="*i64", hi_ptr="*bf16", lo_ptr="*bf16",
                  hw13_ptr="*bf16", slot_of_ptr="*i32", cols_ptr="*i32"))
    down = ptx(_decode_down_kernel, dict(BLOCK_P=16, BLOCK_M=16, BLOCK_N=128, BLOCK_K=64,
               PREC="tf32", SPLIT=True, HOST=True, FILL=fill, PARTIAL=partial, PDL=0),
               dict(hi_ptr="*bf16", lo_ptr="*bf16", w2_ptr="*bf16", ids_ptr="*i64", y_ptr="*fp32",
                    hw2_ptr="*bf16", slot_of_ptr="*i32", cols_ptr="*i32"))
    key = "fill" if fill else "partial" if partial else "plain"
    out[key] = [len(re.findall(r"st\\.global", up)), len(re.findall(r"st\\.global", down)),
                len(re.findall(r"ld\\.global", up)), len(re.findall(r"ld\\.global", down))]
print(json.dumps(out))
"""


def test_fill_through_compiles_for_sm90_with_the_slot_stores():
    """Fill-through adds the slot stores; partly filled slots (`slot_cols`) add the loads of
    their columns to both kernels and compile for sm_90 too."""
    counts = compiled_json(_COMPILE_FILL)
    (up, down, up_ld, down_ld), (up_fill, down_fill, *_) = counts["plain"], counts["fill"]
    assert up_fill > up and down_fill > down, counts
    _, _, up_ld_partial, down_ld_partial = counts["partial"]
    assert up_ld_partial > up_ld and down_ld_partial > down_ld, counts


def test_host_banks_refused_beyond_decode_batches(rng_seed):
    hidden, s13, s2, h13, h2, ids, wts, *_ = split_banks(rng_seed, 40, 4, torch.float32)
    with pytest.raises(ValueError, match="host banks serve decode batches of at most 128"):
        fused_moe(hidden, s13, s2, ids, wts, host_w13=h13, host_w2=h2)
    with pytest.raises(AssertionError, match="host_w2 must be"):
        fused_moe(hidden[:2], s13, s2, ids[:2], wts[:2], host_w13=h13, host_w2=h2[:, :, :5])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_host_bank_read_over_the_link(rng_seed, t):
    """On CUDA the host bank is pinned host memory the kernels read themselves: the same bits
    as the same rows in device memory."""
    hidden, s13, s2, h13, h2, ids, wts, c13, c2, c_ids = split_banks(
        rng_seed, t, 8, torch.bfloat16, device="cuda"
    )
    assert h13.device.type == "cpu" and h13.is_pinned()
    got = fused_moe(hidden, s13, s2, ids, wts, host_w13=h13, host_w2=h2)
    want = fused_moe(hidden, c13, c2, c_ids, wts)
    assert torch.equal(got, want)
    ref = fused_moe_reference(hidden.float(), c13.float(), c2.float(), c_ids, wts)
    assert rel_err(got, ref) < TOL[torch.bfloat16]


def _partial_slots(seed: int, s13: torch.Tensor, s2: torch.Tensor):
    """slot_cols for the slot bank (about half its rows whole, the others holding [0, c) for a
    random c), the banks with every column past c set to NaN (what a partly filled slot holds
    there is stale: no kernel may read it), and the banks with those columns' gate rows zeroed
    (the same experts, computed whole: a zero gate adds nothing)."""
    g = torch.Generator().manual_seed(seed + 7)
    n, i = s13.shape[0], s13.shape[1] // 2
    cols = torch.randint(1, i, (n,), generator=g, dtype=torch.int32)
    cols[torch.rand(n, generator=g) < 0.5] = i
    stale13, stale2, zeroed13 = s13.clone(), s2.clone(), s13.clone()
    for r, c in enumerate(cols.tolist()):
        stale13[r, c:i] = stale13[r, i + c :] = float("nan")
        stale2[r, :, c:] = float("nan")
        zeroed13[r, c:i] = 0.0
    return cols, stale13, stale2, zeroed13


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("host", [False, True])
def test_partly_filled_slots_compute_their_columns_only(rng_seed, dtype, t, host):
    """`slot_cols`: a slot row holding columns [0, c) of I computes those (the split expert's
    device half): the same as the whole expert with its gate rows past c zeroed, whatever the
    slot holds past c (NaN here: neither kernel reads there, act nor weights); host rows are
    whole; the Triton path and the reference agree."""
    hidden, s13, s2, h13, h2, ids, wts, *_ = split_banks(rng_seed, t, 4, dtype)
    cols, stale13, stale2, zeroed13 = _partial_slots(rng_seed, s13, s2)
    banks = dict(host_w13=h13, host_w2=h2) if host else {}
    if not host:
        ids = torch.where(ids < -1, -1, ids)  # no host bank: those pairs skipped
    want = fused_moe_reference(hidden, zeroed13, s2, ids, wts, **banks)
    ref = fused_moe_reference(hidden, stale13, stale2, ids, wts, **banks, slot_cols=cols)
    assert torch.isfinite(ref).all() and rel_err(ref, want) < TOL[dtype]
    got = triton_moe.fused_moe_decode(hidden, stale13, stale2, ids, wts, out=poisoned(hidden),
                                      tiles=SMALL_DECODE, **banks, slot_cols=cols)  # fmt: skip
    assert torch.isfinite(got).all(), "a kernel read a slot's stale columns"
    assert rel_err(got, want) < TOL[dtype]
    # The whole width given explicitly is the call without it, bit for bit.
    whole = torch.full_like(cols, s13.shape[1] // 2)
    plain = triton_moe.fused_moe_decode(hidden, s13, s2, ids, wts, tiles=SMALL_DECODE, **banks)
    again = triton_moe.fused_moe_decode(hidden, s13, s2, ids, wts, tiles=SMALL_DECODE, **banks,
                                        slot_cols=whole)  # fmt: skip
    assert torch.equal(again, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("host", [False, True])
def test_gpu_partly_filled_slots_compute_their_columns_only(rng_seed, host):
    """The same on the device in bf16, the host bank pinned and read over the link."""
    hidden, s13, s2, h13, h2, ids, wts, *_ = split_banks(rng_seed, 4, 8, torch.bfloat16, "cuda")
    cols, stale13, stale2, zeroed13 = _partial_slots(rng_seed, s13.cpu(), s2.cpu())
    cols, stale13, stale2, zeroed13 = (x.cuda() for x in (cols, stale13, stale2, zeroed13))
    banks = dict(host_w13=h13, host_w2=h2) if host else {}
    if not host:
        ids = torch.where(ids < -1, -1, ids)
    want = fused_moe_reference(hidden, zeroed13, s2, ids, wts, **banks)
    got = fused_moe(hidden, stale13, stale2, ids, wts, out=poisoned(hidden), **banks,
                    slot_cols=cols)  # fmt: skip
    assert torch.isfinite(got).all(), "a kernel read a slot's stale columns"
    assert rel_err(got, want) < TOL[torch.bfloat16]


def test_slot_cols_refused_by_name(rng_seed):
    hidden, w13, w2, ids, wts = make_inputs(rng_seed, 2, 32, 16, 6, 2, torch.float32)
    for bad in (torch.full((5,), 8, dtype=torch.int32), torch.full((6,), 8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="slot_cols"):
            fused_moe(hidden, w13, w2, ids, wts, slot_cols=bad)
    many = PATH_LIMITS["decode_max_pairs"] + 1
    big = make_inputs(rng_seed, many, 32, 16, 6, 1, torch.float32)
    with pytest.raises(ValueError, match="slot_cols"):
        fused_moe(*big, slot_cols=torch.full((6,), 8, dtype=torch.int32))
