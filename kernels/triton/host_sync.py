"""Ordered loads and stores between a kernel and a host thread, over pinned host memory.

A decode graph's CPU branch (kernels/cpu/worker.py) needs the device's writes of a job to be
visible to the host before the doorbell, and the host's answer to be read only after its flag:
a release store and an acquire load at system scope (PTX `st.release.sys`, `ld.acquire.sys`),
with a `fence.acq_rel.sys` by every thread before the barrier that precedes the doorbell, so
the whole CTA's writes are ordered before it. Plain loads and stores to pinned memory cross
PCIe without such ordering. Triton has no system-scope memory ops of its own; inline PTX does
it. Triton's interpreter (the CPU tests) runs programs one at a time on numpy and has no PTX:
`SYS=False` takes volatile loads and plain stores there, where the host thread sees them in
program order anyway (x86 stores are not reordered with each other).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def release_fence_sys(SYS: tl.constexpr):
    """Order this thread's earlier writes before its later ones, for every observer."""
    if SYS:
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip


@triton.jit
def store_release_sys(ptr, value, SYS: tl.constexpr):
    """*ptr = value (int64), after every earlier write of this thread."""
    if SYS:
        tl.inline_asm_elementwise(
            "st.release.sys.global.b64 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,l",
            [ptr, value.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.store(ptr, value)


@triton.jit
def load_acquire_sys(ptr, SYS: tl.constexpr):
    """*ptr (int64), before every later read of this thread."""
    if SYS:
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
            is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.load(ptr, volatile=True)


@triton.jit
def timer(SYS: tl.constexpr, ticks):
    """Nanoseconds of the GPU's global timer (SYS), or `ticks` + 1 (the interpreter, where the
    caller counts its spins instead)."""
    if SYS:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return ticks + 1
