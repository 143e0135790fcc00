"""The recurrent-state pool: per-sequence state of every gated-DeltaNet layer.

A recurrent layer carries two states from token to token: the causal conv's last K - 1 inputs
(model dtype) and the delta rule's matrix state (fp32: it accumulates over the whole sequence,
so bf16 would drift). Both live in one tensor per kind, [L, N, ...]: a layer's slice [N, ...] is
contiguous, which is what the kernels index with the step's `state_slots`.

Slot 0 is scratch and never handed out: padded rows of a captured CUDA graph read and write it,
so padding can never touch a live sequence (the same rule as the KV pool's page 0). Slots are
zeroed when handed out: a fresh sequence starts from the zero state, and a resumed one is
overwritten by `CheckpointPool.restore` right after.

`conv_shape` is the conv *state's* shape (C, K - 1), not the conv weight's (C, K);
`ssm_shape` is (Hv, Dk, Dv). These are `LinearAttentionSpec.conv_state_shape` and
`ssm_state_shape`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.layers.recurrent import RecurrentStateView

if TYPE_CHECKING:
    from freetoken_agent.engine.kv.checkpoints import CheckpointPool

# L recurrent layers, N state slots, C conv channels, K conv width, Hv value heads,
# Dk / Dv key / value head dims, Cn checkpoint rows (device tier)

SCRATCH_SLOT = 0


class OutOfStateSlots(RuntimeError):
    pass


def ssm_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The matrix state is fp32 whatever the model dtype, except fp64 (reference runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_bytes(
    n_layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int], dtype: torch.dtype
) -> int:
    """Bytes of one sequence's state over every recurrent layer (a slot, or a checkpoint)."""
    conv = math.prod(conv_shape) * dtype.itemsize
    ssm = math.prod(ssm_shape) * ssm_dtype_for(dtype).itemsize
    return n_layers * (conv + ssm)


class RecurrentStatePool:
    """Conv and matrix state of every recurrent layer, one row (slot) per running sequence."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if n_slots < 2:
            raise ValueError(f"the recurrent-state pool needs at least 2 slots, got {n_slots}")
        if len(conv_shape) != 2 or len(ssm_shape) != 3:
            raise ValueError(
                f"conv_shape must be (C, K - 1) and ssm_shape (Hv, Dk, Dv), "
                f"got {conv_shape} and {ssm_shape}"
            )
        self.n_layers = n_layers
        self.n_slots = n_slots
        self.conv_shape = tuple(conv_shape)
        self.ssm_shape = tuple(ssm_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        # Zeroed once so the scratch slot never holds NaN/inf garbage that padded rows would
        # carry through their (discarded) arithmetic.
        # [L, N, C, K - 1]
        self.conv = torch.zeros((n_layers, n_slots, *conv_shape), dtype=dtype, device=device)
        # [L, N, Hv, Dk, Dv]
        self.ssm = torch.zeros(
            (n_layers, n_slots, *ssm_shape), dtype=ssm_dtype_for(dtype), device=device
        )
        self._free: deque[int] = deque(range(1, n_slots))
        self._is_free = [False] + [True] * (n_slots - 1)

    # --- slots --------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Slots that can ever be handed out (all but the scratch slot)."""
        return self.n_slots - 1

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    @staticmethod
    def bytes_per_slot(
        n_layers: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        dtype: torch.dtype,
    ) -> int:
        return state_bytes(n_layers, conv_shape, ssm_shape, dtype)

    def alloc(self) -> int:
        """A free slot with its state zeroed (on the current stream, like every write)."""
        if not self._free:
            raise OutOfStateSlots(
                f"all {self.capacity} recurrent-state slots are in use (one per running sequence)"
            )
        slot = self._free.popleft()
        self._is_free[slot] = False
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if slot == SCRATCH_SLOT:
            raise AssertionError("the scratch state slot 0 is never allocated, cannot free it")
        if not 0 < slot < self.n_slots:
            raise AssertionError(f"state slot {slot} out of range 1..{self.n_slots - 1}")
        if self._is_free[slot]:
            raise AssertionError(f"double free of state slot {slot}")
        self._is_free[slot] = True
        self._free.append(slot)

    def is_allocated(self, slot: int) -> bool:
        return 0 < slot < self.n_slots and not self._is_free[slot]

    # --- binding ------------------------------------------------------------------------
    def view(self, layer: int, checkpoints: CheckpointPool | None) -> RecurrentStateView:
        """Recurrent layer `layer`'s slices (layer = its ordinal among the recurrent layers).

        The snapshot tensors are the checkpoint pool's device tier; without a pool they are
        empty ([0, ...]), so a step must then pass no snapshot rows."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"recurrent layer {layer} out of range (pool has {self.n_layers})")
        if checkpoints is None:
            conv_snap = self.conv.new_empty((0, *self.conv_shape))
            ssm_snap = self.ssm.new_empty((0, *self.ssm_shape))
        else:
            checkpoints.check_compatible(self)
            conv_snap = checkpoints.conv[layer]  # [Cn, C, K - 1]
            ssm_snap = checkpoints.ssm[layer]  # [Cn, Hv, Dk, Dv]
        return RecurrentStateView(
            conv=self.conv[layer],  # [N, C, K - 1]
            ssm=self.ssm[layer],  # [N, Hv, Dk, Dv]
            conv_snap=conv_snap,
            ssm_snap=ssm_snap,
        )

    # --- invariants ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "duplicate slots in the free list"
        assert SCRATCH_SLOT not in self._free, "the scratch state slot was handed out"
        assert not self._is_free[SCRATCH_SLOT], "the scratch state slot is marked free"
        assert all(self._is_free[s] for s in self._free), "a free-listed slot is marked in use"
        assert sum(self._is_free) == len(self._free), "free marks and free list disagree"
        assert self.conv.shape == (self.n_layers, self.n_slots, *self.conv_shape)
        assert self.ssm.shape == (self.n_layers, self.n_slots, *self.ssm_shape)
        assert self.ssm.dtype == ssm_dtype_for(self.dtype)
