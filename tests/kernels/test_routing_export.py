"""export_routing: a MoE layer's ids, weights and hidden written to host buffers in one launch
(the Triton kernel in Triton's interpreter here; into pinned memory, captured, on the GPU)."""

import pytest
import torch

from freetoken_agent.kernels.routing_export import export_routing


def _inputs(gen: torch.Generator, t: int, k: int, h: int, dtype, device="cpu"):
    ids = torch.randint(0, 512, (t, k), generator=gen, dtype=torch.int32)
    weights = torch.rand(t, k, generator=gen)
    hidden = torch.randn(t, h, generator=gen).to(dtype)
    return ids.to(device), weights.to(device), hidden.to(device)


@pytest.mark.parametrize("force_triton", [True, False])
@pytest.mark.parametrize("programs", ["one", "several"])  # per token (BLOCK hidden elements)
def test_export_writes_exactly_the_rows_asked(rng_seed, force_triton, programs):
    from freetoken_agent.kernels.triton.routing_export import BLOCK

    gen = torch.Generator().manual_seed(rng_seed)
    t_max, k = 4, int(torch.randint(1, 17, (1,), generator=gen))
    lo, hi = (1, BLOCK + 1) if programs == "one" else (BLOCK + 1, 3 * BLOCK)
    h = int(torch.randint(lo, hi, (1,), generator=gen))
    t = int(torch.randint(1, t_max + 1, (1,), generator=gen))
    src = _inputs(gen, t, k, h, torch.float16)
    # Destinations as GraphIO's: [L, T_max, ...] buffers, one layer's first t rows.
    dst = (torch.full((3, t_max, k), -7, dtype=torch.int32),
           torch.full((3, t_max, k), -7.0), torch.full((3, t_max, h), -7.0).half())  # fmt: skip
    before = [d.clone() for d in dst]
    layer = int(torch.randint(3, (1,), generator=gen))
    export_routing(*src, *(d[layer, :t] for d in dst), force_triton=force_triton)
    for s, d, b in zip(src, dst, before, strict=True):
        assert torch.equal(d[layer, :t], s)
        d[layer, :t] = b[layer, :t]
        assert torch.equal(d, b), "wrote outside the layer's rows"


def test_export_converts_on_the_copy_path_and_refuses_a_misfit(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    ids, weights, hidden = _inputs(gen, 2, 3, 40, torch.float32)
    dst = torch.empty(2, 3, dtype=torch.int32), torch.empty(2, 3), torch.empty(2, 40)
    export_routing(ids.long(), weights.double(), hidden, *dst, force_triton=True)
    assert torch.equal(dst[0], ids) and torch.equal(dst[1], weights)
    with pytest.raises(ValueError, match="does not fit"):
        export_routing(ids, weights, hidden, dst[0], dst[1], torch.empty(2, 41))


@pytest.mark.gpu
def test_gpu_export_into_pinned_memory_in_a_captured_graph(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    t, k, h = 4, 8, 2048
    src = _inputs(gen, t, k, h, torch.bfloat16, "cuda")
    dst = (torch.zeros(t, k, dtype=torch.int32).pin_memory(), torch.zeros(t, k).pin_memory(),
           torch.zeros(t, h, dtype=torch.bfloat16).pin_memory())  # fmt: skip
    export_routing(*src, *dst)  # warm-up: the compile, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        export_routing(*src, *dst)
    done = torch.cuda.Event()
    for _ in range(3):  # new values in the same device buffers, one replay each
        for s, new in zip(src, _inputs(gen, t, k, h, torch.bfloat16, "cuda"), strict=True):
            s.copy_(new)
        graph.replay()
        done.record()
        done.synchronize()  # what the host waits on before reading (segmented_graphs.py)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d, s.cpu())


def test_a_kernel_that_cannot_launch_falls_back_to_copies_once(monkeypatch, caplog, rng_seed):
    """The first launch proves the path: a failure there (a driver that refuses kernel stores
    to pinned memory) leaves copies for good, with one warning; after a success, failures
    are real errors."""
    import logging

    from freetoken_agent.kernels import routing_export as dispatcher
    from freetoken_agent.kernels.triton import routing_export as kernel

    gen = torch.Generator().manual_seed(rng_seed)
    calls = []

    def refuse(*args):
        calls.append(1)
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(kernel, "export_routing", refuse)
    monkeypatch.setattr(dispatcher, "_kernel_works", None)
    with caplog.at_level(logging.WARNING, logger="freetoken.kernels"):
        for _ in range(3):
            src = _inputs(gen, 2, 8, 64, torch.float16)
            dst = tuple(torch.empty_like(x) for x in src)
            export_routing(*src, *dst, force_triton=True)
            assert all(torch.equal(d, s) for s, d in zip(src, dst, strict=True))
    assert calls == [1] and len(caplog.records) == 1
    monkeypatch.setattr(dispatcher, "_kernel_works", True)
    with pytest.raises(ValueError, match="Pointer argument"):
        export_routing(*src, *dst, force_triton=True)
