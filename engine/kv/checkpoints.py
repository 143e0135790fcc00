"""The checkpoint pool: recurrent state saved at token boundaries (semantic anchors).

Recurrent layers cannot be truncated, so a sequence can only resume from a state saved at a
boundary it shares with the new request. A checkpoint holds every recurrent layer's (conv, ssm)
state of one sequence at one boundary, in one row of one of two tiers:

- the device tier, [L, Cd, ...] on the engine's device: a layer's slice [Cd, ...] is what the
  kernels write snapshots into (`RecurrentStateView.conv_snap / ssm_snap`), so a checkpoint is
  born there (`reserve`, then a kernel or `save` writes it);
- the host tier, [Ch, L, ...] in host memory (pinned on CUDA): one checkpoint is one contiguous
  row, so a spill or a restore is one copy per tensor.

Space: `reserve` needs a free device row; when there is none it moves the least recently used
unlocked device checkpoint to the host tier (a spill: restoring from the host costs one copy).
When the host tier is full too (or absent), the pool must drop a checkpoint: the one of either
tier whose loss costs least (checkpoint_costs.py: GreedyDual over the tokens a drop would
re-prefill, which with equal costs is LRU). Dropping a host checkpoint makes room for the
spill; dropping a device one frees its row. A drop calls `on_drop(ckpt)` so the owner (a radix
node) forgets it. A locked checkpoint is never moved or dropped: its row is named in a step
being built or run. When every device row is locked, `reserve` returns None and the caller
skips that snapshot: running out of checkpoint space is never an error.

Ordering: every copy is `copy_(..., non_blocking=True)` on the current stream, the stream that
runs the model, so the copies are ordered with the kernels that write snapshot rows and the
kernels that read state rows. A spill's device-to-host copy is therefore finished before a later
kernel overwrites the device row it read from, and a host row is only ever read by a
host-to-device copy on that same stream (the CPU never reads it), so no sync is needed. A caller
that issues pool calls from another stream must synchronise the two itself.

Single-threaded, like the scheduler that calls it. The host tier's size is fixed at
construction. The device tier's may move between 1 and `max_device_rows` (`resize_device`, at
the elastic memory manager's safe points): then each layer's conv and ssm rows live in a lane
of device addresses reserved for `max_device_rows` and backed only up to `device_rows`
(checkpoint_lanes.py, over engine/device_memory.py), so the views the kernels hold never move.
Shrinking empties the rows above the new top first: their checkpoints move to free rows below,
or spill (or drop) as `reserve` would; a locked one keeps its row, and the top stays above it.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from freetoken_agent.engine.device_memory import ChunkedMemory
from freetoken_agent.engine.kv.checkpoint_costs import DropCosts
from freetoken_agent.engine.kv.checkpoint_lanes import lane_spans, lane_views, map_rows
from freetoken_agent.engine.kv.recurrent_state import (
    SCRATCH_SLOT,
    RecurrentStatePool,
    ssm_dtype_for,
    state_bytes,
)

# L recurrent layers, Cd device-tier rows, Ch host-tier rows, C conv channels, K conv width,
# Hv value heads, Dk / Dv key / value head dims

DEVICE, HOST, DROPPED = "device", "host", "dropped"


@dataclass(slots=True, eq=False)
class Checkpoint:
    """One sequence's recurrent state at one token boundary. Handed out by the pool; its tier
    and row change only inside pool calls."""

    boundary: int  # tokens [0, boundary) are in it; informational
    tier: str  # DEVICE | HOST | DROPPED (dropped for space, or released)
    row: int  # row in its tier, -1 once dropped
    last_used: int  # LRU clock
    locks: int = 0  # > 0: never moved or dropped (being written this step, or being restored)
    owner: Any = None  # whoever holds it (the radix node); passed back in on_drop
    # The drop order (checkpoint_costs.py): tokens its loss would re-prefill, its GreedyDual
    # credit, and its links to the checkpoints next above and below it on its path.
    gap: int = 0
    credit: int = 0
    prev: Checkpoint | None = field(default=None, repr=False)  # (a repr would walk the chain)
    deeper: set[Checkpoint] = field(default_factory=set, repr=False)


class CheckpointPool:
    def __init__(
        self,
        n_layers: int,
        device_rows: int,
        host_rows: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str,
        on_drop: Callable[[Checkpoint], None] | None = None,
        max_device_rows: int | None = None,
    ) -> None:
        if device_rows < 0 or host_rows < 0:
            raise ValueError(f"checkpoint rows must be >= 0, got {device_rows} and {host_rows}")
        self.n_layers = n_layers
        self.device_rows = device_rows
        self.max_device_rows = max(device_rows, max_device_rows or 0)
        self.host_rows = host_rows
        self.conv_shape = tuple(conv_shape)
        self.ssm_shape = tuple(ssm_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.on_drop = on_drop
        sdt = ssm_dtype_for(dtype)
        self._lanes: list[tuple[ChunkedMemory, int]] = []  # (memory, bytes of one row)
        if self.max_device_rows > device_rows:  # resizable: lanes of reserved addresses
            self.conv = lane_views(self, conv_shape, dtype)  # [L, Cmax, C, K - 1]
            self.ssm = lane_views(self, ssm_shape, sdt)  # [L, Cmax, Hv, Dk, Dv]
            if not map_rows(self, device_rows):
                raise torch.cuda.OutOfMemoryError("no device memory for the checkpoint rows")
        else:
            shape = (n_layers, device_rows)
            self.conv = torch.empty((*shape, *conv_shape), dtype=dtype, device=device)
            self.ssm = torch.empty((*shape, *ssm_shape), dtype=sdt, device=device)
        pin = self.device.type == "cuda" and torch.cuda.is_available() and host_rows > 0
        (self.host_conv, self.host_ssm), self.pinned = _alloc_host(
            [((host_rows, n_layers, *conv_shape), dtype), ((host_rows, n_layers, *ssm_shape), sdt)],
            pin,
        )
        # row -> checkpoint (None: free); free lists are stacks so reuse stays in hot rows
        self._rows: dict[str, list[Checkpoint | None]] = {
            DEVICE: [None] * device_rows,
            HOST: [None] * host_rows,
        }
        self._free: dict[str, list[int]] = {
            DEVICE: list(range(device_rows - 1, -1, -1)),
            HOST: list(range(host_rows - 1, -1, -1)),
        }
        self._clock = itertools.count(1)
        self._now = 0
        self.costs = DropCosts()
        self._doomed: set[Checkpoint] = set()  # released while locked: freed at the last unlock
        self._counts = {
            "spilled": 0,  # device -> host moves
            "dropped": 0,  # dropped for space (on_drop called)
            "released": 0,  # released by their owner
            "reserve_skipped": 0,  # snapshots given no row: every device row was locked
            "restored_from_device": 0,
            "restored_from_host": 0,
        }

    @staticmethod
    def bytes_per_checkpoint(
        n_layers: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        dtype: torch.dtype,
    ) -> int:
        return state_bytes(n_layers, conv_shape, ssm_shape, dtype)

    # --- the device tier's size ------------------------------------------------------------
    @property
    def resizable(self) -> bool:
        return bool(self._lanes)

    @property
    def device_used(self) -> int:
        """Device rows holding a checkpoint."""
        return self.device_rows - len(self._free[DEVICE])

    @property
    def row_bytes(self) -> int:
        """Bytes of one checkpoint (every layer's conv and ssm)."""
        return self.bytes_per_checkpoint(self.n_layers, self.conv_shape, self.ssm_shape, self.dtype)

    @property
    def device_bytes(self) -> int:
        """Device bytes the usable rows take."""
        return self.device_rows * self.row_bytes

    def resize_device(self, rows: int) -> int:
        """Make `rows` device rows usable (at least 1, at most max_device_rows; never below a
        locked checkpoint's row). Returns the rows it has now: unchanged when the device
        refuses the memory to grow."""
        if not self._lanes:
            raise ValueError("this checkpoint pool's device tier has a fixed size")
        rows = max(1, min(rows, self.max_device_rows))
        table, free = self._rows[DEVICE], self._free[DEVICE]
        if rows > self.device_rows:
            if not map_rows(self, rows):
                return self.device_rows
            # New rows go to the cold end of the free stack: reuse stays in hot rows.
            free[:0] = range(rows - 1, self.device_rows - 1, -1)
            table.extend([None] * (rows - self.device_rows))
        elif rows < self.device_rows:
            locked = [r for r, c in enumerate(table) if c is not None and c.locks]
            rows = max(rows, max(locked, default=-1) + 1)
            for r in range(rows, self.device_rows):
                ckpt = table[r]
                if ckpt is None:
                    continue
                below = [f for f in free if f < rows]
                if below:
                    self._move_device_row(ckpt, below[-1])
                else:
                    self._evict_device(ckpt)
            del table[rows:]
            self._free[DEVICE] = [f for f in free if f < rows]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # moves and spills still read those rows
            for memory, lo, hi in lane_spans(self, rows):  # each lane above its new top
                memory.unmap(lo, hi)
        self.device_rows = rows
        return rows

    def _move_device_row(self, ckpt: Checkpoint, dst: int) -> None:
        src, free = ckpt.row, self._free[DEVICE]
        self.conv[:, dst].copy_(self.conv[:, src], non_blocking=True)
        self.ssm[:, dst].copy_(self.ssm[:, src], non_blocking=True)
        free.remove(dst)
        free.append(src)
        self._rows[DEVICE][dst], self._rows[DEVICE][src] = ckpt, None
        ckpt.row = dst

    def reservable(self) -> int:
        """Device rows `reserve` can hand out now: the free ones and those holding an unlocked
        checkpoint (spilled or dropped to make room)."""
        return sum(1 for c in self._rows[DEVICE] if c is None or not c.locks)

    def skip(self, boundaries: int) -> None:
        """Count boundaries a caller gave no row (it found fewer reservable rows than them)."""
        self._counts["reserve_skipped"] += boundaries

    # --- lifecycle ----------------------------------------------------------------------
    def reserve(self, boundary: int, owner: Any = None) -> Checkpoint | None:
        """A device row for a snapshot about to be written, returned locked (the caller unlocks
        it once the step that writes it has been issued). None when every device row is locked."""
        free = self._free[DEVICE]
        if not free:
            victim = self._lru(DEVICE)
            if victim is None:
                self._counts["reserve_skipped"] += 1
                return None
            if self._free[HOST]:
                self._spill(victim)
            else:  # a drop: the cheapest of both tiers; a device one frees its row itself
                cheapest = self.costs.cheapest(self._unlocked())
                on_host = cheapest.tier == HOST
                self._drop(cheapest)
                if on_host:
                    self._spill(victim)
        row = free.pop()
        ckpt = Checkpoint(boundary, DEVICE, row, self._tick(), locks=1, owner=owner)
        self.costs.born(ckpt)
        self._rows[DEVICE][row] = ckpt
        return ckpt

    def save(self, ckpt: Checkpoint, state: RecurrentStatePool, slot: int) -> None:
        """Copy the live state row `slot` into ckpt's device row (every layer)."""
        self._check_live(ckpt)
        if ckpt.tier != DEVICE:
            raise AssertionError(f"save() writes a device-tier checkpoint, this one is {ckpt.tier}")
        self._check_slot(state, slot)
        self.conv[:, ckpt.row].copy_(state.conv[:, slot], non_blocking=True)  # [L, C, K - 1]
        self.ssm[:, ckpt.row].copy_(state.ssm[:, slot], non_blocking=True)  # [L, Hv, Dk, Dv]
        self.touch(ckpt)

    def restore(self, ckpt: Checkpoint, state: RecurrentStatePool, slot: int) -> None:
        """Copy ckpt into the state row `slot` from whichever tier holds it (touches LRU)."""
        self._check_live(ckpt)
        self._check_slot(state, slot)
        if ckpt.tier == DEVICE:
            conv, ssm = self.conv[:, ckpt.row], self.ssm[:, ckpt.row]
        else:
            conv, ssm = self.host_conv[ckpt.row], self.host_ssm[ckpt.row]
        state.conv[:, slot].copy_(conv, non_blocking=True)  # [L, C, K - 1]
        state.ssm[:, slot].copy_(ssm, non_blocking=True)  # [L, Hv, Dk, Dv]
        self._counts[f"restored_from_{ckpt.tier}"] += 1
        self.touch(ckpt)

    def lock(self, ckpt: Checkpoint) -> None:
        self._check_live(ckpt)
        ckpt.locks += 1

    def unlock(self, ckpt: Checkpoint) -> None:
        self._check_live(ckpt)
        if ckpt.locks <= 0:
            raise AssertionError("checkpoint unlocked more often than locked")
        ckpt.locks -= 1
        if not ckpt.locks and ckpt in self._doomed:
            self._doomed.discard(ckpt)
            self._unlink(ckpt)

    def touch(self, ckpt: Checkpoint) -> None:
        self._check_live(ckpt)
        ckpt.last_used = self._tick()
        self.costs.used(ckpt)

    def link(self, ckpt: Checkpoint, prev: Checkpoint | None) -> None:
        """The owner hung `ckpt` below `prev`, the deepest live checkpoint above it on its path
        (None: none), so its loss would re-prefill from there (checkpoint_costs.py)."""
        self._check_live(ckpt)
        if prev is not None:
            self._check_live(prev)
        self.costs.link(ckpt, prev)

    def release(self, ckpt: Checkpoint) -> None:
        """The owner no longer needs ckpt: its row is freed (no on_drop call). A locked
        checkpoint keeps its row until its last unlock: the row is named in a step, and handing
        it to another snapshot of that step would let two writers share it."""
        self._check_live(ckpt)
        if ckpt in self._doomed:
            raise AssertionError(f"checkpoint at boundary {ckpt.boundary} released twice")
        self._counts["released"] += 1
        if ckpt.locks:
            self._doomed.add(ckpt)
        else:
            self._unlink(ckpt)

    # --- space --------------------------------------------------------------------------
    def _evict_device(self, victim: Checkpoint) -> None:
        """Free victim's device row: spill it to the host tier, or drop it."""
        if not self._free[HOST]:
            # Drop whichever of the victim and the host checkpoints costs least to lose (a host
            # checkpoint restored often, or far from any other, can be worth more than it).
            host = (c for c in self._rows[HOST] if c is not None and not c.locks)
            cheapest = self.costs.cheapest([victim, *host])
            self._drop(cheapest)
            if cheapest is victim:
                return
        self._spill(victim)

    def _spill(self, victim: Checkpoint) -> None:
        """Move victim from its device row to a free host row."""
        host_row = self._free[HOST].pop()
        dev_row = victim.row
        # The device slices are strided ([L, ...] at one row): torch packs them on the device,
        # then one copy into the contiguous host row, queued on the current stream.
        self.host_conv[host_row].copy_(self.conv[:, dev_row], non_blocking=True)
        self.host_ssm[host_row].copy_(self.ssm[:, dev_row], non_blocking=True)
        self._rows[DEVICE][dev_row] = None
        self._free[DEVICE].append(dev_row)
        self._rows[HOST][host_row] = victim
        victim.tier, victim.row = HOST, host_row
        self._counts["spilled"] += 1

    def _drop(self, ckpt: Checkpoint) -> None:
        self.costs.dropped(ckpt)
        self._unlink(ckpt)
        self._counts["dropped"] += 1
        if self.on_drop is not None:
            self.on_drop(ckpt)  # after the pool is consistent: the owner may inspect it

    def _unlink(self, ckpt: Checkpoint) -> None:
        self.costs.unlink(ckpt)
        self._rows[ckpt.tier][ckpt.row] = None
        self._free[ckpt.tier].append(ckpt.row)
        ckpt.tier, ckpt.row = DROPPED, -1

    def _lru(self, tier: str) -> Checkpoint | None:
        """The least recently used unlocked checkpoint of a tier. A scan: it runs only when the
        tier is full, and rows number in the hundreds."""
        best = None
        for c in self._rows[tier]:
            if c is not None and not c.locks and (best is None or c.last_used < best.last_used):
                best = c
        return best

    def _unlocked(self) -> list[Checkpoint]:
        """Every unlocked checkpoint of both tiers."""
        return [c for t in (DEVICE, HOST) for c in self._rows[t] if c is not None and not c.locks]

    def _tick(self) -> int:
        self._now = next(self._clock)
        return self._now

    # --- checks -------------------------------------------------------------------------
    def _check_live(self, ckpt: Checkpoint) -> None:
        if ckpt.tier == DROPPED:
            raise AssertionError(f"checkpoint at boundary {ckpt.boundary} was dropped or released")
        rows = self._rows.get(ckpt.tier)
        if rows is None or not 0 <= ckpt.row < len(rows) or rows[ckpt.row] is not ckpt:
            raise AssertionError("checkpoint does not belong to this pool")

    def _check_slot(self, state: RecurrentStatePool, slot: int) -> None:
        self.check_compatible(state)
        if slot == SCRATCH_SLOT or not 0 < slot < state.n_slots:
            raise AssertionError(f"state slot {slot} is not a live slot (1..{state.n_slots - 1})")

    def check_compatible(self, state: RecurrentStatePool) -> None:
        """The state pool and this pool hold the same layers, shapes, dtype and device."""
        ours = (self.n_layers, self.conv_shape, self.ssm_shape, self.dtype, self.device)
        theirs = (state.n_layers, state.conv_shape, state.ssm_shape, state.dtype, state.device)
        if ours != theirs:
            raise ValueError(f"checkpoint pool {ours} does not match the state pool {theirs}")

    # checkpoint_audit.py imports this module (the tier names), so it is imported at the call.
    def stats(self) -> dict:
        from freetoken_agent.engine.kv.checkpoint_audit import pool_stats

        return pool_stats(self)

    def check_integrity(self) -> None:
        from freetoken_agent.engine.kv.checkpoint_audit import check_pool_integrity

        check_pool_integrity(self)


def _alloc_host(
    specs: list[tuple[tuple[int, ...], torch.dtype]], pin: bool
) -> tuple[list[torch.Tensor], bool]:
    """Host tensors, pinned when asked and possible (pinned copies run at full PCIe speed and
    can be asynchronous); pageable with one warning when pinning fails (e.g. locked-memory
    limits), since a slower spill beats no host tier."""
    if pin:
        try:
            return [torch.empty(s, dtype=d, pin_memory=True) for s, d in specs], True
        except RuntimeError as e:
            warnings.warn(
                f"checkpoint host tier: pinning failed ({e}); using pageable memory "
                "(spills and host restores will be slower)",
                stacklevel=3,
            )
    return [torch.empty(s, dtype=d) for s, d in specs], False
