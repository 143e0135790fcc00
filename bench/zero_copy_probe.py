"""Can kernels read experts straight from pinned host memory, and how fast? (A probe for decode
without host round trips: a miss read over PCIe by the MoE kernel itself instead of a fill.)

    python -m freetoken_agent.bench.zero_copy_probe [--mib 512]

First a Triton kernel that loads a pinned host tensor and stores it on the device, for grids of
G programs striding over it, beside cudaMemcpyAsync of the same bytes (B_P). Then the decision
that matters: one MoE layer of the Qwen3.6 shape (H 2048, I 512, 256 experts of 6.3 MB) at one
token, top-8, with 8 and with 2 experts missing: the decode kernels reading the missing ones
from the pinned host bank (fused_moe's host banks), against copying them in first (a fill) and
against all in HBM, the bits of the first two compared."""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["programs"])
def _strided_copy(src_ptr, dst_ptr, n, programs, BLOCK: tl.constexpr):
    start = tl.program_id(0) * BLOCK
    for base in range(start, n, BLOCK * programs):
        offs = base + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _gbps(fn, nbytes: int, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    a = ap.parse_args(argv)
    n = (a.mib << 20) // 2
    host = torch.randn(n, dtype=torch.float32).to(torch.bfloat16).pin_memory()
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    nbytes = n * 2
    print(f"memcpy H2D {_gbps(lambda: dev.copy_(host, non_blocking=True), nbytes):.1f} GB/s")
    for block in (2048, 8192):
        for programs in (16, 66, 132, 264, 528):

            def run(block=block, programs=programs):
                _strided_copy[(programs,)](host, dev, n, programs, BLOCK=block)

            try:
                gb = _gbps(run, nbytes)
            except Exception as e:  # noqa: BLE001 - a refused host pointer is the answer too
                print(f"zero-copy refused: {type(e).__name__}: {e}".splitlines()[0])
                _try_pointer_object(host, dev, n)
                return
            ok = torch.equal(dev[:4096].cpu(), host[:4096])
            print(f"zero-copy BLOCK {block:5d} programs {programs:4d}: {gb:6.1f} GB/s  "
                  f"{'exact' if ok else 'WRONG'}")  # fmt: skip
    moe_layer()


class _HostPointer:
    """What Triton needs of a tensor argument (`data_ptr`, `dtype`), without a `device`: the
    fallback to try if Triton refuses a CPU tensor outright."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _try_pointer_object(host: torch.Tensor, dev: torch.Tensor, n: int) -> None:
    try:
        _strided_copy[(132,)](_HostPointer(host), dev, n, 132, BLOCK=8192)
        torch.cuda.synchronize()
        ok = torch.equal(dev[:4096].cpu(), host[:4096])
        print(f"zero-copy through a pointer object: {'exact' if ok else 'WRONG'}")
    except Exception as e:  # noqa: BLE001
        print(f"pointer object refused too: {type(e).__name__}: {e}".splitlines()[0])


def moe_layer(experts: int = 256, h: int = 2048, i: int = 512, k: int = 8, reps: int = 30) -> None:
    """One MoE layer at one token of the Qwen3.6 shape, `missing` of its k experts not in slots:
    the decode kernels reading those from the pinned host bank themselves (host_w13/host_w2),
    against copying them into slots first (a fill, today's miss), and all k from HBM."""
    from freetoken_agent.kernels.reference import host_ids
    from freetoken_agent.kernels.triton.fused_moe import fused_moe_decode

    gen = torch.Generator().manual_seed(0)
    host13 = (torch.randn(experts, 2 * i, h, generator=gen) * 0.02).to(torch.bfloat16)
    host2 = (torch.randn(experts, h, i, generator=gen) * 0.02).to(torch.bfloat16)
    host13, host2 = host13.pin_memory(), host2.pin_memory()
    dev13, dev2 = host13.cuda(), host2.cuda()  # every expert in HBM: slot row = expert id
    x = torch.randn(1, h, device="cuda").to(torch.bfloat16)
    w = torch.softmax(torch.randn(1, k, device="cuda"), -1)
    expert_bytes = 3 * h * i * 2
    picks = [torch.randperm(experts)[:k] for _ in range(reps)]
    print(f"moe layer, top-{k} of {experts} experts of {expert_bytes / 1e6:.1f} MB, one token:")

    def timed(fn, args) -> float:
        fn(*args[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a in args:
            fn(*a)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / len(args) * 1e6

    for missing in (k, 2):
        # Pairs 0..missing-1 miss: direct, their ids name host rows; filled, their expert is
        # copied over its HBM row first (the same bytes a fill moves), then read from HBM.
        direct = [
            (torch.cat([host_ids(p[:missing]), p[missing:]]).view(1, k).cuda(),) for p in picks
        ]
        filled = [(p[:missing].tolist(), p.view(1, k).cuda()) for p in picks]

        def run_direct(ids):
            return fused_moe_decode(x, dev13, dev2, ids, w, host_w13=host13, host_w2=host2)

        def run_filled(lids, ids):
            for e in lids:
                dev13[e].copy_(host13[e], non_blocking=True)
                dev2[e].copy_(host2[e], non_blocking=True)
            return fused_moe_decode(x, dev13, dev2, ids, w)

        try:
            same = torch.equal(run_direct(*direct[0]), run_filled(*filled[0]))
        except Exception as e:  # noqa: BLE001 - a refused host pointer is the answer too
            print(f"  moe from host refused: {type(e).__name__}: {e}".splitlines()[0])
            return
        hbm = timed(lambda ids: fused_moe_decode(x, dev13, dev2, ids, w), [(f[1],) for f in filled])
        zc, fill = timed(run_direct, direct), timed(run_filled, filled)
        moved = missing * expert_bytes / 1e9
        print(f"  {missing} missing: all in HBM {hbm:7.1f} us; read from host {zc:7.1f} us "
              f"({moved / max(zc - hbm, 1e-3) * 1e6:.1f} GB/s over HBM's time); fill + HBM "
              f"{fill:7.1f} us; bits equal: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
