"""Programmatic dependent launch (PDL, sm_90 and later) for the decode step's Triton kernels.

Why: a 48-layer decode step at b=1 is ~11 small kernels a layer, ~530 launches in one CUDA graph
(twenty-second session's step table: 4.13 ms wall, 3.80 ms of kernels). Between two dependent
kernels the GPU drains the first grid, then launches and ramps the second. A kernel launched with
`launch_pdl=True` may instead start its programs as soon as every program of the kernel before
it in the stream has issued `griddepcontrol.launch_dependents`; each of its programs then waits
(`griddepcontrol.wait`) until that kernel has completed and its writes are visible. The next
kernel's programs are resident and waiting when the last one ends.

The rule every PDL-aware kernel keeps (`enter`): the wait is its first statement, in every
program, before any load, store or early return. A kernel's completion then implies its
predecessor's, transitively, so a kernel may read the output of any earlier kernel, not only
the one just before it; a kernel that is not PDL-aware (cuBLAS, torch) launches as usual and
waits for its predecessor to complete. The release comes right after the wait: dependents
launch only once every program of this grid has started, so they never take SMs from it.

Process-wide switch: `FREETOKEN_PDL=1` (off by default until measured on the device);
`override` for benches and tests. A captured CUDA graph keeps the launches it was captured with.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

_override: bool | None = None


def requested() -> bool:
    """The switch: `override`'s value inside it, else FREETOKEN_PDL=1."""
    if _override is not None:
        return _override
    return os.environ.get("FREETOKEN_PDL", "0") == "1"


@contextmanager
def override(on: bool) -> Iterator[None]:
    """Launch PDL-aware kernels with (or without) PDL inside the block, whatever the env says."""
    global _override
    before, _override = _override, on
    try:
        yield
    finally:
        _override = before


def supported(device: torch.device) -> bool:
    """sm_90+ CUDA, and a Triton with the griddepcontrol builtins (launches are per call)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _sm90_with_gdc(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _sm90_with_gdc(index: int) -> bool:
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")


def launch(device: torch.device) -> dict:
    """Keyword arguments for a PDL-aware kernel's launch: its `PDL` constexpr, and `launch_pdl`
    when PDL is on for `device`. Spread into the launch: `kernel[grid](..., **pdl.launch(dev))`."""
    if requested() and supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a PDL-aware kernel: wait for the kernel before it in the stream to
    complete, then let the next one's programs launch (module docstring: why here, both)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
