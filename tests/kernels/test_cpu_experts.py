"""CPU expert kernel (`kernels/cpu/experts.py`) against `reference.fused_moe` on upcast inputs.

Shape legend: T tokens, H hidden, I expert width, N pool rows, K top-k, P = T * K pairs.
The oracle runs the reference on fp32 copies of the same weights: bf16/fp16 -> fp32 is exact, so
kernel and oracle do the same arithmetic and differ only in summation order (< 1e-5 relative).
H = 93 and I = 37 are multiples of neither vector width (16, 8): the two-vector loop, a single
vector and a masked tail all run, and 2I = 74 and H = 93 weight rows end in short row blocks.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest
import torch

from freetoken_agent.kernels.cpu import experts
from freetoken_agent.kernels.cpu.experts import cpu_experts
from freetoken_agent.kernels.reference import fused_moe

NATIVE = [isa for isa in ("avx512", "avx2") if experts.ISA_CPU_FLAGS[isa] <= experts.cpu_flags()]
IMPLS = [*NATIVE, "torch"]
HAS_COMPILER = experts._compiler() is not None
H, W, N = 93, 37, 10  # hidden, expert width (I), pool rows
TOL = 1e-5  # relative norm error, every dtype (see the module docstring)


@pytest.fixture(scope="module", autouse=True)
def built():
    """Build every ISA this CPU runs once per session (cached on disk after the first)."""
    for isa in NATIVE:
        if experts.library(isa) is None and HAS_COMPILER:
            pytest.fail(f"the {isa} kernel failed to build (see the warning above)")


def need(impl: str) -> None:
    if impl != "torch" and experts.library(impl) is None:
        pytest.skip(f"no {impl} kernel here (no C++ compiler)")


def make_inputs(seed, t, k, dtype, *, h=H, i=W, n=N, skip=0.0, dup=False):
    """hidden [T, H], w13 [N, 2I, H], w2 [N, H, I] (std 0.05), rows [T, K] distinct per token
    (skip: that fraction of pairs -1; dup: token 0 runs one row in two pairs), softmax weights."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(n, 2 * i, h, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(n, h, i, generator=g) * 0.05).to(dtype)
    rows = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])  # [T, K]
    rows[torch.rand(t, k, generator=g) < skip] = -1
    if dup and k > 1:
        rows[0, :2] = torch.randperm(n, generator=g)[0]  # both pairs run, on one row
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)  # [T, K] fp32
    return hidden, w13, w2, rows, weights


def oracle(hidden, w13, w2, rows, weights) -> torch.Tensor:
    return fused_moe(hidden.float(), w13.float(), w2.float(), rows, weights)  # [T, H] fp32


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_matches_reference(rng_seed, impl, dtype, t, k):
    need(impl)
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, t, k, dtype, skip=0.2, dup=True)
    if t > 1:
        rows[1] = -1  # a token with every pair skipped gets zeros
    out = torch.full((t, hidden.shape[1]), float("nan"))  # poisoned: every element must be written
    res = cpu_experts(hidden, w13, w2, rows, weights, out=out, threads=3, impl=impl)
    assert res is out and res.dtype == torch.float32 and torch.isfinite(res).all()
    if (rows < 0).all():
        assert (res == 0).all()
    else:
        assert rel_err(res, oracle(hidden, w13, w2, rows, weights)) < TOL
    if t > 1:
        assert (res[1] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16(rng_seed, impl):
    need(impl)
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, 3, 2, torch.float16)
    res = cpu_experts(hidden, w13, w2, rows, weights, impl=impl)
    assert rel_err(res, oracle(hidden, w13, w2, rows, weights)) < TOL


@pytest.mark.parametrize("impl", NATIVE)
def test_model_shape(rng_seed, impl):
    """Qwen3-30B's expert shape (H 2048, I 768), bf16: full blocks, page-sized rows, prefetch
    across experts, two threads splitting inside an expert."""
    need(impl)
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, 2, 8, torch.bfloat16, h=2048, i=768, n=9)
    res = cpu_experts(hidden, w13, w2, rows, weights, threads=2, impl=impl)
    assert rel_err(res, oracle(hidden, w13, w2, rows, weights)) < TOL


@pytest.mark.parametrize("impl", NATIVE)
def test_bitwise_whatever_the_split(rng_seed, impl):
    """A token's output has the same bits alone or in a batch, on any number of threads (every
    output element is one dot product in one fixed order)."""
    need(impl)
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, 5, 4, torch.bfloat16, n=5)
    full = cpu_experts(hidden, w13, w2, rows, weights, threads=2, impl=impl)
    for threads in (1, 3, 7):
        again = cpu_experts(hidden, w13, w2, rows, weights, threads=threads, impl=impl)
        assert torch.equal(again, full), threads
    for t in range(5):
        one = slice(t, t + 1)
        alone = cpu_experts(hidden[one], w13, w2, rows[one], weights[one], threads=1, impl=impl)
        assert torch.equal(alone[0], full[t]), t


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input(rng_seed, impl):
    need(impl)
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, 2, 2, torch.bfloat16)
    rows[1, 1] = N  # past the pool
    with pytest.raises(IndexError, match="out of range"):
        cpu_experts(hidden, w13, w2, rows, weights, impl=impl)
    rows[1, 1] = 0
    with pytest.raises(AssertionError, match="fp32"):
        cpu_experts(hidden, w13, w2, rows, weights, out=torch.empty(2, H).bfloat16(), impl=impl)
    with pytest.raises(AssertionError, match="contiguous"):
        strided = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, not contiguous
        cpu_experts(hidden, strided, w2, rows, weights, impl=impl)


def test_releases_the_gil(rng_seed):
    """While one Python thread is inside the kernel, another keeps running. With the GIL held
    the main thread could run only near the call's ends (up to one 5 ms switch interval), never
    in the middle of a call of 40 ms or more."""
    if not NATIVE:
        pytest.skip("no SIMD kernel on this CPU")
    impl = NATIVE[0]
    need(impl)
    g = torch.Generator().manual_seed(rng_seed)
    w13 = torch.randn(4, 1024, 1024, generator=g) * 0.05  # N = 4, I = 512, H = 1024, fp32
    w2 = torch.randn(4, 1024, 512, generator=g) * 0.05
    t = 8
    while True:  # tokens until one single-threaded call takes >= 40 ms (compute grows with T)
        hidden = torch.randn(t, 1024, generator=g)
        rows = torch.arange(4).repeat(t, 1)  # [T, 4]: every token picks every row
        weights = torch.full((t, 4), 0.25)
        start = time.perf_counter()
        cpu_experts(hidden, w13, w2, rows, weights, threads=1, impl=impl)
        took = time.perf_counter() - start
        if took >= 0.04 or t >= 4096:
            break
        t = int(t * min(8.0, 0.06 / took))
    window: list[float] = []

    def worker():
        t0 = time.perf_counter()
        cpu_experts(hidden, w13, w2, rows, weights, threads=1, impl=impl)
        window.extend([t0, time.perf_counter()])

    seen = []
    th = threading.Thread(target=worker)
    th.start()
    while th.is_alive():
        seen.append(time.perf_counter())
    th.join()
    t0, t1 = window
    lo, hi = t0 + 0.25 * (t1 - t0), t1 - 0.25 * (t1 - t0)
    assert t1 - t0 >= 0.03, t1 - t0
    assert sum(lo < s < hi for s in seen) > 100, (t1 - t0, len(seen))


def test_backend_choice(monkeypatch, caplog):
    if os.environ.get(experts.ENV_BACKEND) is None:
        expected = NATIVE[0] if NATIVE and HAS_COMPILER else "torch"
        assert experts.backend() == expected
    monkeypatch.setattr(experts, "_chosen", None)
    monkeypatch.setenv(experts.ENV_BACKEND, "torch")
    assert experts.backend() == "torch"
    monkeypatch.setattr(experts, "_chosen", None)
    monkeypatch.setenv(experts.ENV_BACKEND, "sse2")
    with pytest.raises(ValueError, match="sse2"):
        experts.backend()
    # No compiler: one warning, and the choice falls through to torch.
    monkeypatch.delenv(experts.ENV_BACKEND)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(experts, "_libs", {})
    monkeypatch.setattr(experts, "_chosen", None)
    with caplog.at_level(logging.WARNING, logger="freetoken.kernels"):
        assert experts.backend() == "torch"
    assert ("unavailable" in caplog.text) == bool(NATIVE), caplog.text


def test_team_leaves_the_driver_a_core_unless_smt_gives_it_one(monkeypatch, rng_seed):
    cores = random.Random(rng_seed).randint(2, 64)
    monkeypatch.setattr(experts, "physical_cores", lambda: cores)
    monkeypatch.setattr(experts.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert experts.team_size() == cores - 1
    monkeypatch.setattr(experts.os, "sched_getaffinity", lambda pid: set(range(2 * cores)))
    assert experts.team_size() == cores
    monkeypatch.setattr(experts, "physical_cores", lambda: 1)
    monkeypatch.setattr(experts.os, "sched_getaffinity", lambda pid: {0})
    assert experts.team_size() == 1


def test_thread_count_comes_from_the_environment_when_set(monkeypatch, rng_seed):
    n = random.Random(rng_seed).randint(1, 64)
    monkeypatch.setattr(experts, "_threads", None)
    monkeypatch.setenv(experts.ENV_THREADS, str(n))
    assert experts.default_threads() == n
    monkeypatch.setattr(experts, "_threads", None)
    monkeypatch.delenv(experts.ENV_THREADS)
    assert experts.default_threads() == experts.team_size()
    monkeypatch.setattr(experts, "_threads", None)
    monkeypatch.setenv(experts.ENV_THREADS, "0")
    with pytest.raises(ValueError, match="FREETOKEN_CPU_THREADS"):
        experts.default_threads()


def test_a_bad_thread_count_fails_the_load_not_a_step(monkeypatch, tmp_path, rng_seed):
    from tiny_models import make_tiny

    from freetoken_agent import Engine
    from freetoken_agent.engine.config import ConfigError

    make_tiny("qwen3_moe", tmp_path, rng_seed)
    monkeypatch.setattr(experts, "_threads", None)
    monkeypatch.setenv(experts.ENV_THREADS, random.Random(rng_seed).choice(["-2", "many", "1.5"]))
    with pytest.raises(ConfigError, match="FREETOKEN_CPU_THREADS"):
        Engine.load(tmp_path, device="cpu", policy="adaptive", expert_slots=3, progress=False)


def test_spin_team_leaves_a_quarter_of_the_cores(monkeypatch, rng_seed):
    """The worker's spinning team leaves the driver, CUDA's and Python's threads a quarter of
    the cores, at least two (a team of 15 of 16 lost barriers to time slices: 31.7 ms jobs)."""
    cores = random.Random(rng_seed).randint(9, 64)
    monkeypatch.setattr(experts, "physical_cores", lambda: cores)
    monkeypatch.delenv(experts.ENV_THREADS, raising=False)
    assert experts.spin_team_size() == cores - cores // 4
    for small, want in ((16, 12), (8, 6), (4, 2), (3, 1), (2, 1), (1, 1)):
        monkeypatch.setattr(experts, "physical_cores", lambda small=small: small)
        assert experts.spin_team_size() == want, small
    n = random.Random(rng_seed + 1).randint(1, 64)
    monkeypatch.setenv(experts.ENV_THREADS, str(n))
    assert experts.spin_team_size() == n


def _sliced_oracle(hidden, w13, w2, rows, weights, c0: int, c1: int) -> torch.Tensor:
    """The experts cut to columns [c0, c1) of their width: gate and up rows, w2's columns."""
    i = w2.shape[2]
    w13_cut = torch.cat([w13[:, c0:c1], w13[:, i + c0 : i + c1]], dim=1)  # [N, 2 (c1 - c0), H]
    return oracle(hidden, w13_cut, w2[:, :, c0:c1], rows, weights)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_column_slice_computes_that_slice_of_each_expert(rng_seed, impl, dtype):
    """The split expert's CPU half: columns [c0, c1) of I, against the experts cut to them."""
    need(impl)
    rng = random.Random(rng_seed)
    t, k = rng.randint(1, 6), rng.choice([1, 2, 8])
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, t, k, dtype, skip=0.2, dup=True)
    c0 = rng.randrange(W)
    c1 = rng.randint(c0 + 1, W)
    out = torch.full((t, H), float("nan"))  # poisoned: every element must be written
    res = cpu_experts(hidden, w13, w2, rows, weights, out=out, threads=3, impl=impl,
                      columns=(c0, c1))  # fmt: skip
    want = _sliced_oracle(hidden, w13, w2, rows, weights, c0, c1)
    if (rows < 0).all():
        assert (res == 0).all()
    else:
        assert rel_err(res, want) < TOL, (c0, c1)


@pytest.mark.parametrize("impl", IMPLS)
def test_complementary_slices_add_up_to_the_whole_expert(rng_seed, impl):
    """SwiGLU is elementwise over I: [0, s) and [s, I) sum to the whole (within fp32's reorder),
    and [0, I) given explicitly is the default call, bit for bit."""
    need(impl)
    rng = random.Random(rng_seed)
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, rng.randint(1, 4), 4, torch.bfloat16)
    whole = cpu_experts(hidden, w13, w2, rows, weights, threads=2, impl=impl)
    explicit = cpu_experts(hidden, w13, w2, rows, weights, threads=2, impl=impl, columns=(0, W))
    assert torch.equal(explicit, whole)
    s = rng.randint(1, W - 1)
    low = cpu_experts(hidden, w13, w2, rows, weights, threads=2, impl=impl, columns=(0, s))
    high = cpu_experts(hidden, w13, w2, rows, weights, threads=2, impl=impl, columns=(s, W))
    assert rel_err(low + high, whole) < TOL
    assert rel_err(low, whole) > 1e-3  # each half alone is not the whole


@pytest.mark.parametrize("impl", IMPLS)
def test_a_column_range_outside_the_width_is_refused_by_name(rng_seed, impl):
    need(impl)
    hidden, w13, w2, rows, weights = make_inputs(rng_seed, 1, 2, torch.float32)
    c = random.Random(rng_seed).randrange(W)
    for bad in ((c, c), (-1, c + 1), (c, W + 1), (c + 1, c)):
        with pytest.raises(ValueError, match="columns"):
            cpu_experts(hidden, w13, w2, rows, weights, impl=impl, columns=bad)
