"""CPU SwiGLU experts for a few tokens, straight from the expert pool.

    out[t] = sum_k w[t, k] * (w2[r] @ (silu(w13[r][:I] @ x_t) * (w13[r][I:] @ x_t))),
    r = rows[t, k]

computed in fp32 from upcast weights, like `reference_moe.py`'s `fused_moe`, but returning the
fp32 partial sum (the offloaded bank adds it to the device branch's). Decode is bound by the
bytes of weights read, so the kernel reads each expert row once for all tokens that picked it,
converts bf16/fp16 to fp32 in registers and spreads the rows over the physical cores (`team_size`).

Build route: `expert_kernel.cpp` is a plain C ABI with no torch headers, compiled here with the
system C++ compiler into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions) and loaded with ctypes. Against a pybind11 `cpp_extension.load`:
  - it compiles in about 2 s; torch/extension.h alone takes 30 s here, which CI would pay;
  - it needs no ninja (cpp_extension.load does; the GPU image need not carry it), only a compiler;
  - ctypes drops the GIL around every foreign call, so a Python thread running the CPU branch
    never blocks the thread driving the GPU;
  - the library links no libtorch, so one cached build serves torch 2.11 and 2.13 alike.
The ISA is a build flag (-mavx512f -mavx512bw -mavx512vl, or -mavx2; both -mfma -mf16c): the
kernel is written once over a small vector layer, chosen at load from /proc/cpuinfo, and the
cache key holds the ISA, the flags, the compiler's version and the source's hash, so no binary is
ever run on a CPU it was not built for. No compiler, or a failed build, leaves the plain-torch
path with one warning. `FREETOKEN_CPU_EXPERTS=avx512|avx2|torch` overrides the choice.

Shapes (legend of `kernels/reference_moe.py`): T tokens, H hidden, I expert width, K top-k, N pool
rows. hidden [T, H]; w13 [N, 2I, H]; w2 [N, H, I]; rows [T, K] int64; topk_weights [T, K] fp32.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch
from torch import Tensor

from freetoken_agent.kernels.reference import check_moe_shapes, swiglu_columns

log = logging.getLogger("freetoken.kernels")

# The kernel, the thread that serves a decode graph's CPU branch with it (worker.py) and that
# thread's copier of the copies behind.
SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in ("expert_kernel.cpp", "expert_worker.cpp", "behind_copier.cpp")
)
ENV_BACKEND = "FREETOKEN_CPU_EXPERTS"
ENV_THREADS = "FREETOKEN_CPU_THREADS"  # the kernel's threads (default: team_size())
CFLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-pthread")
ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
ISA_CPU_FLAGS = {  # /proc/cpuinfo flags each build's instructions need
    "avx512": {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}
ISA_ID = {"avx512": 512, "avx2": 256}  # what the library's ft_isa() reports
BACKENDS = ("avx512", "avx2", "torch")  # preference order
DTYPE_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_chosen: str | None = None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty elsewhere, which means torch."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def physical_cores() -> int:
    """Physical cores this process may run on: SMT siblings share the core's load ports and add
    nothing to a bandwidth-bound loop."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(isa: str, cxx: str | None = None) -> Path:
    """Compile the kernel for `isa` into torch's extension cache (once per source, flags and
    compiler) and return the library's path. Raises when there is no compiler or it fails."""
    cxx = cxx or _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    # Imported here: only a build needs it, and it pulls in more of torch than the kernel does.
    from torch.utils.cpp_extension import get_default_build_root

    flags = (*CFLAGS, *ISA_FLAGS[isa])
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES))
    key.update(repr((cxx, version.stdout, flags)).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch does
    folder = Path(root) / "freetoken_cpu_experts"
    lib = folder / f"expert_kernel_{isa}_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{lib.name}.{os.getpid()}.{threading.get_ident()}"
    done = subprocess.run(
        [cxx, *flags, *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True
    )
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cxx} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: concurrent builders (test workers) each land a whole file
    return lib


def _load(isa: str) -> ctypes.CDLL | None:
    if not ISA_CPU_FLAGS[isa] <= cpu_flags():
        return None
    try:
        lib = ctypes.CDLL(str(build(isa)))  # CDLL (not PyDLL): calls run without the GIL
        lib.ft_isa.restype = ctypes.c_int
        fn = lib.ft_cpu_experts
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3
        fn.argtypes += [ctypes.c_int64] * 7 + [ctypes.c_int]  # T K N H I c0 c1, threads
        if lib.ft_isa() != ISA_ID[isa]:
            raise RuntimeError(f"library reports ISA {lib.ft_isa()}, expected {ISA_ID[isa]}")
        return lib
    except Exception as e:  # noqa: BLE001 - any build or load failure falls back to torch
        log.warning("CPU expert kernel (%s) unavailable, using plain torch: %s", isa, e)
        return None


def library(isa: str) -> ctypes.CDLL | None:
    """The loaded kernel for `isa`, built on first use; None where this CPU or build can't."""
    with _lock:
        if isa not in _libs:
            _libs[isa] = _load(isa)
        return _libs[isa]


def backend() -> str:
    """ "avx512" | "avx2" | "torch": the implementation chosen at load (the first call builds)."""
    global _chosen
    if _chosen is None:
        forced = os.environ.get(ENV_BACKEND)
        if forced is not None and forced not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={forced!r}; choose one of {', '.join(BACKENDS)}")
        order = [forced] if forced else list(BACKENDS)
        _chosen = next(b for b in order + ["torch"] if b == "torch" or library(b) is not None)
    return _chosen


def cpu_experts(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    rows: Tensor,
    topk_weights: Tensor,
    out: Tensor | None = None,
    threads: int | None = None,
    *,
    impl: str | None = None,
    columns: tuple[int, int] | None = None,
) -> Tensor:
    """out [T, H] fp32 = sum_k topk_weights[t, k] * expert(rows[t, k], hidden[t]), k in order.

    rows [T, K] int64 pool rows, negative = skip the pair. threads: OpenMP threads of the SIMD
    kernel (default: `default_threads`; the torch path uses torch's own pool). impl forces
    "avx512" | "avx2" | "torch" (tests, benchmarks); default `backend()`. Runs without the GIL.
    columns (c0, c1): only that slice of each expert's width I (gate and up rows [c0, c1), w2's
    columns [c0, c1)); SwiGLU is elementwise over I, so complementary slices sum to the whole
    expert (the split expert's CPU half). Default: the whole width.
    """
    t, h, i, k = check_moe_shapes(hidden, w13, w2, rows, topk_weights, None)
    c0, c1 = columns if columns is not None else (0, i)
    if not 0 <= c0 < c1 <= i:
        raise ValueError(f"columns {columns}: a non-empty slice of the expert width [0, {i})")
    for name, x in (("hidden", hidden), ("w13", w13), ("w2", w2), ("rows", rows)):
        assert x.device.type == "cpu", f"{name} must be a CPU tensor, got {x.device}"
    assert hidden.dtype in DTYPE_ID, f"unsupported dtype {hidden.dtype}"
    # The kernel indexes the pool by raw offsets: a strided view would be read wrongly.
    assert w13.is_contiguous() and w2.is_contiguous(), "w13 and w2 must be contiguous"
    if out is None:
        out = torch.empty(t, h, dtype=torch.float32)
    assert out.shape == (t, h) and out.dtype == torch.float32 and out.is_contiguous(), (
        f"out must be a contiguous [T={t}, H={h}] fp32 tensor, got {tuple(out.shape)} {out.dtype}"
    )
    impl = impl or backend()
    if impl == "torch":
        return _experts_torch(hidden, w13, w2, rows.long(), topk_weights, out, (c0, c1))
    lib = library(impl)
    if lib is None:
        raise RuntimeError(f"the {impl} CPU expert kernel is not available on this machine")
    hidden, rows = hidden.contiguous(), rows.contiguous().long()
    topk_weights = topk_weights.contiguous()
    rc = lib.ft_cpu_experts(
        hidden.data_ptr(),
        w13.data_ptr(),
        w2.data_ptr(),
        DTYPE_ID[hidden.dtype],
        rows.data_ptr(),
        topk_weights.data_ptr(),
        out.data_ptr(),
        t,
        k,
        w13.shape[0],
        h,
        i,
        c0,
        c1,
        threads or default_threads(),
    )
    if rc == -1:
        raise IndexError(f"rows out of range for a pool of {w13.shape[0]} rows: {rows.tolist()}")
    assert rc == 0, f"ft_cpu_experts returned {rc}"
    return out


_threads: int | None = None


def default_threads() -> int:
    """`FREETOKEN_CPU_THREADS` (as llama.cpp's -t), else `team_size()`."""
    global _threads
    if _threads is None:
        _threads = _threads_from_env() or team_size()
    return _threads


def team_size() -> int:
    """The physical cores, less one where no SMT sibling is left for the thread that drives
    the engine: it launches the graphs and waits on them between calls, and a team filling
    every core shares one with it, so each call's barrier waits on the core they share. On the
    H200 host (16 cores, no SMT), offloaded decode of the peer slice: policy cpu 73.5 tok/s
    with 16 threads, 86.2 with 15, 80.7 with 12; static 109.8, 133.6, 133.3."""
    physical = physical_cores()
    if len(os.sched_getaffinity(0)) > physical:  # SMT: the driver runs on a sibling
        return physical
    return max(1, physical - 1)


def spin_team_size() -> int:
    """The CPU worker's spinning team: `FREETOKEN_CPU_THREADS` if set, else the physical cores
    less a quarter of them (at least two). Its threads spin between jobs while the engine's
    driver thread spins on the GPU and CUDA's and Python's own threads wake now and then; a
    team that leaves them no core loses a barrier to a scheduler time slice. On the H200 host
    (16 cores, twenty-first session), the peer slice's uniform b=1 row held on the shared path:
    15 threads 123.0 tok/s (longest job 31.7 ms), 14: 135.8 (24.3 ms), 12: 146.2 (1.9 ms)."""
    physical = physical_cores()
    return _threads_from_env() or max(1, physical - max(2, physical // 4))


def _threads_from_env() -> int | None:
    value = os.environ.get(ENV_THREADS)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV_THREADS}={value!r}: a positive number of threads")
    return int(value)


def _experts_torch(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    rows: Tensor,
    topk_weights: Tensor,
    out: Tensor,
    columns: tuple[int, int] | None = None,
) -> Tensor:
    """Plain-torch twin (no compiler, or forced): the reference's arithmetic, fp32 output. Each
    picked row is upcast once per call; torch's bf16 GEMV is slow, so this is a fallback only."""
    t, h = hidden.shape
    k, i = rows.shape[1], w2.shape[2]
    c0, c1 = columns if columns is not None else (0, i)
    flat = rows.reshape(-1)  # [P]
    if bool((flat >= w13.shape[0]).any()):
        raise IndexError(f"rows out of range for a pool of {w13.shape[0]} rows: {rows.tolist()}")
    y = torch.zeros(t * k, h, dtype=torch.float32)  # [P, H] per-pair outputs
    for row in torch.unique(flat[flat >= 0]).tolist():
        pairs = (flat == row).nonzero().squeeze(1)  # [m] pairs that picked this row
        x = hidden[pairs // k].float()  # [m, H]
        y[pairs] = swiglu_columns(x, w13[row], w2[row], c0, c1)  # [m, H]
    y = y.view(t, k, h)
    weights = topk_weights.masked_fill(rows < 0, 0.0)  # [T, K]
    out.zero_()
    for j in range(k):  # fixed order over k
        out += weights[:, j, None] * y[:, j]
    return out
