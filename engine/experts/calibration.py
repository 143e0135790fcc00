"""Measured bandwidths for the q* split: B_P (pinned host-to-device, expert-sized copies), B_H
(the CPU executor's weight throughput at one token) and the CPU's knee (tokens per expert past
which it computes more than it reads), cached per machine and expert shape; with them the grid
of the device path's copy kernel that read the link fastest here (`measure_copy_programs`).

`freetoken calibrate` measures both and writes them to `$FREETOKEN_CACHE/calibration.json`
(default `~/.cache/freetoken`), keyed by the cache's format, GPU, CPU model, expert shape and
dtype; `Engine.load` reads the entry for its model, and the offloaded bank keeps re-estimating
both online from the copies and CPU runs it times (an exponential moving average), so a stale
calibration corrects itself. An entry that is not a valid calibration (a field missing or
unknown, a bandwidth that is not a positive number, another expert size) is ignored with a
warning: the engine starts from the defaults, and the next `freetoken calibrate` replaces it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from freetoken_agent.engine.experts.policy import CPU_KNEE_TOKENS, Bandwidths
from freetoken_agent.kernels.cpu.experts import cpu_experts as kernel_cpu_experts
from freetoken_agent.kernels.expert_fills import (
    COPY_PROGRAM_CHOICES,
    COPY_PROGRAMS,
    COPY_PROGRAMS_MAX,
    copy_fills,
)

log = logging.getLogger("freetoken.experts")

EMA = 0.2  # weight of a new observation in the online estimates
# The cache's format, in every key: bump it when what is measured, or how, changes, so that
# entries another version wrote are measured again rather than trusted.
FORMAT = 2
CPUINFO = Path("/proc/cpuinfo")


def cache_file() -> Path:
    root = Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken"))
    return root / "calibration.json"


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's on Linux, where platform.processor() is only the
    architecture ("x86_64" for every x86 machine); elsewhere platform.processor() or machine()."""
    try:
        for line in CPUINFO.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass  # not Linux
    return platform.processor() or platform.machine()


def machine_key(hidden: int, inter: int, dtype: torch.dtype) -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"v{FORMAT}|{gpu}|{cpu_model()}|{hidden}x{inter}|{dtype}"


@dataclass(slots=True)
class Calibration:
    pcie: float  # B_P bytes/s
    cpu: float  # B_H bytes/s
    expert_bytes: int
    measured_at: float
    knee: float = CPU_KNEE_TOKENS  # tokens per expert where the CPU turns compute-bound
    copy_programs: int = COPY_PROGRAMS  # the copy kernel's fastest grid (measure_copy_programs)

    def bandwidths(self) -> Bandwidths:
        return Bandwidths(pcie=self.pcie, cpu=self.cpu, knee=self.knee)


def _pinned(host: torch.Tensor, otherwise: str) -> torch.Tensor:
    """`host` page-locked; where the OS or the driver refuses (a memlock limit, a container),
    `host` as it is, with one warning saying what the calibration does instead: it crashed
    `freetoken calibrate` with a CUDA error, where the engine's pool falls back with a
    warning."""
    try:
        return host.pin_memory()
    except RuntimeError as e:
        log.warning("host memory could not be pinned (%s): %s", str(e).splitlines()[0], otherwise)
        return host


def measure_pcie(expert_bytes: int, n: int = 64, repeats: int = 3) -> float:
    """Pinned host-to-device bandwidth in copies of one expert each."""
    if not torch.cuda.is_available():
        return Bandwidths().pcie
    elems = expert_bytes // 2
    host = _pinned(torch.empty((n, elems), dtype=torch.bfloat16), "B_P is timed from pageable "
                   "memory, as the engine's fills would then copy")  # fmt: skip
    host.normal_()
    dev = torch.empty((n, elems), dtype=torch.bfloat16, device="cuda")
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            dev[i].copy_(host[i], non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, n * host[0].nbytes / (start.elapsed_time(end) / 1e3))
    return best


COPY_PROBE_FILLS = 8  # experts a timed copy moves: a decode layer's misses at top-8
COPY_PROBE_BYTES = 512 << 20  # the pinned pool the copies read, rows reused in turn


def measure_copy_programs(
    hidden: int, inter: int, dtype: torch.dtype, rounds: int = 5
) -> tuple[int, float]:
    """(programs, bytes/s): the grid of the device path's copy kernel that moved experts of
    this shape fastest (`copy_grid_rates`, `fastest_grid`), and its rate. Without CUDA:
    (COPY_PROGRAMS, 0.0), nothing measured."""
    rates = copy_grid_rates(hidden, inter, dtype, rounds)
    if not rates:
        return COPY_PROGRAMS, 0.0
    programs = fastest_grid(rates)
    return programs, rates[programs]


def fastest_grid(rates: dict[int, float]) -> int:
    """The fewest programs within 3% of the fastest rate: the copies share the SMs with the
    layer's other kernels, so a grid that buys nothing measurable is not taken."""
    best = max(rates.values())
    return min(p for p, rate in rates.items() if rate >= 0.97 * best)


def copy_grid_rates(
    hidden: int, inter: int, dtype: torch.dtype, rounds: int = 5
) -> dict[int, float]:
    """{programs: bytes/s} of the device path's copy kernel (copy_fills) moving
    COPY_PROBE_FILLS experts of this shape from pinned host memory to device slots, for each
    grid of COPY_PROGRAM_CHOICES: the median of `rounds` timed copies after one that compiles,
    over a pinned pool of COPY_PROBE_BYTES or more (beyond the CPU's caches). {} without
    CUDA."""
    if not torch.cuda.is_available():
        return {}
    from freetoken_agent.kernels import reference_fills as ref

    n = COPY_PROBE_FILLS
    n_rows = max(4 * n, COPY_PROBE_BYTES // (3 * hidden * inter * dtype.itemsize))
    why = "the copy grid is not timed (the device paths that use it need pinned memory)"
    src13 = _pinned(torch.empty(n_rows, 2 * inter, hidden, dtype=dtype), why)
    if not src13.is_pinned():
        return {}
    src2 = _pinned(torch.empty(n_rows, hidden, inter, dtype=dtype), why)
    if not src2.is_pinned():
        return {}
    dst13 = torch.empty(n, 2 * inter, hidden, dtype=dtype, device="cuda")
    dst2 = torch.empty(n, hidden, inter, dtype=dtype, device="cuda")
    state = torch.zeros(ref.STATE, dtype=torch.int64, device="cuda")
    state[ref.MOVES] = n
    moved = n * 3 * hidden * inter * dtype.itemsize
    rates: dict[int, float] = {}
    row = 0
    for programs in COPY_PROGRAM_CHOICES:
        times = []
        for r in range(rounds + 1):  # the first compiles this grid's kernel
            lids = torch.arange(row, row + n, dtype=torch.int64) % n_rows
            moves = torch.stack([lids, torch.arange(n)], dim=1).to("cuda")
            row += n
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy_fills(state, moves, src13, src2, dst13, dst2, programs=programs)
            end.record()
            end.synchronize()
            if r:
                times.append(start.elapsed_time(end) / 1e3)
        rates[programs] = moved / sorted(times)[len(times) // 2]
    return rates


def probe_pool(hidden: int, inter: int, dtype: torch.dtype, pool_bytes: int = 1 << 30):
    """(w13 [N, 2I, H], w2 [N, H, I]): random experts filling `pool_bytes`, beyond the
    caches, for the CPU measurements below (drawn once, read by both)."""
    n = max(32, pool_bytes // (3 * hidden * inter * dtype.itemsize))
    w13 = torch.randn(n, 2 * inter, hidden).mul_(0.05).to(dtype)
    return w13, torch.randn(n, hidden, inter).mul_(0.05).to(dtype)


def measure_cpu(hidden: int, inter: int, dtype: torch.dtype, pool=None) -> float:
    """Weight bytes per second the CPU executor streams for one token and eight experts, over
    a pool larger than the caches (`probe_pool`, drawn here unless given)."""
    expert = 3 * hidden * inter * dtype.itemsize
    w13, w2 = pool or probe_pool(hidden, inter, dtype)
    n = w13.shape[0]
    x = torch.randn(1, hidden).to(dtype)
    weights = torch.full((1, 8), 0.125)
    times = []
    for r in range(15):
        rows = torch.randperm(n)[:8].view(1, 8)
        start = time.perf_counter()
        cpu_experts(x, w13, w2, rows, weights)
        if r >= 3:  # the first runs warm up (the kernel's build and thread team, page maps)
            times.append(time.perf_counter() - start)
    return 8 * expert / sorted(times)[len(times) // 2]


KNEE_PROBE_TOKENS = 64  # tokens on one expert: far past any CPU's knee (8 on the H200 host)


def measure_knee(hidden: int, inter: int, dtype: torch.dtype, pool=None) -> float:
    """Tokens per expert where the CPU kernel turns from reading weights to arithmetic: one
    expert at KNEE_PROBE_TOKENS tokens takes that many tokens / knee times one token's read
    (policy.cpu_cost). Each call reads rows no call read before (from a pool beyond the
    caches: `probe_pool`), so one token's time is the weights' read, as in decode."""
    w13, w2 = pool or probe_pool(hidden, inter, dtype)
    order = torch.randperm(w13.shape[0]).tolist()

    def median_seconds(tokens: int, calls: int) -> float:
        x = torch.randn(tokens, hidden).to(dtype)
        rows = torch.full((tokens, 1), -1, dtype=torch.long)
        weights = torch.ones(tokens, 1)
        times = []
        for r in range(calls + 2):  # two warm-up calls
            rows[:] = order.pop()  # every token on one expert, new to the caches
            start = time.perf_counter()
            cpu_experts(x, w13, w2, rows, weights)
            if r >= 2:
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    one = median_seconds(1, 9)
    many = median_seconds(KNEE_PROBE_TOKENS, 9)
    return float(min(KNEE_PROBE_TOKENS, max(1.0, KNEE_PROBE_TOKENS * one / many)))


def cpu_experts(
    hidden, w13, w2, rows, weights, threads: int | None = None, into: torch.Tensor | None = None
) -> torch.Tensor:
    """The CPU executor: the SIMD kernel of kernels/cpu (AVX-512 or AVX2, built on first use;
    it falls back to plain torch by itself where no compiler exists). [T, H] fp32: a new
    tensor, or `into` (a decode graph's pinned fp32 staging rows, written by the kernel).

    The sum stays fp32: the MoE sum it joins adds it before its one rounding to the model
    dtype (`fused_moe`'s `add`), as it adds the worker's fp32 answer. Rounded here first, a
    bf16 layer was rounded twice wherever a layer's experts split between the two sides:
    transfer with one slot gave bf16 logits 5-18% (of the largest) from resident's on the
    tiny CPU models, where every other placement matched them bit for bit."""
    return kernel_cpu_experts(hidden, w13, w2, rows, weights.to(torch.float32), into,
                              threads=threads)  # fmt: skip


def calibrate(hidden: int, inter: int, dtype: torch.dtype) -> Calibration:
    expert = 3 * hidden * inter * dtype.itemsize
    pool = probe_pool(hidden, inter, dtype)
    cal = Calibration(
        measure_pcie(expert), measure_cpu(hidden, inter, dtype, pool), expert, time.time(),
        measure_knee(hidden, inter, dtype, pool),
        measure_copy_programs(hidden, inter, dtype)[0],
    )  # fmt: skip
    path = cache_file()
    table = _read_table(path)
    if not isinstance(table, dict):  # unreadable: measured again from here
        table = {}
    table[machine_key(hidden, inter, dtype)] = asdict(cal)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return cal


def _read_table(path: Path) -> object:
    """The cache file's JSON ({} when there is none), or the error that kept it from parsing."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return e


def _json_kind(value: object) -> str:
    kinds = {list: "a list", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), "null" if value is None else type(value).__name__)


def parse(entry: object, expert_bytes: int) -> Calibration:
    """A cache entry as a Calibration, or a ValueError that says what is wrong with it. Every
    field must be known (an entry another version wrote may mean something else by them),
    bandwidths and the knee positive and finite (the policy divides by them), the expert size
    the model's (bandwidths are measured in copies of one expert)."""
    if not isinstance(entry, dict):
        raise ValueError(f"the entry is {_json_kind(entry)}, not an object")
    unknown = sorted(set(entry) - {f.name for f in fields(Calibration)})
    missing = sorted({"pcie", "cpu", "expert_bytes", "measured_at"} - set(entry))
    if unknown or missing:
        said = [
            f"{what} field(s) {', '.join(names)}"
            for what, names in (("unknown", unknown), ("missing", missing))
            if names
        ]
        raise ValueError(f"the entry has {' and '.join(said)}")
    for name in ("pcie", "cpu", "knee", "measured_at"):
        value = entry.get(name, 1.0)  # the knee may be absent: cached before it was measured
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} is {value!r}, not a positive number")
    programs = entry.get("copy_programs", COPY_PROGRAMS)  # absent: cached before it was timed
    if (
        isinstance(programs, bool)
        or not isinstance(programs, int)
        or not (1 <= programs <= COPY_PROGRAMS_MAX)
    ):
        raise ValueError(f"copy_programs is {programs!r}, not a grid of 1 to "
                         f"{COPY_PROGRAMS_MAX} programs")  # fmt: skip
    if entry["expert_bytes"] != expert_bytes:
        raise ValueError(f"measured on {entry['expert_bytes']!r}-byte experts, not "
                         f"{expert_bytes}")  # fmt: skip
    return Calibration(**entry)


def cached(hidden: int, inter: int, dtype: torch.dtype) -> Calibration | None:
    """This machine's calibration for the expert shape, or None: not measured, or an entry
    that is not a valid calibration (`parse`), ignored with one warning (the engine starts
    from the defaults and corrects them online; `freetoken calibrate` measures again)."""
    path, key = cache_file(), machine_key(hidden, inter, dtype)
    table = _read_table(path)
    try:
        if isinstance(table, Exception):
            raise ValueError(f"the file does not parse ({table})")
        if not isinstance(table, dict):
            raise ValueError(f"the file holds {_json_kind(table)}, not an object")
        if key not in table:
            return None
        return parse(table[key], 3 * hidden * inter * dtype.itemsize)
    except ValueError as e:
        log.warning("ignoring the bandwidth calibration for %s in %s: %s; run `freetoken "
                    "calibrate` to measure again", key, path, e)  # fmt: skip
        return None


def update(estimate: float, bytes_moved: int, seconds: float) -> float:
    """One online observation folded into an estimate (ignored unless it `counts`)."""
    if not counts(bytes_moved, seconds):
        return estimate
    return (1 - EMA) * estimate + EMA * (bytes_moved / seconds)


def counts(bytes_moved: float, seconds: float) -> bool:
    """Whether an observation is long enough to time and moved anything."""
    return seconds > 1e-6 and bytes_moved > 0


def observe_cpu(bandwidths: Bandwidths, source: str, nbytes: float, seconds: float) -> None:
    """One CPU observation into B_H (`update`), and into `bandwidths.cpu_seen` as (source,
    bytes, seconds) when it `counts`."""
    bandwidths.cpu = update(bandwidths.cpu, nbytes, seconds)
    if counts(nbytes, seconds):
        bandwidths.cpu_seen.append((source, nbytes, seconds))
