"""What the engine needs from the GPU budget now: the `MemoryDemand` a safe point hands the
policy (engine/memory.py), measured from the scheduler, the prefix cache and the expert cache.

Pages: those running requests hold (their KV), the rest of their prompts and the lookahead of
their answers, the first waiting request's whole prompt less what the prefix cache already
holds for it, and the cache's unreferenced pages split into recently used and stale. Slots:
their count now, the fewest offloading runs with, the most worth having, and the cold tail's
hits per step (a profile of the whole LRU, refreshed every few steps). The walks behind these
(the radix tree, a waiting prompt's cached path, the LRU) are cached until what they read
changes, so a decode step that fills no page costs a few list lengths.
"""

from __future__ import annotations

from freetoken_agent.engine.arena import ElasticArena
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.memory import MemoryDemand
from freetoken_agent.engine.request import Status
from freetoken_agent.engine.scheduler import Scheduler

LOOKAHEAD_TOKENS = 256  # pages a running request is granted ahead of its next steps
RECENT_USES = 64  # cached pages touched in the last this-many radix uses count as recent
TAIL_WINDOW = 64  # steps over which the cache's cold tail is judged
TAIL_REFRESH = 8  # steps between two profiles of the cold tail
# While the device owns the expert cache, a profile may come from the host's mirror as the
# device last handed it back, up to this many steps old (ExpertCache.tail_profile): a fresher
# one costs a sync and a rebuild of the mirror.
TAIL_STALE_OWNED = 256


def pages_wanted(req, page_size: int) -> int:
    """The pages a running request holds or will need soon: the rest of its prompt (a
    prefilling request needs it over its next chunks, as a waiting one does: granting only the
    lookahead let a forced shrink take the pages of its next chunk) and the lookahead of its
    answer. Constant while it decodes within the last LOOKAHEAD_TOKENS of its answer (each step
    adds a token and takes one from what is left)."""
    answer_left = max(0, req.sampling.max_tokens - len(req.output_ids))
    want = -(-(req.n_tokens + min(answer_left, LOOKAHEAD_TOKENS)) // page_size)
    return max(len(req.pages), want)


class DemandMeter:
    def __init__(self, arena: ElasticArena, kv: KVPool, bank, scheduler: Scheduler) -> None:
        self.arena, self.kv, self.bank, self.scheduler = arena, kv, bank, scheduler
        self.cache = bank.cache
        self.steps = 0  # safe points seen (the tail profile's clock)
        self._cached_key, self._cached = -1, (0, 0)  # radix version, (recent, stale) pages
        self._reuse_key, self._reuse = None, (0, 0)  # (request, tokens, version), its reuse
        self._tail_step, self._tail, self._tail_slots = -(10**9), [0], -1  # tail_profile

    def measure(self, budget: int, fixed: int, steps: int) -> MemoryDemand:
        """The demand at safe point number `steps`, under `budget` with `fixed` bytes held
        outside the split."""
        self.steps = steps
        sched, s = self.scheduler, self.kv.page_size
        running = [r for r in sched.running if r.status is Status.RUNNING]
        # + the scratch page. One request's pages are distinct; several may share a prefix's
        # (a set of ~6k pages at 100k tokens cost every decode step ~0.1 ms).
        if len(running) == 1:
            held = 1 + len(running[0].pages)
        else:
            held = 1 + len({p for r in running for p in r.pages})
        growth = sum(pages_wanted(r, s) - len(r.pages) for r in running)
        waiting = least = reused = 0
        if sched.waiting:  # its whole prompt, and its first answer tokens, as for growth
            w = sched.waiting[0]
            waiting = -(-(w.n_tokens + min(w.sampling.max_tokens, LOOKAHEAD_TOKENS)) // s)
            least = -(-(w.n_tokens + 1) // s)  # its prompt and first token
            locked, reused = self._reusable_pages(w)
            waiting -= locked  # pages a running request holds: in pages_held already
            least -= locked
        recent, stale = self._cached_pages()
        # The unreferenced cached pages the waiting request will reuse are in pages_waiting:
        # not counted again as cached (counting them twice took half the slots at the start
        # of every agent turn on the device, and gave them back a few steps later).
        recent, stale = max(0, recent - reused), max(0, stale - max(0, reused - recent))
        return MemoryDemand(
            budget=budget,
            fixed=fixed,
            page_bytes=self.arena.kv_unit.nbytes,
            slot_bytes=self.arena.slot_unit.nbytes,
            pages_now=self.kv.allocator.n_pages,
            slots_now=self.cache.n_slots,
            pages_held=held,
            pages_growth=growth,
            pages_waiting=waiting,
            pages_waiting_least=least,
            cached_recent=recent,
            cached_stale=stale,
            min_slots=self.bank.min_slots,
            max_slots=min(self.bank.pool.n_rows, self.arena.max_slots),
            slot_tail_hits=self._tail_hits,
        )

    def _tail_hits(self, k: int) -> float:
        """The cache's `tail_hits(k, TAIL_WINDOW)` from a profile of the whole LRU taken at
        most every TAIL_REFRESH steps: the policy's bisection asks ~10 k's a step, each an O(k)
        walk of thousands of slots, which cost decode ~15% on the device. Hits over a 64-step
        window move little in 8 steps."""
        stale = self.steps - self._tail_step >= TAIL_REFRESH
        if stale or self._tail_slots != self.cache.n_slots:  # or the cache was resized
            self._tail = self.cache.tail_profile(TAIL_WINDOW, max_stale=TAIL_STALE_OWNED)
            self._tail_step, self._tail_slots = self.steps, self.cache.n_slots
        return float(self._tail[min(k, len(self._tail) - 1)]) / TAIL_WINDOW

    def reused_tokens(self, req) -> int:
        """Tokens of the first waiting request the prefix cache holds in full pages (what its
        admission reuses at most; 0 for the others, which the walk is not cached for)."""
        waiting = self.scheduler.waiting
        if not waiting or req is not waiting[0]:
            return 0
        return sum(self._reusable_pages(req)) * self.kv.page_size

    def _reusable_pages(self, req) -> tuple[int, int]:
        """Full pages of `req`'s tokens the prefix cache holds: (referenced by running
        requests, unreferenced). Redone when the tree or the first waiting request changed."""
        radix = self.scheduler.radix
        key = (id(req), req.n_tokens, radix.version)
        if self._reuse_key != key:
            path = radix.cached_pages_of(req.tokens)
            locked = sum(1 for n in path if n.ref > 0)
            self._reuse_key, self._reuse = key, (locked, len(path) - locked)
        return self._reuse

    def _cached_pages(self) -> tuple[int, int]:
        """(recent, stale) unreferenced pages of the prefix cache. A walk of the whole tree
        (milliseconds at 100k tokens), so it is redone only when the tree changed: decode
        steps that fill no page reuse the last count."""
        radix = self.scheduler.radix
        if self._cached_key != radix.version:
            clock, recent, stale = radix.clock, 0, 0
            for node in radix._nodes():
                if node.ref == 0:
                    if node.last_used > clock - RECENT_USES:
                        recent += 1
                    else:
                        stale += 1
            self._cached_key, self._cached = radix.version, (recent, stale)
        return self._cached
