"""Hybrid models' checkpoints under overlap scheduling (engine/overlap.py): decode step N is
scheduled before step N-1's tokens are read, so the checkpoint a request's accept of N-1's
token may take is taken before N updates its state, then kept or given back once the token is
known. The scheduler (`Scheduler.ahead`) holds one; it reads the recurrence's pool, takes a
positional checkpoint through the scheduler's own `save_checkpoint` and links a kept one to
the request's checkpoints before it through the scheduler's `link_pending` (the pool's drop
order: kv/checkpoint_costs.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freetoken_agent.engine.request import Recurrence, Request


class AheadCheckpoints:
    def __init__(
        self,
        recurrence: Recurrence | None,
        save_checkpoint: Callable[[Request, int], None],
        link_pending: Callable[[Request, Any], None],
    ) -> None:
        self.recurrence = recurrence  # None: a model without recurrent layers
        self._save_checkpoint = save_checkpoint  # (request, boundary): the accept's own kind
        self._link_pending = link_pending  # (request, checkpoint): as the accept's own are

    def may_checkpoint_at_accept(self, req: Request) -> bool:
        """Whether accepting the token the request's last step sampled may checkpoint its
        state (`checkpoint_decode`, at boundary num_computed): then the checkpoint must be
        taken before the next step runs (`checkpoint_ahead`)."""
        rec = self.recurrence
        if rec is None or not req.use_prefix_cache or not rec.mode.reuses:
            return False
        if rec.mode.kind == "anchors":
            return bool(req.anchor_tokens)  # whether the token is one is not known yet
        return rec.mode.at_decode(req.num_computed, -1, req.anchor_tokens)

    def checkpoint_ahead(self, req: Request) -> bool:
        """Take now, before the next step updates the state, the checkpoint the accept of the
        token in flight may take (`may_checkpoint_at_accept`): at a positional boundary it is
        the accept's own (its `checkpoint_decode` finds it pending); under anchors it is kept
        only if the token is an anchor (`settle_ahead`), else released. A state copy a step
        while a request has anchor tokens (~30-60 MB for a Qwen3.6-shaped request: tens of us
        on an H200, against a step boundary of ~0.5 ms of host work). False when no device
        row is free of locks: the caller steps without overlap."""
        rec, boundary = self.recurrence, req.num_computed
        if rec.mode.kind != "anchors":
            if any(b == boundary for b, _ in req.pending_checkpoints):
                return True
            self._save_checkpoint(req, boundary)
            # No row free now: not overlapped, so the accept's own checkpoint comes before the
            # next step (overlapped, a row freed by then took the state a token past boundary).
            return any(b == boundary for b, _ in req.pending_checkpoints)
        ckpt = rec.checkpoints.reserve(boundary)
        if ckpt is None:
            return False
        rec.checkpoints.save(ckpt, rec.states, req.state_slot)  # queued on the stream
        rec.checkpoints.unlock(ckpt)
        req.ahead_checkpoint = (boundary, ckpt)
        return True

    def settle_ahead(self, req: Request, token: int) -> None:
        """Before the accept of `token`: keep the checkpoint taken ahead if the accept would
        take one there (the token is an anchor), else give its row back."""
        if req.ahead_checkpoint is None:
            return
        (boundary, ckpt), req.ahead_checkpoint = req.ahead_checkpoint, None
        rec = self.recurrence
        if ckpt.tier == "dropped":
            # Unlocked once saved, it is the pool's to spill or drop like any other: another
            # request's checkpoint ahead took its row. Forgotten, as pending ones are (releasing
            # it failed both requests of the overlapped pair).
            return
        if boundary == req.num_computed and rec.mode.at_decode(boundary, token, req.anchor_tokens):
            req.pending_checkpoints.append((boundary, ckpt))
            self._link_pending(req, ckpt)
        else:
            rec.checkpoints.release(ckpt)
