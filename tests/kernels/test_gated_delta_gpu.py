"""Gated DeltaNet kernels on CUDA at the real shape (Qwen3-Next / Qwen3.5-MoE), bf16 and fp32:
Triton vs the fp64 reference, and the decode step captured in a CUDA graph. Skipped without a
CUDA device (conftest.py); the CPU-side tests are in test_gated_delta.py.
"""

# T tokens (packed over B sequences), Hk / Hv key / value heads, Dk / Dv head dims, N state
# slots, Cn checkpoint rows, C conv channels, K conv width

from __future__ import annotations

import pytest
import torch
from gated_delta_inputs import Delta, fp64_reference, make_conv, make_delta
from torch import Tensor

from freetoken_agent.kernels.gated_delta import causal_conv1d, gated_delta_rule
from freetoken_agent.kernels.triton.gated_delta import gated_delta_rule as triton_delta

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def triton_run(d: Delta, form: str | None = None) -> Tensor:
    """The dispatcher's own pick (form None) or the launcher with a forced form."""
    if form is None:
        return gated_delta_rule(*d.args(), force_triton=True)
    return triton_delta(*d.args(), form=form)


REAL = dict(hk=16, hv=32, dk=128, dv=128)
# Tolerances, against an fp64 reference fed the very same (bf16-rounded) inputs. The kernels
# differ from it only by fp32 rounding (the chunked form: tf32x3 matmuls, about fp32 accuracy):
# ~1e-7 relative per step, and the delta rule with |k| = 1, 0 < beta < 1, g <= 0 is
# non-expansive, so errors grow at most linearly, in practice like sqrt(T): ~1e-5 of the state's
# scale after 4096 tokens. 2e-4 leaves margin and still catches any wrong index or missed step
# (those err by O(1)). bf16 outputs add one rounding, 2^-9 relative: rtol 1e-2.
GPU_TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (2e-4, 1e-2)}  # (atol x scale, rtol)


def gpu_close(out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    atol, rtol = GPU_TOL[dtype]
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, atol=atol * scale, rtol=rtol)


GPU_CASES = [("recurrent", [1] * b) for b in (1, 3, 8)] + [
    (form, lens) for form in ("recurrent", "chunk") for lens in ([4096], [1000, 1, 0, 2047, 64])
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("form, lens", GPU_CASES, ids=str)
def test_gpu_matches_reference(rng_seed: int, form: str, lens: list[int],
                               dtype: torch.dtype) -> None:  # fmt: skip
    """Decode batches (seq_bounds None) and packed prefill, each Triton form, snapshots on."""
    decode = set(lens) == {1}
    d = make_delta(rng_seed, lens, **REAL, dtype=dtype, device="cuda", decode=decode, snaps=3)
    ref = fp64_reference(d)
    out = triton_run(d, form)
    assert out.dtype == dtype and not out.isnan().any()
    gpu_close(out, ref.v, dtype)
    gpu_close(d.state, ref.state, torch.float32)  # the state is fp32 whatever the model dtype
    gpu_close(d.snap_out, ref.snap_out, torch.float32)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph(rng_seed: int) -> None:
    """Capture the decode step (delta rule + conv, snapshots on) once; replay on new tokens,
    slots and snapshot rows: the same bits as eager calls."""
    B = 4
    gen = torch.Generator(device="cuda").manual_seed(rng_seed)
    d = make_delta(rng_seed, [1] * B, **REAL, dtype=torch.bfloat16, device="cuda", decode=True,
                   snaps=2)  # fmt: skip
    c = make_conv(rng_seed, [1] * B, c=1024, dtype=torch.bfloat16, decode=True, device="cuda")

    def step() -> tuple[Tensor, Tensor]:
        return gated_delta_rule(*d.args()), causal_conv1d(*c.args())

    def set_inputs() -> None:  # in place: the graph keeps the buffers' addresses
        for t in (d.q, d.k, d.v, d.beta, c.x):
            t.copy_(torch.rand(t.shape, device="cuda", generator=gen))
        d.g.copy_(-torch.rand(d.g.shape, device="cuda", generator=gen))
        d.slots.copy_(torch.randperm(d.state.shape[0], device="cuda", generator=gen)[:B])
        c.slots.copy_(d.slots)
        rows = torch.randperm(B, device="cuda", generator=gen)
        for snap in (d.snap_slots, c.snap_slots):
            snap.copy_(torch.where(rows < 2, rows, -1))

    pools = (d.state, d.snap_out, c.state, c.snap_out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        set_inputs()
        saved = [p.clone() for p in pools]
        graph.replay()
        replayed = [t.clone() for t in (*outs, *pools)]
        for p, s in zip(pools, saved, strict=True):
            p.copy_(s)
        eager = [*step(), *pools]
        for r, e in zip(replayed, eager, strict=True):
            torch.testing.assert_close(r, e, atol=0, rtol=0)
        assert not any(p.equal(s) for p, s in zip(pools, saved, strict=True))  # all were written


@pytest.mark.gpu
def test_gpu_no_recompile_for_new_prompt_lengths(rng_seed: int) -> None:
    """Prefills whose chunk counts differ (odd, even, 1, multiples of 16) reuse the chunked
    kernels compiled for the first: on the device an odd chunk count had compiled the scan
    kernel again (~5 s) inside an agent's turn."""
    import random

    from freetoken_agent.kernels.triton.gated_delta import _chunk_scan_kernel, _chunk_solve_kernel

    def compiled() -> int:  # variants in Triton's in-memory caches, every device
        kernels = (_chunk_scan_kernel, _chunk_solve_kernel)
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    rng = random.Random(rng_seed)
    lens = [[64 * n - rng.randrange(64)] for n in (1, 2, 9, 16, 33)] + [[571], [465, 130]]
    rng.shuffle(lens)
    counts = []
    for i, ls in enumerate(lens):
        d = make_delta(rng_seed + i, ls, **REAL, dtype=torch.bfloat16, device="cuda", snaps=2)
        out = triton_run(d, "chunk")  # its accuracy: test_gpu_matches_reference
        assert out.isfinite().all()
        counts.append(compiled())
    assert counts[-1] == counts[0], (lens, counts)
