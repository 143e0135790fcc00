"""Which checkpoint the pool drops when it must drop one: the one whose loss costs least.

A dropped checkpoint costs the tokens between it and the next shallower checkpoint on its path
(its `gap`): a request that would have resumed there resumes from that one and prefills the gap
again. Plain LRU ignores that. In one long agent history with more anchors than rows it drops
the oldest anchor first, the end of the system prompt and tools, whose loss re-prefills the
whole history. A long re-prefill by one session drops every checkpoint of the others, their
sparse first anchors too. Anchors close to a kept neighbour cost little to lose.

The rule is GreedyDual (Young, 1994; Cao and Irani's GreedyDual-Size for web caches):
- each checkpoint holds a credit, set at every use to `inflation + gap`;
- the pool drops the checkpoint of least credit (ties: the least recently used);
- `inflation` rises to the dropped one's credit.
A checkpoint used long ago thus loses to one used lately only when its gap is smaller than the
inflation since its use. With equal gaps the rule is LRU.

Gaps follow the radix tree. The tree links a checkpoint it hangs to the deepest live
checkpoint above it on its path (`link`); until then the scheduler links it to its request's
previous checkpoint, or the one the request resumed from (`Scheduler._link_pending`: a long
prefill hangs its checkpoints only at its end). When a checkpoint leaves the pool, the checkpoints
linked below it inherit its gap, and their credit grows by as much (`unlink`): their loss now
re-prefills from further up.

Approximations, each erring toward keeping a checkpoint:
- a checkpoint with nothing linked above it (the first of a request that resumed from none)
  costs its whole boundary;
- a checkpoint hung above one already linked elsewhere (rare: a shallower anchor saved after a
  deeper one on the same path) does not shorten the deeper one's gap;
- siblings sharing tokens across branches do not count as shallower checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Any

_DROP_ORDER = attrgetter("credit", "last_used")


class DropCosts:
    """The pool's drop order: GreedyDual credits over the checkpoints' gaps."""

    def __init__(self) -> None:
        self.inflation = 0  # the credit of the last checkpoint dropped for space

    def born(self, ckpt: Any) -> None:
        """A new checkpoint: its gap is its whole boundary until the tree links it."""
        ckpt.gap = ckpt.boundary
        self.used(ckpt)

    def used(self, ckpt: Any) -> None:
        ckpt.credit = self.inflation + ckpt.gap

    def link(self, ckpt: Any, prev: Any | None) -> None:
        """`prev`: the deepest live checkpoint above `ckpt` on its path (None: none)."""
        if ckpt.prev is not None:
            ckpt.prev.deeper.discard(ckpt)
        ckpt.prev = prev
        ckpt.gap = ckpt.boundary - (prev.boundary if prev is not None else 0)
        if prev is not None:
            prev.deeper.add(ckpt)
        self.used(ckpt)

    def unlink(self, ckpt: Any) -> None:
        """`ckpt` leaves the pool: those linked below it fall back to its own predecessor."""
        prev = ckpt.prev
        if prev is not None:
            prev.deeper.discard(ckpt)
        for below in ckpt.deeper:
            below.prev = prev
            below.gap += ckpt.gap
            below.credit += ckpt.gap
            if prev is not None:
                prev.deeper.add(below)
        ckpt.prev, ckpt.deeper = None, set()

    def dropped(self, ckpt: Any) -> None:
        self.inflation = max(self.inflation, ckpt.credit)

    @staticmethod
    def cheapest(candidates: Iterable[Any]) -> Any | None:
        """The checkpoint to drop among `candidates` (unlocked ones): least credit, then least
        recently used."""
        return min(candidates, key=_DROP_ORDER, default=None)
