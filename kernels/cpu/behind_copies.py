"""The split expert's copies behind: where the CPU worker's copier (behind_copier.cpp, a second
thread of expert_worker.cpp's worker) copies the CPU's columns of each split expert into its
cache slot after the job is answered, so the slot becomes whole without SM time in the step.

A split miss copies columns [0, c) of its expert into the slot and posts [c, I) to the CPU; the
post names the slot (Mailbox.fill_slots). After the answer, the copier copies those columns from
the pool into the slot and then marks landed[slot] = lid: on CPU slots with memcpy, on CUDA
slots with the copy engines on a side stream, through libcuda's driver API (the thread has no
Python and no torch; the library links no CUDA, so Python hands it the entry points). The
worker thread itself calls no CUDA: a driver call may wait on a lock another thread holds
while the device spins on the worker's next answer.

S slots, N pool rows, I expert width, H hidden. Slot banks w13 [S, 2I, H] and w2 [S, H, I] (each
slot contiguous; slots may sit further apart), landed [S] int64 on the slots' device,
landed_src [S] int64 pinned host (CUDA: the marks' staging, an async copy's source).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class Driver:
    """libcuda's entry points the copier thread calls (addresses) and the context it makes
    current before its first copy (the primary context of the slots' device)."""

    ctx: int
    set_current: int  # cuCtxSetCurrent
    htod_async: int  # cuMemcpyHtoDAsync_v2
    copy2d_async: int  # cuMemcpy2DAsync_v2

    @classmethod
    def of(cls, device: torch.device) -> Driver:
        cuda = ctypes.CDLL("libcuda.so.1")  # the one torch loaded: a GPU's driver ships it
        torch.cuda.init()
        ctx = ctypes.c_void_p()
        with torch.cuda.device(device):
            # torch's runtime makes the device's primary context current on this thread once it
            # works on it; a stream's synchronize does (its context is the one the copies need).
            torch.cuda.current_stream(device).synchronize()
            rc = cuda.cuCtxGetCurrent(ctypes.byref(ctx))
        if rc != 0 or not ctx.value:
            raise RuntimeError(f"cuCtxGetCurrent on {device}: CUresult {rc}, context {ctx.value}")

        def address(name: str) -> int:
            return ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value

        return cls(ctx.value, address("cuCtxSetCurrent"), address("cuMemcpyHtoDAsync_v2"),
                   address("cuMemcpy2DAsync_v2"))  # fmt: skip


@dataclass(slots=True)
class BehindCopies:
    """Where the worker's copies behind go (CpuWorker.set_behind). `stream`, `landed_src` and
    `driver` are for CUDA slots only (`to_slots` makes them)."""

    w13: Tensor  # [S, 2I, H]
    w2: Tensor  # [S, H, I]
    landed: Tensor  # [S] int64
    landed_src: Tensor | None = None  # [S] int64 pinned host
    stream: torch.cuda.Stream | None = None  # the side stream the copies queue on
    driver: Driver | None = None

    @classmethod
    def to_slots(cls, w13: Tensor, w2: Tensor, landed: Tensor,
                 stream: torch.cuda.Stream | None = None) -> BehindCopies:  # fmt: skip
        """Copies behind into these slot banks; on CUDA with a side stream of their device (or
        `stream`), a pinned staging of the marks and the driver's entry points."""
        if w13.device.type != "cuda":
            return cls(w13, w2, landed)
        staged = torch.full((w13.shape[0],), -1, dtype=torch.int64, pin_memory=True)  # [S]
        stream = stream or torch.cuda.Stream(w13.device)
        return cls(w13, w2, landed, staged, stream, Driver.of(w13.device))

    @property
    def on_cuda(self) -> bool:
        return self.w13.device.type == "cuda"

    def check(self, pool_w13: Tensor, pool_w2: Tensor) -> None:
        """ValueError naming what does not fit the worker's pool w13 [N, 2I, H], w2 [N, H, I]."""
        w13, w2, landed = self.w13, self.w2, self.landed
        s = w13.shape[0] if w13.dim() == 3 else -1
        for name, bank, pool in (("w13", w13, pool_w13), ("w2", w2, pool_w2)):
            if bank.dim() != 3 or bank.shape[1:] != pool.shape[1:] or bank.shape[0] != s:
                raise ValueError(f"slot bank {name} {tuple(bank.shape)}: want [S, "
                                 f"{', '.join(map(str, pool.shape[1:]))}] as the pool's "
                                 f"{tuple(pool.shape)}, S as w13's")  # fmt: skip
            if bank.dtype != pool.dtype:
                raise ValueError(f"slot bank {name} is {bank.dtype}, the pool {pool.dtype}")
            if bank.stride()[1:] != (bank.shape[2], 1) or bank.stride(0) < 0:
                raise ValueError(f"slot bank {name}: each slot must be contiguous, strides "
                                 f"{bank.stride()}")  # fmt: skip
        if w13.device.type not in ("cpu", "cuda") or w2.device != w13.device:
            raise ValueError(f"slot banks on {w13.device} and {w2.device}: one CPU or CUDA device")
        if landed.dtype != torch.int64 or landed.shape != (s,) or not landed.is_contiguous():
            raise ValueError(f"landed must be a contiguous [S={s}] int64 tensor, got "
                             f"{tuple(landed.shape)} {landed.dtype}")  # fmt: skip
        if landed.device != w13.device:
            raise ValueError(f"landed is on {landed.device}, the slots on {w13.device}")
        if not self.on_cuda:
            return
        src = self.landed_src
        if src is None or src.dtype != torch.int64 or src.shape != (s,) or not src.is_contiguous():
            got = None if src is None else f"{tuple(src.shape)} {src.dtype}"
            raise ValueError(f"CUDA slots need landed_src, a contiguous [S={s}] int64 host "
                             f"tensor; got {got}")  # fmt: skip
        if src.device.type != "cpu" or not src.is_pinned():
            raise ValueError("landed_src must be pinned host memory (an async copy's source)")
        if self.stream is None or self.stream.device != w13.device or self.driver is None:
            raise ValueError(f"CUDA slots need a stream of {w13.device} and the driver")

    def synchronize(self) -> None:
        """Every copy and mark queued so far has landed (CUDA; CPU copies are done when issued)."""
        if self.stream is not None:
            self.stream.synchronize()
