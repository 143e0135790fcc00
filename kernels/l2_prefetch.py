"""L2 prefetch dispatcher: ask the GPU's L2 for weights a later kernel reads, while the kernels
before it leave HBM idle (EngineConfig.l2_prefetch, off: measured slower, below).

Why: at decode, b=1, a 48-layer step spends ~27 us a layer in kernels that read almost nothing
(norms, RoPE, attention over a short context, the router's top-k, the fill plan and an idle
copy), and ~44 us in kernels that stream ~113 MB of weights at 52-65% of HBM's copy bandwidth
(twenty-second session's step table). A prefetch kernel on a side stream, forked after the
kernel that last writes what it needs and joined before the reader, moves some of those bytes
into L2 during the idle kernels: o_proj's weight during RoPE and attention, the MoE layer's
rows during the fill copy. A prefetch is a hint (no data reaches registers; a line no one reads
ages out), so results never depend on it.

Measured (twenty-third session, 48 layers): slower at both batches, all resident b=1 296.1 ->
283.9 and b=4 664.2 -> 653.8 tok/s, gpu-fill 258.4 -> 246.0 and 511.9 -> 469.4: a fork and a
join a layer cost more than the idle window gives. Kept, tested, for other GPUs' trade-offs.

CUDA tensors only; anywhere else these do nothing (the CPU has no L2 to ask).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor


def _active(t: Tensor) -> bool:
    return t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def prefetch_tensor(t: Tensor) -> None:
    """All of `t` (contiguous) into L2."""
    if not _active(t) or t.numel() == 0:
        return
    from freetoken_agent.kernels.triton.l2_prefetch import prefetch

    assert t.is_contiguous(), "prefetch_tensor takes a contiguous tensor"
    nbytes = t.numel() * t.element_size()
    prefetch(t.view(-1).view(torch.uint8), None, nbytes, nbytes)


def prefetch_rows(bank: Tensor, rows: Tensor, fraction: float) -> None:
    """The first `fraction` of each row bank[rows[i]] (rows [P] int64; a negative row: not on
    the device, nothing) into L2. bank [S, ...] with dense rows (slots may be strided)."""
    if not _active(bank) or rows.numel() == 0:
        return
    from freetoken_agent.kernels.triton.l2_prefetch import prefetch

    assert 0.0 < fraction <= 1.0, fraction
    assert bank[0].is_contiguous(), "a bank row must be dense"
    row_bytes = bank[0].numel() * bank.element_size()
    base = torch.as_strided(bank, (1,), (1,)).view(torch.uint8)  # the bank's first byte
    prefetch(base, rows.reshape(-1), bank.stride(0) * bank.element_size(),
             int(row_bytes * fraction))  # fmt: skip
