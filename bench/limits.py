"""Physical limits measured in the same run as the figures they bound (DESIGN section 7)."""

from __future__ import annotations

import contextlib
import math
import time

import torch

from freetoken_agent.engine.snapshot_rows import MIN_KEPT


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


def decode_floor_s(device_bytes: float, host_bytes: float, b_hbm: float, b_miss: float) -> float:
    """The shortest a decode step can take (DESIGN section 7): the bytes it reads from HBM
    (dense weights, hit experts, KV) at B_HBM, then its missed experts' bytes at `b_miss`, the
    rate they can leave host memory (`host_paths`: the link and the CPU together, whichever
    policy ran the step; host_caps.py says why)."""
    return device_bytes / b_hbm + host_bytes / b_miss


def decode_floor_overlapped_s(
    dense_bytes: float, hit_bytes: float, host_bytes: float, b_hbm: float, b_miss: float
) -> float:
    """A lower floor than `decode_floor_s`: the hit experts' HBM reads overlapping the misses'
    host reads, as adaptive's CPU branch runs beside the GPU's experts (a layer's misses are
    known only once its router ran, so the dense bytes stay in series). DESIGN section 7's
    floor adds the two; this one is the bound no schedule of the same bytes can beat, reported
    beside it (`of_overlap_limit`) so a share of DESIGN's limit is not read as more than it is.
    Summed over the step, not per layer: lower still, so still a bound."""
    return dense_bytes / b_hbm + max(hit_bytes / b_hbm, host_bytes / b_miss)


def streamed_chunks(tokens: int, chunk: int, stream_min: int, cuts: bool) -> int:
    """The fewest chunks of a `tokens`-long prefill that stream every layer's experts (those of
    `stream_min` tokens or more). Without `cuts` the scheduler takes whole chunks, then the
    rest. With them (a model with recurrent layers: engine/snapshot_rows.py) a chunk planned
    at n = min(tokens left, chunk) may end at any length from 3/4 n (MIN_KEPT) up, at a
    checkpoint's boundary, while the pool has rows (a request alone in its steps, as in the
    benches). Then, while more than a chunk is left, each chunk streams where 3/4 of a chunk
    does (else every chunk may stay below `stream_min`: none), the fewest are whole ones, and
    the rest, r, streams only where even 3/4 r reaches `stream_min`."""
    if tokens <= 0:
        return 0
    if not cuts:
        full, rest = divmod(tokens, chunk)
        return full * (chunk >= stream_min) + (rest >= stream_min)
    if _shortest(chunk) < stream_min:
        return 0
    n = -(-tokens // chunk)
    return n - 1 + (_shortest(tokens - (n - 1) * chunk) >= stream_min)


def _shortest(n: int) -> int:
    """The shortest a chunk planned at n tokens may end (snapshot_rows.chunk_length)."""
    return math.ceil(MIN_KEPT * n)


def streamed_prefill_floor_s(
    tokens: int, chunk: int, stream_min: int, cuts: bool, chunk_bytes: float, b_p: float
) -> float | None:
    """The shortest a prefill of `tokens` on an offloaded bank can take over the link (DESIGN
    section 7's prefill bound): each streamed chunk (`streamed_chunks`) moves `chunk_bytes`
    (the experts not resident: at least the pool less what every slot can hold) at B_P. Not
    tokens / a rate: a chunk streams whole whatever its length. None where no chunk streams:
    a short prefill fills slots with the experts its tokens route to, which only the routing
    says."""
    n = streamed_chunks(tokens, chunk, stream_min, cuts)
    return n * chunk_bytes / b_p if n else None


def host_paths_bandwidth(
    w13: torch.Tensor, w2: torch.Tensor, device: torch.device, seconds: float = 1.0
) -> dict[str, float]:
    """Bytes/s leaving host memory with both of decode's miss paths reading it at once: pinned
    copies of pool rows to the device (the link) while the SIMD expert kernel runs 8 random
    experts a call on another thread (the CPU branch), over `seconds`. This, not a torch sum
    (which read 74 GB/s where the engine's two paths together moved ~72 GB/s averaged over whole
    steps, twentieth session), is the cap on B_P + B_H. w13 [N, 2I, H], w2 [N, H, I]: the pool.
    Returns the combined rate and each path's share of it."""
    import threading

    from freetoken_agent.engine.experts.calibration import cpu_experts

    n_rows, hidden = w13.shape[0], w13.shape[2]
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    # The link copies whole experts, as fills do: a pool pinned in chunks is registered per
    # chunk, and one copy across two registrations fails.
    batch = min(16, n_rows)
    dst13 = torch.empty((batch, *w13.shape[1:]), dtype=w13.dtype, device=device)
    dst2 = torch.empty((batch, *w2.shape[1:]), dtype=w2.dtype, device=device)
    # On a CPU "device" (the tests) the link is a host memcpy: the same loop, no stream.
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    x = torch.randn(1, hidden, dtype=w13.dtype)
    k = min(8, n_rows)
    weights = torch.full((1, k), 1.0 / k)
    stop = threading.Event()
    cpu_bytes = [0]

    def cpu_branch() -> None:
        while not stop.is_set():
            rows = torch.randperm(n_rows)[:k].view(1, k)
            cpu_experts(x, w13, w2, rows, weights)
            cpu_bytes[0] += k * expert_bytes

    cpu_experts(x, w13, w2, torch.arange(k).view(1, k), weights)  # build and warm the kernel
    thread = threading.Thread(target=cpu_branch, daemon=True)
    dma_bytes = 0
    start = time.perf_counter()
    thread.start()
    try:
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            while time.perf_counter() - start < seconds:
                for j, row in enumerate(torch.randperm(n_rows)[:batch].tolist()):
                    dst13[j].copy_(w13[row], non_blocking=cuda)
                    dst2[j].copy_(w2[row], non_blocking=cuda)
                if cuda:
                    stream.synchronize()
                dma_bytes += batch * expert_bytes
    finally:
        stop.set()
        thread.join()
    elapsed = time.perf_counter() - start
    return {
        "both_gb_s": (dma_bytes + cpu_bytes[0]) / elapsed / 1e9,
        "link_gb_s": dma_bytes / elapsed / 1e9,
        "cpu_gb_s": cpu_bytes[0] / elapsed / 1e9,
    }
