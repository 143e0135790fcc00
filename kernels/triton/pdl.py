"""Programmatic dependent launch (PDL, sm_90 and later) for the decode step's Triton kernels.

Why: a 48-layer decode step at b=1 is ~11 small kernels a layer, ~530 launches in one CUDA graph
(twenty-second session's step table: 4.13 ms wall, 3.80 ms of kernels). Between two dependent
kernels the GPU drains the first grid, then launches and ramps the second. A kernel launched with
`launch_pdl=True` may instead start its programs as soon as every program of the kernel before
it in the stream has issued `griddepcontrol.launch_dependents`; each of its programs then waits
(`griddepcontrol.wait`) until that kernel has completed and its writes are visible. The next
kernel's programs are resident and waiting when the last one ends.

The rule every PDL-aware kernel keeps (`enter`): every program waits before it stores, returns
or loads anything another kernel may still be writing (in full at the end). A kernel's
completion then implies its predecessor's, transitively, so a kernel may read the output of any
earlier kernel, not only the one just before it; a kernel that is not PDL-aware (cuBLAS, torch)
launches as usual and waits for its predecessor to complete. The release comes right after the
wait: dependents launch only once every program of this grid has started, so they never take
SMs from it.

Variants (FREETOKEN_PDL, a comma list; `light` by default, the one that won at both batches):
- `on` (or `1`): wait, then release at once (above). The twenty-second session measured it at
  48 layers, all resident: b=4 660.4 -> 680.8 tok/s, b=1 296.1 -> 283.8.
- `exit`: wait, no explicit release; the next kernel launches as this one's programs exit:
  separates the early launch's cost from the wait's.
- `prefetch` (with `on` or `exit`): before its wait, a kernel whose weights no kernel in flight
  writes asks L2 for its own lines of them (l2_prefetch.py's `prefetch_lines`), so they
  stream in while the kernel before it runs: the skinny matmuls and o_proj + norm (their
  weights are the model's), and MoE gate/up on the device path (its rows are the fill plan's,
  two kernels back: the plan completed before the copy kernel's wait returned, so before
  gate/up's programs started; the rows are read past L1, `.cg`, and the copy kernel's writes
  to a filled slot reach the lines in L2 after the prefetch as before it). A prefetch moves no
  data into the kernel: correctness never depends on it.
- `light`: `on` for the small kernels only; the weight-streaming ones (MoE gate/up and down, the
  skinny matmul, o_proj + norm) launch as without PDL, save the attention front (norm_qkv.py),
  which always follows a small kernel (the MoE sum over k, or the embedding): it launches
  early. Its weights' L2 prefetch before the wait cost 4% at 48 layers b=1 (thirty-eighth
  session: 301.7 against 314.1 tok/s under `on`), so it asks for it only under `prefetch`. An
  early launch places a grid's programs on the SMs that have room while the kernel before it
  still runs, which for a one-wave kernel can mean fewer SMs streaming its weights: one
  explanation of `on`'s loss at b=1. Measured in the twenty-third session (48 layers): all
  resident b=1 299.5 and b=4 675.2 tok/s against off's 296.1 / 664.2 (`exit` 296.9 / 665.5,
  `prefetch` 282.9 / 685.3); the default.
The rule in full, then: before `enter`, no store, no atomic, no return, and no load of anything
a kernel still in flight may write (the kernel just before, or one it waits for); index
arithmetic, `prefetch_lines` and gate/up's `.cg` read of rows settled two kernels back may, and
so may paged attention's loads of the step's lengths (cu_q_lens, kv_lens: written only by the
step's input copies, before its first kernel), which cut its tile ranges before the wait.

The switch (FREETOKEN_PDL's words, `override` for benches and tests) is kernels/pdl_switch.py,
which needs no Triton: an engine checks the variable when it loads. A captured CUDA graph keeps
the launches it was captured with.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from freetoken_agent.kernels.pdl_switch import (  # noqa: F401 - the switch, re-exported
    LIGHT,
    PREFETCH,
    RELEASE,
    WAIT,
    flags,
    override,
    requested,
)


def supported(device: torch.device) -> bool:
    """sm_90+ CUDA, and a Triton with the griddepcontrol builtins (launches are per call)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _sm90_with_gdc(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _sm90_with_gdc(index: int) -> bool:
    # ROCm reports its GPUs through torch.cuda too, MI300 as capability 9.x: no PDL there.
    if torch.version.hip is not None or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")


def launch(
    device: torch.device, heavy: bool = False, prefetch: bool = False, lead: bool = False
) -> dict:
    """Keyword arguments for a PDL-aware kernel's launch: its `PDL` flags, and `launch_pdl`
    when PDL is on for `device` (and, with LIGHT, the kernel is not `heavy`: one that streams
    weights, unless it `lead`s). PREFETCH only where the caller says `prefetch`: the kernel has
    a prefetch before its wait and what it prefetches is settled (other kernels compile no
    variant for it). `lead` (a heavy kernel that always follows a small one: the attention
    front after the MoE sum over k) launches early under LIGHT too: it takes no SMs from a
    streaming grid. Spread into the launch: `kernel[grid](..., **pdl.launch(dev))`."""
    bits = requested()
    if not bits or not supported(device) or (heavy and not lead and bits & LIGHT):
        return {"PDL": 0}
    return {"PDL": bits & (WAIT | RELEASE | (PREFETCH if prefetch else 0)), "launch_pdl": True}


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL-aware kernel's wait for the kernel before it in the stream to complete, then (with
    RELEASE) the next one's launch: before anything that reads what a kernel writes (module
    docstring: the rule, and why the release comes here)."""
    if PDL & 1:  # WAIT
        tl.extra.cuda.gdc_wait()
    if PDL & 2:  # RELEASE
        tl.extra.cuda.gdc_launch_dependents()
