"""What a recurrent (linear-attention) layer reads from the step, and where its state lives.

Hybrid models (qwen3_next, qwen3_5_moe) interleave gated-DeltaNet layers with full attention.
A DeltaNet layer carries two states per sequence from token to token: the short causal conv's
last K - 1 inputs and the delta rule's matrix state. Both live in pools indexed by a per-request
*state slot* (row 0 is scratch: padded rows of captured graphs read and write it). The runner
binds each layer to its slice of the pools; the scheduler gives every running request a slot.

Checkpoints (semantic anchors): a step may ask for a snapshot of the state at a token boundary
inside a prefill chunk: after token t, copy the state of t's sequence into checkpoint row
`snap_slots[t]` of the checkpoint pool (-1: no snapshot after t). The conv snapshot is the last
K - 1 conv inputs up to and including token t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# T tokens of the step, B sequences, C conv channels, K conv width, Hv value heads,
# Dk / Dv key / value head dims, N state slots, Cn checkpoint rows


@dataclass(slots=True)
class RecurrentMetadata:
    """Built by the ModelRunner per step (or held static by a decode graph)."""

    state_slots: torch.Tensor  # [B] int64: each sequence's row in the state pools
    # [T] int64 checkpoint row to write after token t, -1 for none; None: no snapshot this step
    snap_slots: torch.Tensor | None
    # Host copy of cu_q_lens; None for decode-only steps (one token per sequence): then the
    # layer must not synchronise with the device or loop over data (it runs in CUDA graphs).
    seq_bounds: tuple[int, ...] | None


@dataclass(slots=True)
class RecurrentStateView:
    """One recurrent layer's slices of the state and checkpoint pools (bound by the runner)."""

    conv: torch.Tensor  # [N, C, K - 1] model dtype
    ssm: torch.Tensor  # [N, Hv, Dk, Dv] fp32
    conv_snap: torch.Tensor  # [Cn, C, K - 1]
    ssm_snap: torch.Tensor  # [Cn, Hv, Dk, Dv] fp32
