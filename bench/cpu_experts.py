"""CPU expert kernel throughput beside the host's read bandwidth, measured in the same run.

    python -m freetoken_agent.bench.cpu_experts [--threads N] [--pool-gb 2.5] [--gap-us 0 300]
        [--out [PATH]]

Limit: host read bandwidth, a torch sum over a 2 GiB fp32 buffer on all threads: the fastest
of 7 repeats (limits.host_read_bandwidth), measured before and after the kernel, the higher kept.
Kernel: the Qwen3-30B-A3B expert (H 2048, I 768, K 8), bf16, from a pool of at least 2 GiB and
4x the L3 cache. Each call's rows continue a sweep through a random permutation of the pool, so
a row is read again only after the whole pool has been: no cache helps, as in decode, where every
layer reads its own rows. Weight GB/s = bytes of the call's distinct rows / call time, calls back
to back after warm-up calls (the first calls after an idle spell run slow on small VMs); median
and best over the calls. The plain-torch path runs at T = 1 for context. Target (issue 3, item
6): >= 70% of the read bandwidth at one token. JSON goes to bench/results/cpu_experts.json only
with --out.

Shape legend: T tokens, H hidden, I expert width, K top-k, N pool rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from freetoken_agent.bench.limits import host_read_bandwidth
from freetoken_agent.engine.host_memory import page_exclusive
from freetoken_agent.help_format import DefaultsHelpFormatter
from freetoken_agent.kernels.cpu import experts

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(h=2048, i=768, k=8)  # Qwen3-30B-A3B experts
TARGET = 0.70


def l3_bytes() -> int:
    """The largest cache cpu0 reports (sysfs); 0 when unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        best = max(best, int(size.rstrip("KMG")) * scale)
    return best


def anon_huge_kb() -> int | None:
    """The kernel's count of anonymous memory in transparent huge pages (Linux), in kB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def make_pool(n: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [N, 2I, H], w2 [N, H, I] bf16, std 0.05: a random block of 16 experts, tiled (the
    values do not change the timing; drawing gigabytes of normals would take minutes). Memory
    as the engine's pool has it (`host_memory.page_exclusive`: huge pages when asked)."""
    g = torch.Generator().manual_seed(0)
    block = min(16, n)
    a = (torch.randn(block, 2 * i, h, generator=g) * 0.05).bfloat16()
    b = (torch.randn(block, h, i, generator=g) * 0.05).bfloat16()
    w13 = page_exclusive((n, 2 * i, h), torch.bfloat16)
    w2 = page_exclusive((n, h, i), torch.bfloat16)
    for lo in range(0, n, block):
        m = min(block, n - lo)
        w13[lo : lo + m], w2[lo : lo + m] = a[:m], b[:m]
    return w13, w2


def busy_wait(seconds: float) -> None:
    """Keep the calling thread busy, as the host is between two stopping layers of a decode
    step (its own Python work, waiting on the device), while the kernel's team idles."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def time_kernel(
    impl: str,
    t: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    threads: int,
    calls: int,
    warm: int,
    gap_s: float = 0.0,
) -> dict:
    """`gap_s`: the calling thread stays busy this long before each call (decode's stops are
    ~0.2-0.5 ms apart: an OpenMP team that went to sleep in between pays its wake-up)."""
    n, h, k = w13.shape[0], w13.shape[2], SHAPE["k"]
    g = torch.Generator().manual_seed(t)
    sweep = torch.randperm(n, generator=g)
    hidden = torch.randn(t, h, generator=g).bfloat16()  # [T, H]
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)  # [T, K]
    out = torch.empty(t, h)
    expert_bytes = w13[0].nbytes + w2[0].nbytes
    pos, rates, total_bytes, total_time = 0, [], 0, 0.0
    for c in range(warm + calls):
        idx = torch.arange(pos, pos + t * k) % n
        pos += t * k
        rows = sweep[idx].view(t, k)  # [T, K] distinct rows, none read since the last sweep
        busy_wait(gap_s)
        start = time.perf_counter()
        experts.cpu_experts(hidden, w13, w2, rows, weights, out=out, threads=threads, impl=impl)
        took = time.perf_counter() - start
        if c >= warm:
            nbytes = rows.unique().numel() * expert_bytes
            rates.append(nbytes / took)
            total_bytes, total_time = total_bytes + nbytes, total_time + took
    rates.sort()
    return dict(
        impl=impl,
        tokens=t,
        rows_per_call=t * k,
        mb_per_call=t * k * expert_bytes / 1e6,
        ms_per_call=1e3 * total_time / calls,
        gbs_median=rates[len(rates) // 2] / 1e9,
        gbs_best=rates[-1] / 1e9,
        gbs_mean=total_bytes / total_time / 1e9,
        calls=calls,
        gap_us=gap_s * 1e6,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench cpu-experts",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=None, help="default: physical cores")
    parser.add_argument("--pool-gb", type=float, default=2.5, help="pool size (GB, >= 2 GiB)")
    parser.add_argument("--calls", type=int, default=60, help="timed calls per row")
    parser.add_argument("--no-torch", action="store_true", help="skip the plain-torch path")
    parser.add_argument(
        "--gap-us",
        type=float,
        nargs="+",
        default=[0.0],
        help="busy host time before each call (us), one row per value: decode's stops are "
        "0.2-0.5 ms apart; compare with OMP_WAIT_POLICY / GOMP_SPINCOUNT set",
    )
    parser.add_argument(
        "--out",
        type=Path,
        nargs="?",
        const=RESULTS / "cpu_experts.json",
        default=None,
        help="write the JSON results (no path: bench/results/cpu_experts.json)",
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="the pool in transparent huge pages (as FREETOKEN_HUGE_PAGES=1 makes the engine's)",
    )
    args = parser.parse_args(argv)
    if args.huge_pages:
        os.environ["FREETOKEN_HUGE_PAGES"] = "1"
    threads = args.threads or experts.physical_cores()
    torch.set_num_threads(threads)
    h, i = SHAPE["h"], SHAPE["i"]
    expert_bytes = 3 * h * i * 2
    l3 = l3_bytes()
    pool_bytes = max(args.pool_gb * 1e9, 2 * (1 << 30), 4 * l3)
    n = int(pool_bytes // expert_bytes) + 1
    backend = experts.backend()
    print(f"cpu: {cpu_model()}, {threads} threads, L3 {l3 >> 20} MiB")
    print(f"backend {backend}; pool {n} experts, {n * expert_bytes / 1e9:.2f} GB bf16", flush=True)

    bandwidth = host_read_bandwidth()
    print(f"host read bandwidth (torch sum, 2 GiB, {threads} threads): {bandwidth / 1e9:.1f} GB/s")
    w13, w2 = make_pool(n, h, i)
    huge_kb = anon_huge_kb()
    print(f"huge pages asked: {args.huge_pages}; AnonHugePages now {huge_kb} kB")
    runs = [
        time_kernel(backend, t, w13, w2, threads, args.calls, 20, gap * 1e-6)
        for gap in args.gap_us
        for t in (1, 4)
    ]
    if backend != "torch" and not args.no_torch:
        runs.append(time_kernel("torch", 1, w13, w2, threads, max(5, args.calls // 6), 3))
    bandwidth = max(bandwidth, host_read_bandwidth())  # again: the box may have been busy at first

    print(f"{'impl':7} {'T':>2} {'gap us':>7} {'MB/call':>8} {'ms/call':>8} {'GB/s med':>9} "
          f"{'best':>6} {'of read':>8}")  # fmt: skip
    for r in runs:
        r["of_read_bandwidth"] = r["gbs_median"] * 1e9 / bandwidth
        print(
            f"{r['impl']:7} {r['tokens']:>2} {r['gap_us']:>7.0f} {r['mb_per_call']:>8.1f} "
            f"{r['ms_per_call']:>8.2f} {r['gbs_median']:>9.1f} {r['gbs_best']:>6.1f} "
            f"{r['of_read_bandwidth']:>8.0%}"
        )
    ratio = runs[0]["of_read_bandwidth"]
    verdict = "meets" if ratio >= TARGET else "MISSES"
    print(f"T = 1: {ratio:.0%} of the host read bandwidth; {verdict} the {TARGET:.0%} target")
    if args.out is not None:
        report = dict(
            cpu=cpu_model(),
            threads=threads,
            l3_bytes=l3,
            torch=torch.__version__,
            backend=backend,
            shape=SHAPE,
            pool_bytes=n * expert_bytes,
            huge_pages_asked=args.huge_pages,
            anon_huge_kb=huge_kb,
            read_bandwidth_gbs=bandwidth / 1e9,
            target=TARGET,
            ratio_t1=ratio,
            runs=runs,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
