"""Can kernels read experts straight from pinned host memory, and how fast? (A probe for decode
without host round trips: a miss read over PCIe by the MoE kernel itself instead of a fill.)

    python -m freetoken_agent.bench.zero_copy_probe [--mib 512]

Prints GB/s of a Triton kernel that loads a pinned host tensor (UVA) and stores it on the
device, for grids of G programs each striding over the buffer, beside cudaMemcpyAsync of the
same bytes (B_P). Then the decision that matters: one MoE layer of the Qwen3.6 shape (H 2048,
I 512, 256 experts of 6.3 MB) at one token, top-8, all 8 experts missing, computed by the decode
kernels (a) from HBM, (b) straight from the pinned host bank, (c) after copying the 8 experts
into slots (what a fill costs today), with (b)'s bits checked against (a)'s."""

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
                return
            ok = torch.equal(dev[:4096].cpu(), host[:4096])
            print(f"zero-copy BLOCK {block:5d} programs {programs:4d}: {gb:6.1f} GB/s  "
                  f"{'exact' if ok else 'WRONG'}")  # fmt: skip
    moe_layer()


def moe_layer(experts: int = 256, h: int = 2048, i: int = 512, k: int = 8, reps: int = 30) -> None:
    """One MoE layer, one token, its k experts all missing: the decode kernels reading them from
    HBM, from the pinned host bank (zero-copy), and from slots just filled by cudaMemcpyAsync."""
    from freetoken_agent.kernels.reference import check_moe_shapes
    from freetoken_agent.kernels.triton import fused_moe as triton_moe

    gen = torch.Generator().manual_seed(0)
    host13 = (torch.randn(experts, 2 * i, h, generator=gen) * 0.02).to(torch.bfloat16)
    host2 = (torch.randn(experts, h, i, generator=gen) * 0.02).to(torch.bfloat16)
    host13, host2 = host13.pin_memory(), host2.pin_memory()
    dev13, dev2 = host13.cuda(), host2.cuda()
    slots13, slots2 = torch.empty_like(dev13[:k]), torch.empty_like(dev2[:k])
    x = torch.randn(1, h, device="cuda").to(torch.bfloat16)
    w = torch.softmax(torch.randn(1, k, device="cuda"), -1)
    expert_bytes = (3 * h * i) * 2
    # The launcher insists on one device; the probe lifts that for the host bank only.
    checked = triton_moe._check
    triton_moe._check = lambda *a: check_moe_shapes(*a)
    try:
        ids = [torch.randperm(experts)[:k].view(1, k).cuda() for _ in range(reps)]
        slot_ids = torch.arange(k, device="cuda").view(1, k)

        on_host = {id(r): r[0].tolist() for r in ids}  # the fill loop's ids, read beforehand

        def timed(fn) -> float:
            fn(ids[0])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for r in ids:
                fn(r)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / len(ids) * 1e6

        def filled(r):
            for j, e in enumerate(on_host[id(r)]):
                slots13[j].copy_(host13[e], non_blocking=True)
                slots2[j].copy_(host2[e], non_blocking=True)
            return triton_moe.fused_moe_decode(x, slots13, slots2, slot_ids, w)

        try:
            direct = triton_moe.fused_moe_decode(x, host13, host2, ids[0], w)
        except Exception as e:  # noqa: BLE001 - a refused host pointer is the answer too
            print(f"moe from host refused: {type(e).__name__}: {e}".splitlines()[0])
            return
        same = torch.equal(direct, triton_moe.fused_moe_decode(x, dev13, dev2, ids[0], w))
        hbm = timed(lambda r: triton_moe.fused_moe_decode(x, dev13, dev2, r, w))
        zc = timed(lambda r: triton_moe.fused_moe_decode(x, host13, host2, r, w))
        fill = timed(filled)
    finally:
        triton_moe._check = checked
    moved = k * expert_bytes / 1e9
    print(f"moe layer, {k} of {experts} experts of {expert_bytes / 1e6:.1f} MB, one token:")
    print(f"  from HBM      {hbm:8.1f} us")
    print(f"  from host     {zc:8.1f} us  ({moved / zc * 1e6:.1f} GB/s)  bits equal: {same}")
    print(f"  fill + HBM    {fill:8.1f} us  ({moved / fill * 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
