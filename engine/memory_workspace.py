"""The step workspace under elastic memory: what a prefill chunk needs is lent to expert slots
while only decodes run.

The workspace (placement.workspace_bytes) is what torch's allocator takes during one step. Its
per-token term and the fused MoE's per-pair buffers grow with the step's tokens: sized for a
full `max_batched_tokens` chunk it is ~1 GB at the Qwen3-30B shape (8192 tokens), of which a
decode step of a few tokens uses ~0.27 GB. At the 8 GiB laptop tier the difference is ~70
expert slots (5% of the peer slice's experts), idle for a whole answer; near-uniform routing
missed 8% fewer experts with them on the device (bench/results/NOTES.md, sixty-first session).

So the MemoryManager counts only the workspace the next step can need (`StepWorkspace.wanted`:
the running requests' next tokens and the waiting prompts' uncached ones, rounded up to a power
of two, at most a full step) and the policy gives the rest to slots, never to KV pages (which
hold requests: a prompt's workspace could not take them back without preempting). When a prompt
arrives the count rises at the next safe point, before the prompt is scheduled: a forced move,
which evicts the coldest slots first. The scheduler's step is capped at the tokens the bytes
outside the split cover (`covered`), so a step's activations stay within the budget even where
a split could not be carried out (the chunk is shorter). When the count falls again, torch's
allocator still caches the chunk's blocks: the manager returns them to the driver before the
slots grow into their bytes (memory_manager.py), so the engine never holds more than its
budget.

A departure from DESIGN section 5, which keeps the workspace fixed beside the split: it is fixed
still as a ceiling (the floor, the largest budget, what the budget at load was sized with), and
lent only downward.
"""

from __future__ import annotations

from freetoken_agent.engine.config import EngineConfig, ModelSpec
from freetoken_agent.engine.experts.placement import workspace_bytes
from freetoken_agent.engine.request import Status


class StepWorkspace:
    def __init__(self, spec: ModelSpec, config: EngineConfig) -> None:
        self.spec, self.config = spec, config
        # The scheduler's step: at least one token per sequence (scheduler.py), at most a full
        # step; a decode step of every sequence is the least the count may fall to.
        self.least = config.max_num_seqs
        self.most = max(config.max_batched_tokens, config.max_num_seqs)
        self.full = self.bytes_for(self.most)
        self._covered: dict[int, int] = {}  # room -> tokens (the room takes few values)

    def bytes_for(self, tokens: int) -> int:
        """The workspace of a step of `tokens` tokens (an offloaded bank's: the arena is one)."""
        return workspace_bytes(self.spec, self.config, offloaded=True, tokens=tokens)

    def rounded(self, tokens: int) -> int:
        """`tokens` rounded up to a power of two within [least, most]: the count moves in few
        steps (each a decision of the split), not with every prompt's length."""
        t = max(self.least, min(tokens, self.most))
        return min(self.most, max(self.least, 1 << (t - 1).bit_length()))

    def wanted(self, scheduler, reused_tokens) -> int:
        """Tokens the next step may take: every running request's tokens not yet computed (a
        decode's one, the rest of a prompt) and every waiting prompt's, less what the prefix
        cache holds of it (`reused_tokens(request)`), rounded (`rounded`). An estimate of the
        reuse above the truth only shortens the first chunk (the step cap), never overruns."""
        n = 0
        for r in scheduler.running:
            if r.status is Status.RUNNING:
                n += max(1, r.n_tokens - r.num_computed)
        for w in scheduler.waiting:
            if n >= self.most:
                break
            n += max(1, w.n_tokens - reused_tokens(w))
        return self.rounded(n)

    def covered(self, room: int) -> int:
        """The most tokens a step may take with `room` bytes for its workspace: the largest
        count within [least, most] whose workspace fits, `least` when none does (decodes run
        whatever the split: the floor covers them)."""
        if room in self._covered:
            return self._covered[room]
        if self.bytes_for(self.most) <= room:
            n = self.most
        else:  # bytes_for grows with tokens: bisect for the last count that fits
            lo, hi = self.least, self.most
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.bytes_for(mid) <= room:
                    lo = mid
                else:
                    hi = mid - 1
            n = lo
        if len(self._covered) > 4096:
            self._covered.clear()
        self._covered[room] = n
        return n
