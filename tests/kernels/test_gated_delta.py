"""Gated DeltaNet kernels: the plain-torch twins vs transformers, split / snapshot invariants,
the causal conv vs F.conv1d, Triton (interpreted here, compiled on CUDA) vs the reference.

Fresh random inputs every run (seed printed by `rng_seed`); state pools hold random rows, state
slots are shuffled and rows no sequence owns must come back untouched; outputs allocated by the
launchers are NaN-poisoned (`poisoned_alloc`), checkpoint rows start random. The inputs come
from tests/helpers/gated_delta_inputs.py; the real-shape CUDA tests are in test_gated_delta_gpu.py.
"""

# T tokens (packed over B sequences), Hk / Hv key / value heads, Dk / Dv head dims, N state
# slots, Cn checkpoint rows, C conv channels, K conv width

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from gated_delta_inputs import DEV, F64, Delta, bounds_of, fp64_reference, make_conv, make_delta
from torch import Tensor
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)
from triton.runtime.errors import OutOfResources

from freetoken_agent.kernels import reference_delta
from freetoken_agent.kernels.gated_delta import causal_conv1d, gated_delta_rule
from freetoken_agent.kernels.triton import gated_delta as triton_gated_delta
from freetoken_agent.kernels.triton.gated_delta import gated_delta_rule as triton_delta
from freetoken_agent.kernels.triton.gated_delta import pick_form

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def hf(fn, d: Delta, b: int, state0: Tensor) -> tuple[Tensor, Tensor]:
    """transformers on sequence b from state0: (out [L, Hv, Dv], final state [Hv, Dk, Dv])."""
    s = d.seq(b)
    o, st = fn(d.q[None, s], d.k[None, s], d.v[None, s], d.g[None, s], d.beta[None, s],
               initial_state=state0[None], output_final_state=True,
               use_qk_l2norm_in_kernel=True)  # fmt: skip
    return o[0], st[0]


def close(a: Tensor, b: Tensor, tol: float) -> None:
    torch.testing.assert_close(a, b.to(a.dtype), atol=tol, rtol=tol)


# ---- the reference twins ---------------------------------------------------------------------


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_reference_matches_transformers(rng_seed: int, dtype: torch.dtype, form: str) -> None:
    """Both forms vs both of transformers' functions (which compute in fp32 whatever the input
    dtype: hence the fp32 tolerance for fp64 too), GQA 2, packed, shuffled slots."""
    rng = random.Random(rng_seed)
    lens = [1, 0, rng.randint(2, 63), rng.randint(65, 150), rng.randint(1, 140)]
    rng.shuffle(lens)
    d = make_delta(rng_seed, lens, dtype=dtype, device="cpu")
    before = d.state.clone()
    out = reference_delta.gated_delta_rule(*d.args(), form=form)
    assert out.dtype == dtype
    for b, slot in enumerate(d.slots.tolist()):
        if lens[b] == 0:
            assert torch.equal(d.state[slot], before[slot])
            continue
        for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
            o, st = hf(fn, d, b, before[slot])
            close(out[d.seq(b)], o, 2e-5)
            close(d.state[slot], st, 2e-5)
    untouched = [r for r in range(d.state.shape[0]) if r not in d.slots.tolist()]
    assert torch.equal(d.state[untouched], before[untouched])


def test_chunk_equals_recurrent_fp64(rng_seed: int) -> None:
    lens = [64, 128, 129, 1, 63]
    d = make_delta(rng_seed, lens, dtype=F64, device="cpu", hk=1, hv=3, dk=8, dv=12, snaps=4)
    e = d.clone()
    a = reference_delta.gated_delta_rule(*d.args(), form="chunk")
    b = reference_delta.gated_delta_rule(*e.args(), form="recurrent")
    for x, y in ((a, b), (d.state, e.state), (d.snap_out, e.snap_out)):
        close(x, y, 1e-11)


def sub_call(d: Delta, pieces: list[tuple[int, int, int]], pool: Tensor) -> Delta:
    """A call on tokens [lo, hi) of sequence b for each (b, lo, hi), packed in that order, on
    the state pool `pool`, without snapshots."""
    idx = [int(d.cu[b]) + t for b, lo, hi in pieces for t in range(lo, hi)]
    bounds = bounds_of([hi - lo for _, lo, hi in pieces])
    dev = d.q.device
    return replace(d, q=d.q[idx], k=d.k[idx], v=d.v[idx], g=d.g[idx], beta=d.beta[idx],
                   state=pool, slots=d.slots[[b for b, _, _ in pieces]],
                   cu=torch.tensor(bounds, dtype=torch.int32, device=dev),
                   bounds=bounds, snap_slots=None, snap_out=None)  # fmt: skip


def split_and_snap(run, seed: int, dtype: torch.dtype, tol: float, max_len: int = 90,
                   device: str = "cpu") -> None:  # fmt: skip
    """Two sequences cut at random tokens into two calls (state carried through the pool; one
    piece may be empty) equal one call; a snapshot after token t equals the state that a call
    ending at t leaves."""
    rng = random.Random(seed)
    lens = [rng.randint(2, max_len), rng.randint(1, max_len // 2)]
    d = make_delta(seed, lens, dtype=dtype, device=device, snaps=3)
    whole = d.clone()
    out = run(whole)  # [T, Hv, Dv]
    cuts = [rng.randint(1, lens[0] - 1), rng.randint(0, lens[1])]
    pool = d.state.clone()
    first = run(sub_call(d, [(0, 0, cuts[0]), (1, 0, cuts[1])], pool))
    second = run(sub_call(d, [(0, cuts[0], lens[0]), (1, cuts[1], lens[1])], pool))
    split = torch.cat([first[: cuts[0]], second[: lens[0] - cuts[0]], first[cuts[0] :],
                       second[lens[0] - cuts[0] :]])  # fmt: skip
    close(split, out, tol)
    close(pool, whole.state, tol)
    rows = d.snap_slots.tolist()
    for t, row in enumerate(rows):
        if row >= 0:
            b = int(t >= lens[0])
            pool = d.state.clone()
            run(sub_call(d, [(b, 0, t + 1 - b * lens[0])], pool))
            close(whole.snap_out[row], pool[int(d.slots[b])], tol)
    untouched = [r for r in range(d.snap_out.shape[0]) if r not in rows]
    assert torch.equal(whole.snap_out[untouched], d.snap_out[untouched])


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_reference_split_and_snapshots(rng_seed: int, form: str) -> None:
    split_and_snap(lambda d: reference_delta.gated_delta_rule(*d.args(), form=form), rng_seed,
                   F64, 1e-11)  # fmt: skip


def test_reference_decode_step(rng_seed: int) -> None:
    """seq_bounds None (one vectorised step, snapshots row by row) equals the prefill path."""
    d = make_delta(rng_seed, [1] * 5, device="cpu", decode=True, snaps=3)
    e = replace(d.clone(), bounds=bounds_of([1] * 5))
    close(gated_delta_rule(*d.args()), gated_delta_rule(*e.args()), 1e-6)
    close(d.state, e.state, 1e-6)
    close(d.snap_out, e.snap_out, 1e-6)


# ---- causal conv -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_conv_matches_conv1d(rng_seed: int, dtype: torch.dtype, poisoned_alloc) -> None:
    """Per sequence: F.conv1d over [state; x] (nn.Conv1d's taps), the new state is the last
    K - 1 inputs, a snapshot after t the K - 1 inputs ending at t (lengths 0, 1, 2 < K - 1)."""
    rng = random.Random(rng_seed)
    lens = [0, 1, 2, rng.randint(3, 30), rng.randint(1, 30)]
    rng.shuffle(lens)
    c = make_conv(rng_seed, lens, dtype=dtype)
    state0, snap0 = c.state.clone(), c.snap_out.clone()
    out = causal_conv1d(*c.args())
    taps = c.weight.shape[1]
    for b, slot in enumerate(c.slots.tolist()):
        lo, hi = c.bounds[b], c.bounds[b + 1]
        xs = torch.cat([state0[slot].t(), c.x[lo:hi]])  # [K - 1 + L, C]
        if hi == lo:
            assert torch.equal(c.state[slot], state0[slot])
            continue
        conv = F.conv1d(xs.t()[None], c.weight[:, None, :], groups=xs.shape[1])[0].t()
        close(out[lo:hi], F.silu(conv), 1e-6 if dtype == F64 else 1e-5)
        assert torch.equal(c.state[slot], xs[hi - lo :].t())
        for t in range(lo, hi):
            if c.snap_slots[t] >= 0:
                assert torch.equal(c.snap_out[c.snap_slots[t]], xs[t - lo + 1 : t - lo + taps].t())
    others = [r for r in range(len(state0)) if r not in c.slots.tolist()]
    assert torch.equal(c.state[others], state0[others])
    unsnapped = [r for r in range(len(snap0)) if r not in c.snap_slots.tolist()]
    assert torch.equal(c.snap_out[unsnapped], snap0[unsnapped])


def test_conv_decode_matches_prefill_and_transformers(rng_seed: int) -> None:
    """seq_bounds None (vectorised) equals the prefill path on one token per sequence, and
    transformers' causal_conv1d_update (which keeps K inputs; the oldest is never read)."""
    c = make_conv(rng_seed, [1] * 6, decode=True)
    p = replace(c, state=c.state.clone(), snap_out=c.snap_out.clone(), bounds=bounds_of([1] * 6))
    window = torch.cat([torch.randn(6, c.x.shape[1], 1), c.state[c.slots]], -1)  # [B, C, K]
    hf_out = causal_conv1d_update(c.x[:, :, None], window, c.weight, None, "silu")[..., 0]
    out = causal_conv1d(*c.args())
    close(out, causal_conv1d(*p.args()), 1e-6)
    close(out, hf_out, 1e-6)
    assert torch.equal(c.state, p.state) and torch.equal(c.snap_out, p.snap_out)
    assert torch.equal(c.state[c.slots], window[..., 1:])  # transformers' updated window


# ---- launchers: clear errors, no host sync on the decode path --------------------------------


def test_launcher_errors(rng_seed: int) -> None:
    d = make_delta(rng_seed, [2, 3], device="cpu")
    with pytest.raises(AssertionError, match="cu_seqlens must be"):
        gated_delta_rule(*replace(d, cu=d.cu.long()).args())
    with pytest.raises(AssertionError, match="seq_bounds=None means decode"):
        gated_delta_rule(*replace(d, bounds=None).args())
    with pytest.raises(AssertionError, match="Hv=4 value heads must be a multiple of Hk=3"):
        three = dict(q=d.q.repeat(1, 2, 1)[:, :3], k=d.k.repeat(1, 2, 1)[:, :3])
        gated_delta_rule(*replace(d, **three).args())
    with pytest.raises(AssertionError, match="snap_slots and snap_out come together"):
        gated_delta_rule(*replace(d, snap_slots=torch.full((5,), -1)).args())
    with pytest.raises(AssertionError, match="must be a power of two"):
        e = make_delta(rng_seed, [2, 3], dk=24, device="cpu")
        gated_delta_rule(*e.args(), force_triton=True)
    c = make_conv(rng_seed, [2, 3])
    with pytest.raises(AssertionError, match="conv_state must be"):
        causal_conv1d(*replace(c, state=c.state.double()).args())


def test_decode_path_has_no_host_sync(rng_seed: int) -> None:
    """The seq_bounds=None paths run on meta tensors, which hold no data: any .item(),
    .tolist() or data-dependent shape would raise. (CUDA graphs are checked on the device.)"""
    d = make_delta(rng_seed, [1] * 3, decode=True, snaps=2, device="meta")
    assert gated_delta_rule(*d.args()).shape == d.v.shape
    c = make_conv(rng_seed, [1] * 3, decode=True, device="meta")
    assert causal_conv1d(*c.args()).shape == c.x.shape


# ---- Triton (interpreted on the CPU, compiled on CUDA) vs the reference ----------------------

TRITON_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: one output rounding apart


def triton_run(d: Delta, form: str | None = None) -> Tensor:
    """The dispatcher's own pick (form None) or the launcher with a forced form."""
    if form is None:
        return gated_delta_rule(*d.args(), force_triton=True)
    return triton_delta(*d.args(), form=form)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("scenario", ["decode", "recurrent", "chunk"])
def test_triton_matches_reference(rng_seed: int, scenario: str, dtype: torch.dtype,
                                  poisoned_alloc) -> None:  # fmt: skip
    """Through the dispatcher, which picks the chunked form once a sequence has 64 tokens.
    Dv = 24: a full and a masked column block (BV 16), or one masked block (chunked, BV 32);
    GQA 2; empty and one-token sequences; several chunks; snapshots; shuffled slots."""
    rng = random.Random(rng_seed)
    decode = scenario == "decode"
    lens = [0, 1, rng.randint(2, 12), rng.randint(64, 100) if scenario == "chunk" else 20]
    lens = [1] * rng.randint(1, 5) if decode else lens
    rng.shuffle(lens)
    d = make_delta(rng_seed, lens, dv=24, dtype=dtype, decode=decode, snaps=4)
    assert pick_form(d.bounds, 16, False) == ("recurrent" if decode else scenario)
    e = d.clone()
    close(triton_run(d), reference_delta.gated_delta_rule(*e.args()), TRITON_TOL[dtype])
    close(d.state, e.state, 1e-5)  # every row: the unowned ones must be untouched
    close(d.snap_out, e.snap_out, 1e-5)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_triton_split_and_snapshots(rng_seed: int, form: str) -> None:
    max_len = 100 if form == "chunk" else 24  # the interpreter walks tokens slowly
    split_and_snap(lambda d: triton_run(d, form), rng_seed, torch.float32, 1e-5, max_len, DEV)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_triton_alike_keys(rng_seed: int, form: str) -> None:
    """The hard case for the chunk's triangular solve: keys nearly parallel, beta near 1, no
    decay, so A's entries are near 1 and every substitution step matters (random keys make
    A's high powers vanish). Against the fp64 reference."""
    d = make_delta(rng_seed, [128], hk=1, hv=2, dk=16, dv=16)
    d.k = d.k[:1] + 0.05 * d.k
    d.g, d.beta = d.g * 1e-3, 0.9 + 0.1 * d.beta
    ref = fp64_reference(d)
    close(triton_run(d, form), ref.v, 2e-5)
    close(d.state, ref.state, 2e-5)


def test_triton_chunk_falls_back_when_shared_memory_is_short(rng_seed, monkeypatch) -> None:
    """A GPU that cannot hold the chunk tiles (Triton refuses the launch) prefills with the
    recurrent kernel from then on; a forced chunk form re-raises."""

    def refuse(*args) -> None:
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr(triton_gated_delta, "_launch_chunked", refuse)
    monkeypatch.setattr(triton_gated_delta, "_NO_CHUNK", set())
    d = make_delta(rng_seed, [64], hk=1, hv=1)
    e = d.clone()
    close(triton_run(d), reference_delta.gated_delta_rule(*e.args()), 1e-5)
    assert (d.q.device, 16) in triton_gated_delta._NO_CHUNK
    with pytest.raises(OutOfResources):
        triton_run(d, "chunk")


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_triton_strided_inputs(rng_seed: int, form: str) -> None:
    """q, k, v as the model makes them: views into one [T, 2 Hk Dk + Hv Dv] conv output."""
    d = make_delta(rng_seed, [3, 5], hk=1, hv=2, dk=16, dv=16)
    mixed = torch.cat([d.q.flatten(1), d.k.flatten(1), d.v.flatten(1)], 1)  # [T, 64]
    q, k, v = mixed.split([16, 16, 32], 1)
    s = replace(d.clone(), q=q.view(-1, 1, 16), k=k.view(-1, 1, 16), v=v.view(-1, 2, 16))
    close(triton_run(s, form), triton_run(d, form), 0)
    close(s.state, d.state, 0)


def test_chunk_table_first_is_16_byte_aligned(rng_seed: int) -> None:
    """The scan kernel's `first` pointer starts 16-byte aligned for every chunk count (Triton
    compiles a variant per alignment: an odd count had cost a ~5 s compile mid-session), and
    the table holds starts, ends and firsts where the kernels read them."""
    rng = random.Random(rng_seed)
    for _ in range(50):
        nc, b = rng.randint(1, 300), rng.randint(1, 9)
        starts = [rng.randrange(10**6) for _ in range(nc)]
        ends = [s + rng.randint(1, 64) for s in starts]
        first = sorted(rng.randrange(nc) for _ in range(b))
        table, at = triton_gated_delta.chunk_table(starts, ends, first, torch.device("cpu"))
        assert table.dtype == torch.int32 and table[at:].data_ptr() % 16 == 0
        assert table[:nc].tolist() == starts and table[nc : 2 * nc].tolist() == ends
        assert table[at:].tolist() == first and 2 * nc <= at < 2 * nc + 4
