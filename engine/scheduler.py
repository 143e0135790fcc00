"""Scheduler: decides what each step computes. It holds requests and page ids, never tensors.

One step is a token budget (`max_batched_tokens`) shared by every running request: each
decoding request gets its one token first, then partly prefilled requests continue, then waiting
requests are admitted while the budget and `max_num_seqs` allow. A long prompt is prefilled in
chunks across steps, beside the decodes of others (chunked prefill, continuous batching).

Pages: on admission the radix cache is searched for the request's tokens; matched full pages are
shared (locked), a partially matched page is copied into a private one. Pages for new tokens are
allocated step by step. When the pool runs dry, unreferenced cached pages are evicted; if that is
not enough, the most recently admitted request is preempted: its pages go to the prefix cache
and it waits to be re-admitted, when it re-prefills only what was evicted meanwhile.

Between steps (the safe point) nothing is in flight: the memory manager of later issues resizes
pools there.

Hybrid models (recurrent layers beside attention, see `Recurrence`): a running request also holds
a state slot. Its recurrent layers cannot rewind, so admission reuses cached KV only up to the
deepest recurrent checkpoint inside the matched prefix and restores the state from it; chunks
that cross a planned boundary (an anchor, see checkpoint_mode.py) carry snapshot rows for the
kernels to fill, and those checkpoints are hung on the radix tree with the request's pages. A
chunk that crosses more boundaries than the pool has device rows ends early or spreads its rows
(snapshot_rows.py).
A preempted hybrid request is checkpointed where it stops, so it resumes there.

A request alone in the engine that is preempted MAX_FRUITLESS_PREEMPTIONS + 1 times in a row
without computing a token in between cannot progress (its pages cannot grow): it is handed to
the engine to fail (`take_unservable`) rather than retried forever.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from freetoken_agent.engine.checkpoints_ahead import AheadCheckpoints
from freetoken_agent.engine.kv.checkpoints import DROPPED, Checkpoint
from freetoken_agent.engine.kv.pool import PageAllocator
from freetoken_agent.engine.kv.radix import RadixCache
from freetoken_agent.engine.request import Batch, Recurrence, Request, ScheduledChunk, Status
from freetoken_agent.engine.snapshot_rows import chunk_length, kept_boundaries

MAX_FRUITLESS_PREEMPTIONS = 3
# Evicting walks the whole prefix tree (RadixCache.evict: O(cached pages), ~1.6 ms at 200k
# cached tokens). Once the pool is full of cached prefixes, a long-running server's steady
# state, every decoding request crossing into a new page evicts: one walk per crossing cost a
# step ~25 ms at 16 requests. So a page crossing frees at least 1/EVICT_BATCH of the pool at
# once (the coldest leaves, which the next crossings take), a walk per ~EVICT_BATCH crossings.
EVICT_BATCH = 64


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        radix: RadixCache,
        page_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        recurrence: Recurrence | None = None,
    ) -> None:
        self.allocator = allocator
        self.radix = radix
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max(max_batched_tokens, max_num_seqs)
        # Under elastic memory the tokens the next step's workspace has room for (the memory
        # manager sets it at each safe point: engine/memory_workspace.py); None: no cap.
        self.step_tokens: int | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.pending_copies: list[tuple[int, int, int]] = []  # (src page, dst page, n tokens)
        self.recurrence = recurrence
        # overlap scheduling
        self.ahead = AheadCheckpoints(recurrence, self._save_checkpoint, self._link_pending)
        # Requests that cannot progress, with why: the engine fails them after `schedule`.
        self.unservable: list[tuple[Request, str]] = []

    # --- intake -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the decision -------------------------------------------------------------------
    def schedule(self) -> Batch:
        budget = self.max_batched_tokens
        if self.step_tokens is not None:
            budget = min(budget, self.step_tokens)
        chunks: list[ScheduledChunk] = []
        # Decodes first (one token each), then prefills in admission order.
        ordered = sorted(self.running, key=lambda r: r.n_tokens - r.num_computed > 1)
        for req in ordered:
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._fit_snapshots(req, min(req.n_tokens - req.num_computed, budget))
            if n <= 0:
                continue
            if not self._reserve(req, n, protect=chunks):
                continue  # req itself was preempted
            chunks.append(self._chunk(req, n))
            budget -= n
            if budget == 0:
                break
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._admit(req)
            n = self._fit_snapshots(req, min(req.n_tokens - req.num_computed, budget))
            if not self._grow(req, req.num_computed + n):
                self._release(req, cache=False)  # not now: it keeps its place in the queue
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.prefilling = True
            req.admissions += 1
            if req.first_admit_time is None:
                req.first_admit_time = time.perf_counter()
            req.num_reused += req.num_computed
            if req.admissions == 1:
                req.prompt_reused = min(req.num_computed, len(req.prompt_ids))
            req.num_resumed += req.resume_boundary
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
        return Batch(chunks)

    def _boundaries(self, req: Request, n: int) -> list[int]:
        """The planned boundaries the request's next n tokens cross that have no row yet
        (none on a model without recurrent layers: its plan is empty)."""
        plan, start = req.snapshot_plan, req.num_computed  # plan sorted: found by bisection
        # (a decode step of an agent history with thousands of anchors scanned them all)
        inside = plan[bisect.bisect_right(plan, start) : bisect.bisect_right(plan, start + n)]
        if not inside or self.recurrence is None:
            return []
        taken = {b for b, _ in req.pending_checkpoints}
        return [b for b in inside if b not in taken]

    def _fit_snapshots(self, req: Request, n: int) -> int:
        """n, or fewer so that every snapshot of the chunk gets a device row (snapshot_rows)."""
        boundaries = self._boundaries(req, n)
        if not boundaries or self.recurrence.checkpoints.device_rows == 0:
            return n  # (no device rows: no snapshot can be taken, nothing to cut for)
        rows = self.recurrence.checkpoints.reservable()
        return chunk_length(boundaries, req.num_computed, n, rows)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed
        tokens = req.token_range(start, start + n)
        chunk = ScheduledChunk(req, start, tokens, sample=start + n == req.n_tokens)
        boundaries = self._boundaries(req, n)
        if not boundaries:
            return chunk
        pool = self.recurrence.checkpoints
        kept = kept_boundaries(boundaries, pool.reservable())
        pool.skip(len(boundaries) - len(kept))  # rows short: never an error
        for b in kept:
            ckpt = pool.reserve(b)
            if ckpt is not None:
                chunk.snapshots.append((b, ckpt))
        # Owned by the request from now on, so every way out (finish, failure, preemption)
        # releases or hangs them.
        req.pending_checkpoints.extend(chunk.snapshots)
        for _, ckpt in chunk.snapshots:  # shallowest first: each links to the one before
            self._link_pending(req, ckpt)
        return chunk

    def _link_pending(self, req: Request, ckpt: Checkpoint) -> None:
        """Tell the pool what losing a checkpoint the tree does not hold yet would cost: the
        tokens back to the request's previous one (pending, or the one it resumed from). A
        long prefill hangs its checkpoints only at its end; until then, costed at their whole
        boundary, the pool would drop the shallowest first: a history's first anchor."""
        live = [c for b, c in req.pending_checkpoints if b < ckpt.boundary and c.tier != DROPPED]
        resumed = req.resume_checkpoint
        if resumed is not None and resumed.tier != DROPPED and resumed.boundary < ckpt.boundary:
            live.append(resumed)
        self.recurrence.checkpoints.link(ckpt, max(live, key=lambda c: c.boundary, default=None))

    def _admit(self, req: Request) -> None:
        """Reuse what the prefix cache holds of the request's tokens (all but the last one,
        whose logits must be computed). Hybrid models reuse only up to their deepest
        checkpoint there, whose state goes into a fresh state slot."""
        rec = self.recurrence
        req.resume_boundary, req.resume_checkpoint = 0, None
        if rec is not None:
            req.state_slot = rec.states.alloc()  # zeroed: a cold start unless restored below
        if not req.use_prefix_cache or (rec is not None and not rec.mode.reuses):
            return
        tokens = req.tokens[:-1]
        match = self.radix.match(tokens)
        nodes, partial, partial_tokens = match.nodes, match.partial, match.partial_tokens
        found = None
        if rec is not None:
            found = self.radix.deepest_checkpoint(tokens, match)
            if found is None:
                return
            full, partial_tokens = divmod(found.boundary, self.page_size)
            nodes, partial = nodes[:full], (found.node if partial_tokens else None)
        self.radix.lock(nodes)
        req.pages = [n.page for n in nodes]
        req.nodes = list(nodes)
        req.num_computed = len(nodes) * self.page_size
        if partial is not None:
            # The partial page is copied now, before anything can evict it (the copy is queued
            # on the device stream ahead of any later write to that page). The source stays
            # locked while a page is made free, so eviction cannot take it.
            self.radix.lock([partial])
            if self.allocator.n_free == 0:
                self._evict(1)
            self.radix.unlock([partial])
            if self.allocator.n_free == 0:
                if found is not None:  # the checkpoint needs that KV: start cold instead
                    self.radix.unlock(nodes)
                    req.pages, req.nodes, req.num_computed = [], [], 0
                return
            page = self.allocator.alloc(1)[0]
            self.pending_copies.append((partial.page, page, partial_tokens))
            req.pages.append(page)
            req.nodes.append(None)
            req.num_computed += partial_tokens
        if found is not None:
            rec.checkpoints.restore(found.checkpoint, rec.states, req.state_slot)
            req.resume_boundary = found.boundary  # counted if the admission goes through
            req.resume_checkpoint = found.checkpoint

    def take_copies(self) -> list[tuple[int, int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def grow_one(self, req: Request) -> bool:
        """Pages for the next token of a decoding request, evicting cached pages if needed
        but preempting no one (under overlap a step in flight holds the others): False when
        the pool is dry."""
        return self._grow(req, req.num_computed + 1)

    def _evict(self, n_pages: int) -> None:
        """Free n_pages of cached prefixes, and a batch of the coldest beside (EVICT_BATCH)."""
        self.radix.evict(max(n_pages, self.allocator.capacity // EVICT_BATCH))

    def _grow(self, req: Request, n_tokens: int) -> bool:
        """Give `req` pages for its first n_tokens, evicting cached pages if needed."""
        need = -(-n_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if self.allocator.n_free < need:
            self._evict(need - self.allocator.n_free)
        if self.allocator.n_free < need:
            return False
        req.pages.extend(self.allocator.alloc(need))
        req.nodes.extend([None] * need)
        return True

    def _reserve(self, req: Request, n: int, protect: list[ScheduledChunk]) -> bool:
        """Pages for n more tokens of a running request; preempt the newest others if the pool
        is exhausted. Returns False if `req` itself had to be preempted."""
        scheduled = {id(c.request) for c in protect}
        while not self._grow(req, req.num_computed + n):
            victims = [r for r in self.running if r is not req and id(r) not in scheduled]
            victim = victims[-1] if victims else req
            # No victim is not "alone": the others may all be scheduled in this step ahead of
            # it. Then it waits for them to finish and free their pages, which they will, so
            # only a request truly alone counts toward failing (counting the other case failed
            # requests that fit the engine on their own while two others decoded).
            alone = len(self.running) == 1
            if alone and req.num_computed <= req.preempted_at:
                req.fruitless_preemptions += 1  # and nothing computed since the last
            self._preempt(victim)
            if victim is req:  # no other victim
                if alone and req.fruitless_preemptions >= MAX_FRUITLESS_PREEMPTIONS:
                    self.waiting.remove(req)  # not readmitted: the engine fails it
                    self.unservable.append((req, (
                        f"the request cannot progress: alone in the engine, it was preempted "
                        f"{req.fruitless_preemptions + 1} times in a row at token "
                        f"{req.preempted_at} of {req.n_tokens}, its KV pages unable to grow "
                        f"({self.allocator.n_pages} in the pool); raise the GPU budget or "
                        f"shorten the request"
                    )))  # fmt: skip
                return False
        return True

    def take_unservable(self) -> list[tuple[Request, str]]:
        out, self.unservable = self.unservable, []
        return out

    def _preempt(self, req: Request) -> None:
        self.preemptions += 1
        if req.num_computed > req.preempted_at:  # it progressed since its last preemption
            req.fruitless_preemptions = 0
        req.preempted_at = req.num_computed
        self._checkpoint_progress(req)
        self._release(req, cache=True)
        self.running.remove(req)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _checkpoint_progress(self, req: Request) -> None:
        """A hybrid request keeps what it computed: its recurrent state is checkpointed where it
        stops, so readmission resumes there, not at its last anchor. (Resuming at the anchor
        re-prefilled whole chunks: on the CPU, a lone request under a budget cut was preempted
        at the same place each time, forever; a device turn after another program took memory
        stalled, most likely the same way.)"""
        rec, boundary = self.recurrence, req.num_computed
        if rec is None or not req.use_prefix_cache or not rec.mode.reuses:
            return
        if boundary == 0 or not req.state_slot:
            return
        self._save_checkpoint(req, boundary)  # none saved: it resumes from an older one

    # --- after the step -----------------------------------------------------------------
    def advance(self, chunk: ScheduledChunk) -> None:
        """The chunk's K/V (and its snapshots) are now in the cache."""
        req = chunk.request
        req.num_computed += len(chunk.token_ids)
        if self.recurrence is not None:
            for _, ckpt in chunk.snapshots:  # written: from now on it may spill or drop
                self.recurrence.checkpoints.unlock(ckpt)
        if not req.prefilling:
            return
        req.num_prefilled += len(chunk.token_ids)
        if chunk.sample:
            req.prefilling = False
            if req.use_prefix_cache:
                # The prompt is in the cache: share its full pages with requests arriving now.
                self._cache(req, full_pages_only=True)
                self._hang_checkpoints(req, final=False)

    def _cache(self, req: Request, full_pages_only: bool) -> None:
        """Offer the request's pages to the tree; where the tree already caches the same
        tokens, switch to its page and free our duplicate."""
        nodes = self.radix.insert(req.tokens[: req.num_computed], req.pages, req.nodes,
                                  full_pages_only)  # fmt: skip
        duplicates = [p for p, n in zip(req.pages, nodes, strict=True) if n and n.page != p]
        if duplicates:
            self.allocator.free(duplicates)
            req.pages = [n.page if n else p for p, n in zip(req.pages, nodes, strict=True)]
        req.nodes = nodes

    def checkpoint_decode(self, req: Request, token: int) -> None:
        """A decoding request just sampled `token`: take a checkpoint before it when the mode
        asks (the state now covers exactly the tokens before it)."""
        rec = self.recurrence
        if rec is None or req.status is not Status.RUNNING or not req.use_prefix_cache:
            return
        boundary = req.num_computed
        if boundary != req.n_tokens - 1 or not rec.mode.at_decode(
            boundary, token, req.anchor_tokens
        ):
            return
        self._save_checkpoint(req, boundary)

    def _save_checkpoint(self, req: Request, boundary: int) -> None:
        """Checkpoint the request's state slot (it covers tokens [0, boundary)) unless one is
        pending there; skipped when every device row is locked (never an error)."""
        if any(b == boundary for b, _ in req.pending_checkpoints):
            return
        rec = self.recurrence
        ckpt = rec.checkpoints.reserve(boundary)
        if ckpt is not None:
            rec.checkpoints.save(ckpt, rec.states, req.state_slot)  # queued on the stream
            rec.checkpoints.unlock(ckpt)
            req.pending_checkpoints.append((boundary, ckpt))
            self._link_pending(req, ckpt)

    def _hang_checkpoints(self, req: Request, final: bool) -> None:
        """Hang the request's checkpoints on the tree nodes holding their boundary's page;
        release those that cannot be (no such node, or one already there). Before `final`,
        checkpoints whose page is not cached yet wait for the release. Until hung, the pool
        may spill or drop them like any other (a dropped one is simply forgotten)."""
        rec = self.recurrence
        if rec is None or not req.pending_checkpoints:
            return
        tokens, keep = req.tokens, []
        for boundary, ckpt in req.pending_checkpoints:
            if ckpt.locks:  # not written yet (its step failed or never ran)
                keep.append((boundary, ckpt))
                continue
            if ckpt.tier == "dropped":
                continue
            if self.radix.attach_checkpoint(tokens, boundary, ckpt):
                continue
            if final or boundary > req.num_computed:
                rec.checkpoints.release(ckpt)
            else:
                keep.append((boundary, ckpt))
        req.pending_checkpoints = keep

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.FINISHED:
            return
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req, cache=req.use_prefix_cache and req.error is None)
        req.status = Status.FINISHED

    def _release(self, req: Request, cache: bool) -> None:
        """Return a request's pages: cached ones to the tree (unlocked), private ones freed;
        and its state slot and checkpoints (hung on the tree when cached)."""
        if cache:
            self._cache(req, full_pages_only=False)
        if self.recurrence is not None:
            if req.ahead_checkpoint is not None:  # its token was never accepted
                ahead = req.ahead_checkpoint[1]
                if ahead.tier != "dropped":  # (the pool may have dropped it for space)
                    self.recurrence.checkpoints.release(ahead)
                req.ahead_checkpoint = None
            if cache:
                self._hang_checkpoints(req, final=True)
            pool = self.recurrence.checkpoints
            for _, ckpt in req.pending_checkpoints:
                if ckpt.tier != "dropped":
                    while ckpt.locks:
                        pool.unlock(ckpt)
                    pool.release(ckpt)
            req.pending_checkpoints = []
            if req.state_slot:
                self.recurrence.states.free(req.state_slot)
                req.state_slot = 0
        self.radix.unlock([n for n in req.nodes if n is not None])
        private = [p for p, n in zip(req.pages, req.nodes, strict=True) if n is None]
        if self.pending_copies:  # an admission's partial-page copy into a page freed here
            # (the admission failed): applied later, it would write whatever the page holds
            # by then, a cached prefix once a budget cut has moved one there
            freed = set(private)
            self.pending_copies = [c for c in self.pending_copies if c[1] not in freed]
        self.allocator.free(private)
        req.pages, req.nodes = [], []
        req.num_computed = 0

    # --- invariants ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every page is exactly one of: free, held by the tree, private to a live request;
        tree reference counts equal the number of live requests locking each node."""
        self.allocator.check_integrity()
        self.radix.check_integrity()
        free = self.allocator.free_set()
        tree = set(self.radix.pages())
        private: list[int] = []
        refs: dict[int, int] = {}
        for req in [*self.running, *self.waiting]:
            assert len(req.pages) == len(req.nodes), f"request {req.id}: pages/nodes out of step"
            req.check_page_mirror()
            assert req.num_computed <= len(req.pages) * self.page_size
            for page, node in zip(req.pages, req.nodes, strict=True):
                if node is None:
                    private.append(page)
                else:
                    assert node.page == page, f"request {req.id} maps page {page} to another node"
                    refs[id(node)] = refs.get(id(node), 0) + 1
        assert len(private) == len(set(private)), "a private page is used by two requests"
        private_set = set(private)
        for src, dst, _ in self.pending_copies:  # (queued by this step's admissions)
            assert dst in private_set, f"a queued copy {src} -> {dst} writes no request's page"
        assert not (private_set & tree), "a private page is also held by the tree"
        assert not (private_set & free), "a private page is also free"
        assert len(free) + len(tree) + len(private_set) == self.allocator.capacity, (
            f"pages leaked: {self.allocator.capacity} usable, {len(free)} free + {len(tree)} "
            f"cached + {len(private_set)} private"
        )
        for node in self.radix._nodes():
            assert node.ref == refs.get(id(node), 0), (
                f"node of page {node.page} has ref {node.ref}, {refs.get(id(node), 0)} holders"
            )
        if self.recurrence is not None:
            slots = [r.state_slot for r in self.running]
            assert all(slots) and len(set(slots)) == len(slots), "state slots shared or missing"
            assert not any(r.state_slot for r in self.waiting), "a waiting request holds a slot"
            states = self.recurrence.states
            assert states.capacity - states.n_free == len(slots), "state slots leaked"
