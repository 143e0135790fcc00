"""Can kernels read experts straight from pinned host memory, and how fast? (A probe for decode
without host round trips: a miss read over PCIe by the MoE kernel itself instead of a fill.)

    python -m freetoken_agent.bench.zero_copy_probe [--mib 512]

Prints GB/s of a Triton kernel that loads a pinned host tensor (UVA) and stores it on the
device, for grids of G programs each striding over the buffer, beside cudaMemcpyAsync of the
same bytes (B_P)."""

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


if __name__ == "__main__":
    main()
