"""Physical limits measured in the same run as the figures they bound (DESIGN section 7)."""

from __future__ import annotations

import time

import torch


def hbm_copy_bandwidth(device: torch.device, gib: float = 4.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n // 2, device=device, dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.nbytes / times[len(times) // 2]


def matmul_rate(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """bf16 dense matmul rate in FLOP/s on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3)


def host_read_bandwidth(gib: float = 2.0, repeats: int = 7) -> float:
    """Host memory read bandwidth in bytes/s: a torch sum over a large fp32 buffer, its fastest
    repeat. A limit is the best the host shows: the median once read 52.5 GB/s on the H200 host
    where every other run read 91-92 (fifteenth session), and limits from it sat below what
    the engine measured."""
    buf = torch.ones(int(gib * (1 << 30)) // 4)
    buf.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.nbytes / min(times)


def host_paths(b_p: float, b_h: float, b_read: float) -> float:
    """Bytes/s at which a decode step's misses can leave host memory: the link (B_P) and the
    CPU branch (B_H) run together, but both read host memory, so their sum is capped by its
    read bandwidth (DESIGN section 7)."""
    return min(b_p + b_h, b_read)
