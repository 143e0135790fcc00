"""Paged attention: reference vs a dense float64 oracle, Triton vs reference, CUDA graphs.

Fresh random inputs every run (seed printed by the `rng_seed` fixture). Cache slots that no
sequence owns are NaN and page-table entries past a sequence's length point far outside the
cache, so reading anything outside the contract poisons the result; `out` starts as NaN, so an
unwritten row fails.
"""

# Shape legend: T query tokens, B sequences, Hq / Hkv heads, D head dim, P pages of S tokens.

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from freetoken_agent.kernels import reference
from freetoken_agent.kernels.paged_attention import paged_attention, store_kv
from freetoken_agent.kernels.triton import attention_plan
from freetoken_agent.kernels.triton import paged_attention as triton_attention
from freetoken_agent.kernels.triton.attention_plan import SHORT_TILES, plan_launch
from freetoken_agent.kernels.triton.paged_attention import (
    Tiles,
    launch_paged_attention,
    new_counters,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SCENARIOS = ("prefill", "chunked", "decode", "mixed")
# Small tiles so the short interpreted sequences still span several kv tiles (window edge,
# interior and diagonal ranges) and several q blocks.
SMALL = Tiles(block_m=16, block_n=16, num_warps=4, num_stages=2)
TOL = {torch.float32: 1e-4, torch.float16: 3e-3 if not CUDA else 1e-2}


@dataclass
class Case:
    q: Tensor  # [T, Hq, D]
    k_cache: Tensor  # [P, S, Hkv, D], NaN where no sequence stored a token
    v_cache: Tensor
    page_table: Tensor  # [B, max_pages] int32
    cu_q_lens: Tensor  # [B + 1] int32
    kv_lens: Tensor  # [B] int32
    max_q_len: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.page_table, self.cu_q_lens, self.kv_lens,
                self.scale, self.max_q_len)  # fmt: skip


def lengths(rng: random.Random, scenario: str, max_kv: int = 80) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) of one batch; kv_len >= q_len always."""
    if scenario == "prefill":
        q = [rng.randint(1, max_kv // 2) for _ in range(rng.randint(1, 3))]
        return q, q
    if scenario == "chunked":  # a new chunk after a cached prefix
        q = [rng.randint(2, 24) for _ in range(rng.randint(1, 3))]
        return q, [n + rng.randint(1, max_kv - 24) for n in q]
    if scenario == "decode":
        B = rng.randint(1, 4)
        return [1] * B, [rng.randint(1, max_kv) for _ in range(B)]
    q = [rng.choice([0, 1, 1, rng.randint(2, 24)]) for _ in range(5)]  # mixed, some empty
    q[rng.randrange(5)] = rng.randint(2, 24)  # at least one multi-token row block
    return q, [n + rng.randint(0, max_kv - 24) for n in q]


def make_case(seed: int, q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, d: int,
              page: int, dtype: torch.dtype, device: str = DEV) -> Case:  # fmt: skip
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B = len(q_lens)
    need = [(n + page - 1) // page for n in kv_lens]
    P = sum(need) + 3  # a few pages nobody owns (NaN)
    max_pages = max(need) + 2
    # Shuffled, non-contiguous pages; entries past a sequence's length are far out of range.
    pages = torch.randperm(P, generator=gen).tolist()
    table = [[P + 1000 + rng.randrange(10**6) for _ in range(max_pages)] for _ in range(B)]
    slots = []
    for b, n in enumerate(need):
        table[b][:n], pages = pages[:n], pages[n:]
        slots += [table[b][j // page] * page + j % page for j in range(kv_lens[b])]
    k_cache = torch.full((P, page, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_new = torch.randn(len(slots), hkv, d, generator=gen).to(device, dtype)
    v_new = torch.randn(len(slots), hkv, d, generator=gen).to(device, dtype)
    store_kv(k_new, v_new, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=device))
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(device, dtype)
    i32 = dict(dtype=torch.int32, device=device)
    return Case(q, k_cache, v_cache, torch.tensor(table, **i32), cu.to(device),
                torch.tensor(kv_lens, **i32), max(q_lens, default=0), d**-0.5)  # fmt: skip


def naive_attention(c: Case, window: int) -> Tensor:
    """Dense float64 attention, one query row at a time, K/V gathered slot by slot."""
    T, Hq, D = c.q.shape
    P, S, Hkv, _ = c.k_cache.shape
    flat_k = c.k_cache.reshape(P * S, Hkv, D).double().cpu()
    flat_v = c.v_cache.reshape(P * S, Hkv, D).double().cpu()
    table, cu, kv_lens = c.page_table.tolist(), c.cu_q_lens.tolist(), c.kv_lens.tolist()
    q = c.q.double().cpu()
    out = torch.full((T, Hq, D), float("nan"), dtype=torch.float64)
    for b, L in enumerate(kv_lens):
        slots = [table[b][j // S] * S + j % S for j in range(L)]
        k = flat_k[slots].repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
        v = flat_v[slots].repeat_interleave(Hq // Hkv, dim=1)
        n = cu[b + 1] - cu[b]
        for i in range(n):
            p = L - n + i
            lo = max(0, p - window + 1) if window > 0 else 0
            s = torch.einsum("hd,jhd->hj", q[cu[b] + i], k[lo : p + 1]) * c.scale
            out[cu[b] + i] = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), v[lo : p + 1])
    return out


def run_triton(c: Case, window: int, **launch) -> Tensor:
    out = torch.full_like(c.q, float("nan"))
    if launch:
        res = launch_paged_attention(*c.args(), window, out, **launch)
    else:  # through the dispatcher, with the launcher's own tiles and split count
        res = paged_attention(*c.args(), window, out, force_triton=True)
    assert res is out
    assert not out.isnan().any(), "rows left unwritten (or NaN read from an unowned slot)"
    return out


def check_close(out: Tensor, ref: Tensor, tol: float) -> None:
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


# ---- store_kv and the reference ---------------------------------------------------------------


def test_store_kv_writes_exactly_the_mapped_slots(rng_seed: int) -> None:
    gen = torch.Generator().manual_seed(rng_seed)
    P, S, Hkv, D, T = 6, 8, 2, 16, 20
    k_cache, v_cache = torch.randn(2, P, S, Hkv, D, generator=gen)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(P * S, generator=gen)[:T]
    k, v = torch.randn(2, T, Hkv, D, generator=gen).half()  # cast to the cache dtype on write
    store_kv(k, v, k_cache, v_cache, slots)
    hit = torch.zeros(P * S, dtype=torch.bool)
    hit[slots] = True
    for cache, old, new in ((k_cache, k0, k), (v_cache, v0, v)):
        flat, flat_old = cache.view(P * S, Hkv, D), old.view(P * S, Hkv, D)
        assert torch.equal(flat[slots], new.float())
        assert torch.equal(flat[~hit], flat_old[~hit])


@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("window", [0, 1])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_matches_dense(rng_seed: int, scenario: str, group: int, window: int,
                                 page: int) -> None:  # fmt: skip
    rng = random.Random(rng_seed)
    q_lens, kv_lens = lengths(rng, scenario)
    window = rng.randint(1, 40) if window else 0
    c = make_case(rng_seed, q_lens, kv_lens, 2 * group, 2, 16, page, torch.float32, "cpu")
    out = torch.full_like(c.q, float("nan"))
    assert reference.paged_attention(*c.args(), window, out) is out
    assert not out.isnan().any()
    check_close(out, naive_attention(c, window), 1e-5)


def test_reference_query_chunks(rng_seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query runs cut into chunks (bounding the score tensor); float64 stays float64."""
    monkeypatch.setattr(reference, "_REF_Q_CHUNK", 5)
    rng = random.Random(rng_seed)
    q_lens, kv_lens = lengths(rng, "mixed")
    window = rng.choice([0, rng.randint(1, 40)])
    c = make_case(rng_seed, q_lens, kv_lens, 8, 2, 16, 8, torch.float64, "cpu")
    out = reference.paged_attention(*c.args(), window)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, naive_attention(c, window), atol=1e-12, rtol=1e-10)


def test_reference_rejects_kv_shorter_than_q(rng_seed: int) -> None:
    c = make_case(rng_seed, [3], [3], 2, 2, 16, 8, torch.float32, "cpu")
    c.kv_lens[0] = 2
    with pytest.raises(ValueError, match="kv_len 2 < q_len 3"):
        reference.paged_attention(*c.args())


# ---- Triton (interpreter on the CPU, compiled on CUDA) vs the reference ----------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window", [0, 1])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_triton_matches_reference(rng_seed: int, scenario: str, group: int, window: int,
                                  dtype: torch.dtype) -> None:  # fmt: skip
    rng = random.Random(rng_seed)
    q_lens, kv_lens = lengths(rng, scenario)
    window = rng.randint(1, 40) if window else 0
    page = rng.choice([8, 16])
    print(f"q_lens={q_lens} kv_lens={kv_lens} window={window} page={page}")
    c = make_case(rng_seed, q_lens, kv_lens, 2 * group, 2, 16, page, dtype)
    ref = reference.paged_attention(*c.args(), window)
    check_close(run_triton(c, window, tiles=SMALL, num_splits=1), ref, TOL[dtype])


@pytest.mark.parametrize("num_splits", [3, 7])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_triton_split_kv(rng_seed: int, scenario: str, num_splits: int) -> None:
    """Flash decoding: kv ranges cut into splits (some empty) and combined by the 2nd kernel."""
    rng = random.Random(rng_seed)
    q_lens, kv_lens = lengths(rng, scenario, max_kv=100)
    window = rng.choice([0, rng.randint(1, 50)])
    print(f"q_lens={q_lens} kv_lens={kv_lens} window={window}")
    c = make_case(rng_seed, q_lens, kv_lens, 8, 2, 16, 16, torch.float32)
    ref = reference.paged_attention(*c.args(), window)
    check_close(run_triton(c, window, tiles=SMALL, num_splits=num_splits), ref, TOL[torch.float32])


@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_triton_splits_combined_by_their_last_program(
    rng_seed: int, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a counter buffer, the last split of each (q block, kv head) combines the partials
    (no second launch): the reference's rows, the combine kernel's within fp32 rounding, the
    counters back at zero, so a second launch on them (another batch) is right too. A buffer
    too small for the launch's programs leaves the combine to the second kernel."""
    rng = random.Random(rng_seed)
    counters = new_counters(torch.device(DEV))
    for launch in range(2):
        q_lens, kv_lens = lengths(rng, scenario, max_kv=100)
        window = rng.choice([0, rng.randint(1, 50)])
        num_splits = rng.choice([2, 3, 7, 40])  # 40 splits: most hold no tile of the block
        print(f"launch {launch}: q_lens={q_lens} kv_lens={kv_lens} window={window} "
              f"splits={num_splits}")  # fmt: skip
        c = make_case(rng.randrange(1 << 30), q_lens, kv_lens, 8, 2, 16, 16, torch.float32)
        ref = reference.paged_attention(*c.args(), window)
        with monkeypatch.context() as patch:  # no second launch
            patch.setattr(triton_attention, "_combine_splits_kernel", None)
            fused = run_triton(c, window, tiles=SMALL, num_splits=num_splits, counters=counters)
        check_close(fused, ref, TOL[torch.float32])
        assert not counters.any(), "a counter left standing"
        second = run_triton(c, window, tiles=SMALL, num_splits=num_splits)
        torch.testing.assert_close(fused, second, atol=1e-6, rtol=1e-5)
    small = torch.zeros(1, dtype=torch.int32, device=DEV)  # fewer entries than programs
    c = make_case(rng.randrange(1 << 30), [1, 1, 1], [rng.randint(20, 90) for _ in range(3)],
                  8, 2, 16, 16, torch.float32)  # fmt: skip
    out = run_triton(c, 0, tiles=SMALL, num_splits=3, counters=small)
    check_close(out, reference.paged_attention(*c.args()), TOL[torch.float32])
    assert int(small[0]) == 0


@pytest.mark.parametrize("in_kernel", [False, True])
def test_a_graph_bound_plan_splits_the_real_length_as_its_own_plan(
    rng_seed: int, in_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode graph plans its splits for its bound (max_model_len), not the real context: the
    launch planned for that bound must cut each sequence's real range as the plan for the real
    length does (same split edges, so the same bits), its extra splits holding nothing. Short
    ranges (<= SHORT_TILES tiles) take a tile a split, longer ones at least min_tiles."""
    # The interpreter's pretend SMs, raised so the bound's plan has more splits than a long
    # range's own plan (on a GPU the real count does it).
    monkeypatch.setattr(attention_plan, "_INTERPRETER_SMS", 64)
    rng = random.Random(rng_seed)
    device = torch.device(DEV)
    short = SHORT_TILES * SMALL.block_n  # the longest short range, in tokens
    least = attention_plan._SPLIT_POLICY["min_tiles"]
    counters = new_counters(device) if in_kernel else None  # one buffer: every launch resets it
    for i in range(6):  # short, long, and a short range beside a long one, twice each
        kind = ("short", "long", "mixed")[i % 3]
        B = 1 if kind == "short" else 2 if kind == "mixed" else rng.randint(1, 2)
        kv_lens = [rng.randint(40, short) if kind == "short" or (kind == "mixed" and b == 0)
                   else rng.randint(short + 1, 2 * short + 80) for b in range(B)]  # fmt: skip
        print(f"{kind}: kv_lens={kv_lens}")
        c = make_case(rng.randrange(1 << 30), [1] * B, kv_lens, 8, 2, 16, 16, torch.float32)
        bounds = (max(kv_lens), 8192)
        plans = [plan_launch(device, B, B, 8, 2, 16, 1, n, SMALL) for n in bounds]
        assert plans[1].num_splits > plans[0].num_splits > 1, plans  # the bound: more splits
        outs = [run_triton(c, 0, tiles=SMALL, max_kv_len=n, counters=counters) for n in bounds]
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
        check_close(outs[1], reference.paged_attention(*c.args()), TOL[torch.float32])
        if B == 1:  # one range: its own plan cuts it in equal pieces, a tile each when short
            forced = run_triton(c, 0, tiles=SMALL, num_splits=plans[0].num_splits,
                                counters=counters)  # fmt: skip
            torch.testing.assert_close(outs[0], forced, atol=0, rtol=0)
            n_tiles = -(-kv_lens[0] // SMALL.block_n)
            longer = max(SHORT_TILES, -(-n_tiles // least))
            assert plans[0].num_splits == (n_tiles if n_tiles <= SHORT_TILES else longer)
        if counters is not None:
            assert not counters.any(), "a counter left standing"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_triton_default_launch(rng_seed: int, scenario: str) -> None:
    """The dispatcher's path: the launcher picks tiles and (on decode) splits by itself."""
    rng = random.Random(rng_seed)
    q_lens, kv_lens = lengths(rng, scenario, max_kv=150)
    c = make_case(rng_seed, q_lens, kv_lens, 8, 2, 32, 16, torch.float16)
    check_close(run_triton(c, 0), reference.paged_attention(*c.args()), TOL[torch.float16])


@pytest.mark.parametrize(
    "hq, hkv, d, page, tiles",
    [
        (8, 1, 8, 8, SMALL),  # head dim below the 16 tl.dot needs: padded
        (6, 2, 80, 16, SMALL),  # group of 3 (padded to 4) and a non-power-of-two head dim
        (32, 1, 16, 8, SMALL),  # group of 32 > BLOCK_M: two programs per kv head
        (4, 4, 32, 32, Tiles(32, 16, 4, 2)),  # MHA, pages longer than a kv tile
    ],
)
def test_triton_head_layouts(rng_seed: int, hq: int, hkv: int, d: int, page: int,
                             tiles: Tiles) -> None:  # fmt: skip
    rng = random.Random(rng_seed)
    q_lens, kv_lens = lengths(rng, "mixed", max_kv=60)
    c = make_case(rng_seed, q_lens, kv_lens, hq, hkv, d, page, torch.float32)
    window = rng.choice([0, rng.randint(1, 30)])
    ref = reference.paged_attention(*c.args(), window)
    check_close(run_triton(c, window, tiles=tiles, num_splits=rng.choice([1, 2])), ref, 1e-4)


def test_triton_empty_batch_writes_nothing(rng_seed: int) -> None:
    c = make_case(rng_seed, [0, 0], [5, 9], 4, 2, 16, 8, torch.float32)
    out = torch.empty(0, 4, 16, device=DEV)
    assert paged_attention(*c.args(), 0, out, force_triton=True) is out


# ---- CUDA: bf16 / fp16 at realistic shapes, CUDA graphs --------------------------------------


def rel_err(out: Tensor, ref: Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def fp32_reference(c: Case, window: int) -> Tensor:
    args = (c.q.float(), c.k_cache.float(), c.v_cache.float()) + c.args()[3:]
    return reference.paged_attention(*args, window)


GPU_BATCHES = {
    "decode": ([1] * 6, [1, 100, 1000, 2049, 5000, 8192]),
    "prefill": ([1500, 700], [1500, 700]),
    "chunked": ([512, 33], [4096, 8000]),
    "mixed": ([1, 0, 300, 1, 7], [8192, 50, 2300, 17, 4000]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gpu_realistic(rng_seed: int, scenario: str, dtype: torch.dtype, window: int) -> None:
    q_lens, kv_lens = GPU_BATCHES[scenario]
    c = make_case(rng_seed, q_lens, kv_lens, 32, 4, 128, 16, dtype)
    err = rel_err(run_triton(c, window), fp32_reference(c, window))
    print(f"{scenario} {dtype} window={window}: relative error {err:.2e}")
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d, page", [(64, 8), (256, 32), (80, 64), (96, 16)])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gpu_head_dims_and_pages(rng_seed: int, scenario: str, d: int, page: int) -> None:
    q_lens, kv_lens = GPU_BATCHES[scenario]
    c = make_case(rng_seed, q_lens, kv_lens, 16, 2, d, page, torch.bfloat16)
    err = rel_err(run_triton(c, 0), fp32_reference(c, 0))
    print(f"{scenario} d={d} page={page}: relative error {err:.2e}")
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("in_kernel", [False, True], ids=["combine-kernel", "last-program"])
def test_gpu_decode_cuda_graph_replay(rng_seed: int, in_kernel: bool) -> None:
    """Capture store_kv + decode attention once; replay with new lengths, pages and tokens.
    in_kernel: the splits combined by their last program (a counter buffer lent)."""
    rng = random.Random(rng_seed)
    torch.manual_seed(rng_seed)
    B, Hq, Hkv, D, S, P = 4, 32, 4, 128, 16, 4096
    pages_per_seq = 512  # room for 8k tokens per sequence
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = torch.randn(2, P, S, Hkv, D, **bf16)
    q, out = torch.randn(B, Hq, D, **bf16), torch.empty(B, Hq, D, **bf16)
    k_new, v_new = torch.randn(2, B, Hkv, D, **bf16)
    table = torch.empty(B, pages_per_seq, dtype=torch.int32, device="cuda")
    kv_lens = torch.empty(B, dtype=torch.int32, device="cuda")
    slots = torch.empty(B, dtype=torch.int64, device="cuda")
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    counters = new_counters(torch.device("cuda")) if in_kernel else None

    def step() -> None:
        store_kv(k_new, v_new, k_cache, v_cache, slots)
        paged_attention(q, k_cache, v_cache, table, cu, kv_lens, D**-0.5, 1, 0, out,
                        max_kv_len=pages_per_seq * S, counters=counters)  # fmt: skip

    def set_inputs() -> None:  # in place: the graph keeps the buffers' addresses
        kv_lens.copy_(torch.tensor([rng.randint(1, pages_per_seq * S) for _ in range(B)]))
        table.copy_(torch.randperm(P, device="cuda")[: B * pages_per_seq].view(B, -1))
        pos = (kv_lens - 1).long()
        slots.copy_(table.long().gather(1, (pos // S)[:, None])[:, 0] * S + pos % S)
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))

    set_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        set_inputs()
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        out.fill_(float("nan"))
        step()
        assert not replayed.isnan().any()
        torch.testing.assert_close(replayed, out, atol=0, rtol=0)
        ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), table, cu,
                                        kv_lens, D**-0.5, 1)  # fmt: skip
        assert rel_err(replayed, ref) < 1e-2
        assert counters is None or not counters.any()


@pytest.mark.gpu
def test_gpu_no_recompile_for_new_batch_chunk_or_table_sizes(rng_seed: int) -> None:
    """Per-call integers (sequences, query blocks per sequence, splits, page-table width) are
    not specialised: launches that differ only in them (tiles fixed, so the constexprs stay)
    reuse one compiled kernel, and one reduce kernel serves every split count. On the device
    each first value divisible by 16 had compiled a new variant inside an agent turn (1-2 s)."""
    from freetoken_agent.kernels.triton.paged_attention import (
        _combine_splits_kernel,
        _paged_attention_kernel,
    )

    def compiled() -> int:  # kernels in Triton's in-memory caches, every device
        kernels = (_paged_attention_kernel, _combine_splits_kernel)
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    rng = random.Random(rng_seed)
    tiles = Tiles(64, 64, 4, 2)
    shapes = [(1, 17, 40), (16, 32, 64), (3, 48, 100), (32, 16, 33), (5, 64, 256)]
    rng.shuffle(shapes)
    counts = []
    for B, q_len, kv in shapes:  # q_len tokens per sequence over kv tokens of context
        c = make_case(rng.randrange(10**6), [q_len] * B, [kv + q_len] * B, 32, 4, 128, 16,
                      torch.bfloat16, "cuda")  # fmt: skip
        # The split count too: the reduce kernel once took its next power of two as a
        # constexpr, a new variant each time a growing context doubled the splits.
        out = run_triton(c, 0, tiles=tiles, num_splits=rng.choice([2, 3, 5, 17, 64]))
        check_close(out, naive_attention(c, 0), 2e-2)
        counts.append(compiled())
    assert counts[-1] == counts[0], counts  # one kernel for every shape, one combine
