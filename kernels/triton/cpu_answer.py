"""The CPU worker's answer, waited for inside the MoE sum over k (late collection).

A decode layer whose plan posted part of its misses to the CPU worker (kernels/cpu/worker.py,
the plan in expert_fills.py) adds the worker's answer before its one rounding. The wait sits in
the last kernel that needs it, the sum over k (moe_common.py), so the fill copies and the MoE
kernels of the slots' experts run while the worker computes; the copy kernel used to hold it,
and the MoE kernels then started only once the worker had answered.

The wait: spin on ANSWER == state[SEQ] with an acquire load (host_sync.py), give up at the
timeout (marking the mailbox: ctrl[TIMEOUT] = seq, so later waits do not wait again) or at once
when it is marked; a wait that gives up writes LOST and GAVE_UP_AT, and its layer adds nothing.
The interpreter counts spins for the timeout (`timeout_ticks`).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from freetoken_agent.kernels.cpu.worker import ANSWER, GAVE_UP_AT, LOST, TIMEOUT
from freetoken_agent.kernels.reference_fills import LAYER_CPU, SEQ
from freetoken_agent.kernels.triton.host_sync import load_acquire_sys, timer

_SEQ, _ANSWER, _LAYER_CPU = tl.constexpr(SEQ), tl.constexpr(ANSWER), tl.constexpr(LAYER_CPU)
_TIMEOUT, _LOST, _GAVE_UP_AT = tl.constexpr(TIMEOUT), tl.constexpr(LOST), tl.constexpr(GAVE_UP_AT)


def sys_ordering() -> bool:
    """PTX ordering on a GPU; the interpreter's plain loads and stores on the CPU tests."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def timeout_ticks(timeout_s: float) -> int:
    """A wait's bound in the timer's units: nanoseconds on a GPU, spins on the interpreter
    (each some hundreds of microseconds there: 10,000 a second)."""
    return int(timeout_s * (1e9 if sys_ordering() else 1e4))


@triton.jit
def posted(state):
    """Whether the last plan posted to the worker (its layer's answer is to be waited for)."""
    return tl.load(state + _LAYER_CPU) > 0


@triton.jit
def wait_answer(state, box_ctrl, timeout, SYS: tl.constexpr):
    """Spins until the worker answers the last post, or the mailbox is marked dead, or the
    timeout marks it; returns whether the answer came (then box.out holds it)."""
    seq = tl.load(state + _SEQ)
    dead = tl.load(box_ctrl + _TIMEOUT, volatile=True)
    answer = load_acquire_sys(box_ctrl + _ANSWER, SYS)
    start = timer(SYS, seq * 0)
    now = start
    while (answer != seq) & (dead == 0):
        answer = load_acquire_sys(box_ctrl + _ANSWER, SYS)
        now = timer(SYS, now)
        if now - start > timeout:  # the worker is gone: mark the mailbox, add nothing
            tl.store(box_ctrl + _TIMEOUT, seq)
            dead = seq
    if dead != 0:
        tl.store(box_ctrl + _LOST, seq)
        tl.store(box_ctrl + _GAVE_UP_AT, answer)
    return dead == 0
