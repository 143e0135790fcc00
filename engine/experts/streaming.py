"""Expert streaming for long prefill chunks: every absent expert of every layer crosses the link
once a chunk, double-buffered behind compute; resident experts are read in their slots.

A prefill chunk of a few thousand tokens routes to nearly every expert of every layer, so
instead of placing misses expert by expert, each layer computes in launches of the fused MoE
kernel: one over the experts resident in cache slots (their rows read in place, nothing copied),
then one per group of up to G absent experts, staged from the pool into a ring of B buffers of
G rows. The groups form one sequence over the chunk's layers, so with two buffers group j + 1
copies (on a dedicated copy stream) while group j computes, across a layer boundary too; a
buffer is overwritten only after the compute that read it has finished (an event per buffer).
`double_buffer=False` keeps one buffer (copy and compute then alternate) for the ablation.

The launches are parts of one fused MoE (kernels/moe_parts.py: the pairs sorted by expert once
a layer, each launch mapping its experts to its bank's rows); they sum in fp32 and only the last
rounds, so a streamed layer agrees with the all-resident one within fp32 rounding of the sum's
order.

Departure from DESIGN section 2 ("layer l+1 copies while layer l computes"): the double buffer
may hold groups of experts, not whole layers. Staging a whole layer needs B * E rows; lent from
a full cache, they evict B * E resident experts that the chunk then streams again: on the H100
host's peer slice (679 experts resident) 10.50 GB crossed where 8.09 GB were absent, and the
prefill reached 66% of the limit of the absent bytes (bench/results/prefill_warm_12_s58.json).
A ring of B * G rows costs at most B * G such experts (32 at G = 16).

Where the cache has slots to spare (`lend=True`), the ring is not memory of its own: the top
B * G slots of the cache are lent for the chunk (its coldest experts evicted if the free slots
do not cover it) and returned when the chunk's last layer is queued. Each chunk sizes its
groups (`chunk_group`, `widest_group`): the widest, up to a whole layer, whose lend evicts at
most RING_EVICTS of what the chunk streams anyway (a whole layer from an emptied cache; 16
experts from a full one), and never narrower than its tokens need (wider for longer chunks).
A ring of its own (a cache too small to lend one) holds B * STREAM_GROUP rows.
"""

from __future__ import annotations

import torch

from freetoken_agent.engine.device_index import on_device
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.kernels.moe_parts import MoeParts

# E experts per layer, G experts a group, B ring buffers (1 or 2), H hidden, I expert width,
# T tokens, K top-k

# (token, expert) pairs per fused-MoE launch of a streamed layer. A streamed layer waits on the
# link (a 12-layer Qwen3-30B slice streams 14.5 GB per chunk), so the kernel's chunking costs
# nothing, while its buffers are memory taken from the slots: on the H200, an 8192-token
# chunk's peak allocation fell from 0.81 to 0.39 GB going from 65536 to 16384 pairs, and the
# prefill took 278 and 279 ms (bench/results/workspace_12l_s12_chunks.json). All-resident
# prefill is compute-bound and keeps the kernel's default: there 16384 cost 17% at 8192 tokens.
STREAMED_MOE_PAIRS = 16384

# Experts a ring buffer holds, per STREAM_GROUP_TOKENS tokens of the chunk. A group's copy must
# outlast its launch's work (host and device), or the link waits, and that work grows with the
# chunk's tokens: on the H100 host, 8 layers from an empty cache streamed at 94-98% of the link
# with 16 experts a group up to 8192 tokens, but at 16384 tokens 16 took 0.32 s where 64 took
# 0.18 (the link's 0.18), the host's enqueue then as long as the device's
# (bench/results/stream_groups_s59.json). A bigger group costs a full cache more evictions
# (B * G a chunk); fewer groups, fewer launches (E / G + 1 a layer at most).
STREAM_GROUP = 16
STREAM_GROUP_TOKENS = 4096


def ring_slots(n_experts: int, n_buffers: int) -> int:
    """Rows of the smallest staging ring, the one a budget must hold: B buffers of
    STREAM_GROUP experts (at most a layer's E)."""
    return n_buffers * min(STREAM_GROUP, n_experts)


# A lent ring evicts its size's coldest experts from a full cache, and the chunk streams those
# again. The fewer groups a layer, the fewer launches: on the H100 host the 48-layer 8k prefill
# from an empty cache ran at 95.8% of the link staging whole layers (session 58), 78.8% in
# groups of 32 (session 59). A lent ring takes the widest groups, up to a whole layer, whose
# evictions stay within this share of the experts the chunk streams anyway.
RING_EVICTS = 0.05


def widest_group(least: int, n_experts: int, n_buffers: int, most_rows: int, resident: int,
                 n_slots: int, n_rows: int) -> int:  # fmt: skip
    """Experts a lent ring's buffer holds: at least `least` (`chunk_group`), at most a layer's
    E and what `most_rows` rows hold; wider while the lend (B * G slots of `n_slots`, with
    `resident` experts of `n_rows` in them) evicts at most RING_EVICTS of the absent ones."""
    allowed = RING_EVICTS * (n_rows - resident)
    widest = int((n_slots - resident + allowed) // n_buffers)  # evicts <= allowed
    return max(least, min(widest, n_experts, most_rows // n_buffers))


def chunk_group(tokens: int, n_experts: int, n_buffers: int, most_rows: int) -> int:
    """Experts a ring buffer holds for a chunk of `tokens` tokens: STREAM_GROUP per
    STREAM_GROUP_TOKENS tokens, at most a layer's E, and at most what `most_rows` ring rows
    hold (never below STREAM_GROUP, which `ring_slots` budgets for)."""
    want = STREAM_GROUP * max(1, -(-tokens // STREAM_GROUP_TOKENS))
    floor = min(STREAM_GROUP, n_experts)
    return max(floor, min(want, n_experts, most_rows // n_buffers))


class LayerStreamer:
    def __init__(
        self,
        pool: ExpertPool,
        cache: ExpertCache,
        n_experts: int,
        n_layers: int,
        device: torch.device,
        double_buffer: bool = True,
        lend: bool = False,
    ) -> None:
        self.pool, self.cache = pool, cache
        self.lend = lend
        self.n_experts, self.n_layers = n_experts, n_layers
        self.device = device
        self.n_buffers = 2 if double_buffer else 1
        self.group = min(STREAM_GROUP, n_experts)  # this chunk's (`chunk_group`)
        rows, dtype = ring_slots(n_experts, self.n_buffers), pool.w13.dtype
        if lend:  # views into the cache's slots while a chunk streams; none in between
            self.w13 = self.w2 = None
        else:
            self.w13 = torch.empty((rows, *pool.w13.shape[1:]), dtype=dtype, device=device)
            self.w2 = torch.empty((rows, *pool.w2.shape[1:]), dtype=dtype, device=device)
        # The chunk being streamed (`_begin` .. `release`): its groups in streaming order,
        # (layer, absent experts), and each layer's first group there; its launches, layer
        # after layer (a group's seq, or None: the resident experts' part), each layer's first
        # launch there, and their expert -> bank row maps on the device.
        self.active = False
        self._order: list[tuple[int, list[int]]] = []
        self._first: list[int] = []
        self._launches: list[int | None] = []
        self._launch_at: list[int] = []
        self._maps: torch.Tensor | None = None  # [launches, E] int32
        self._issued = 0  # groups whose copies are queued
        self._computed = 0  # groups whose compute is queued
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        b = self.n_buffers
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(b)]
        self.consumed = [torch.cuda.Event() if cuda else None for _ in range(b)]
        self.bytes_h2d = 0
        self.layers_streamed = 0
        # Experts resident when the last chunk was planned: what it read in place (a bench's
        # limit of the bytes not resident at the chunk's start).
        self.resident_at_plan = 0

    @property
    def ring_rows(self) -> int:
        return self.n_buffers * self.group

    @property
    def nbytes(self) -> int:
        """Device bytes of its own (none when it borrows cache slots)."""
        return 0 if self.lend else self.w13.nbytes + self.w2.nbytes

    @property
    def borrowing(self) -> bool:
        return self.lend and self.w13 is not None

    def release(self) -> None:
        """End the chunk: borrowed slots go back to the cache (the chunk's compute is queued,
        and whoever fills those slots next orders its copies after queued compute). A chunk
        that failed midway may have left copies issued ahead that no compute waited for: the
        compute stream waits for them here, so the fills and moves ordered after it cannot be
        overwritten by a late copy into a slot given back."""
        if not self.active and not self.borrowing:  # every eager layer call: nothing to end
            return
        if self.active and self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self.active = False
        self._order, self._first = [], []
        self._launches, self._launch_at, self._maps = [], [], None
        self._issued = self._computed = 0
        if self.borrowing:
            self.w13 = self.w2 = None
            self.cache.take_back()

    def _begin(self, layer: int, tokens: int) -> None:
        """A chunk's first layer: borrow the ring (if lent) and plan every layer's groups from
        the cache as it stands; nothing fills or evicts while the chunk streams. A chunk that
        failed midway is ended first: the next one must not read its ring's half-done state."""
        self.release()
        # The ring: lent, as big as leaves a layer's slots in service (`lends_staging`);
        # else its own rows.
        room = self.cache.n_slots - self.n_experts if self.lend else self.w13.shape[0]
        self.group = chunk_group(tokens, self.n_experts, self.n_buffers, room)
        if self.lend:
            c = self.cache
            self.group = widest_group(self.group, self.n_experts, self.n_buffers, room,
                                      c.n_resident, c.n_slots, self.pool.n_rows)  # fmt: skip
            self.w13, self.w2 = self.cache.lend(self.ring_rows)  # [BG, 2I, H], [BG, H, I]
        self.cache.inflight.settle()  # direct's late fills: the table as the mirror has it
        self._plan()
        if self.copy_stream is not None:  # the lend's moves, and queued compute, read first
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._issued = self._computed = self._first[layer]  # (0: chunks start at layer 0)
        self.active = True

    def _plan(self) -> None:
        """Every layer's groups and launches from the cache's table (fixed while the chunk
        streams), and the launches' row maps put on the device in one copy now. A map copied
        at each layer would queue on the compute stream behind the copy engine's backlog of
        expert copies (host-to-device copies share the engine whatever their stream): on the
        H100 host the peer slice's warm prefill left the compute stream idle ~6 ms a layer
        waiting for a 2.5 KB map (bench/results/prefill_timeline_12l_s60.json)."""
        slot_of, e, g, b = self.cache.host_slot_of, self.n_experts, self.group, self.n_buffers
        self._order, self._first, self._launches, self._launch_at = [], [], [], []
        rows_all: list[int] = []  # [launches * E]
        self.resident_at_plan = 0
        for planned in range(self.n_layers):
            slots = slot_of[planned * e : (planned + 1) * e]  # -1 where absent
            absent = [x for x in range(e) if slots[x] < 0]
            self.resident_at_plan += e - len(absent)
            self._first.append(len(self._order))
            self._launch_at.append(len(self._launches))
            if len(absent) < e:  # the resident experts' part: their slots in the cache bank
                self._launches.append(None)
                rows_all += slots
            for i in range(0, len(absent), g):
                seq = len(self._order)
                self._order.append((planned, absent[i : i + g]))
                rows, lo = [-1] * e, (seq % b) * g
                for j, x in enumerate(absent[i : i + g]):
                    rows[x] = lo + j
                self._launches.append(seq)
                rows_all += rows
        self._first.append(len(self._order))  # [L + 1]: layer l's groups are first[l]..first[l+1]
        self._launch_at.append(len(self._launches))
        self._maps = on_device(rows_all, torch.int32, self.device).view(-1, e)

    def moe(
        self,
        layer: int,
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] expert ids within the layer
        topk_weights: torch.Tensor,  # [T, K] fp32
    ) -> torch.Tensor:
        """The layer's MoE output [T, H]: resident experts from their slots, the absent ones
        group by group from the ring, the next groups copying behind."""
        if layer == 0 or not self.active:
            self._begin(layer, hidden.shape[0])
        self._issue_ahead()  # before the pairs' sort below: the link starts that much sooner
        # The layer's launches: the resident experts' part (seq None), then its groups.
        lo, hi = self._launch_at[layer], self._launch_at[layer + 1]
        width = self.pool.w2.shape[2]
        parts = MoeParts(hidden, topk_ids, topk_weights, self.n_experts, width, STREAMED_MOE_PAIRS)
        stream = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        for n in range(lo, hi):
            seq = self._launches[n]
            if seq is None:
                w13, w2 = self.cache.w13, self.cache.w2
            else:
                w13, w2, buf = self.w13, self.w2, seq % self.n_buffers
                if stream is not None:
                    stream.wait_event(self.copied[buf])
            parts.add(w13, w2, self._maps[n], last=n == hi - 1)
            if seq is not None:
                if stream is not None:
                    self.consumed[buf].record(stream)
                self._computed += 1
                self._issue_ahead()  # its buffer's next group copies now, across layers too
        self.layers_streamed += 1
        if layer == self.n_layers - 1:
            self.release()
        return parts.out

    def _issue_ahead(self) -> None:
        """Queue the copies of the groups the ring has room for: group s reuses the buffer of
        group s - B, whose compute must be queued (its event recorded) first."""
        while self._issued < len(self._order) and self._issued < self._computed + self.n_buffers:
            self._issue(self._issued)
            self._issued += 1

    def _issue(self, seq: int) -> None:
        buf = seq % self.n_buffers
        if self.copy_stream is None:
            self._copy_group(seq, buf)
            return
        self.copy_stream.wait_event(self.consumed[buf])
        with torch.cuda.stream(self.copy_stream):
            self._copy_group(seq, buf)
            self.copied[buf].record(self.copy_stream)

    def _copy_group(self, seq: int, buf: int) -> None:
        """The group's experts from the pool into its ring buffer, in as few host copies as
        the pool's registrations allow."""
        layer, experts = self._order[seq]
        lids = [layer * self.n_experts + x for x in experts]
        lo, pinned = buf * self.group, self.pool.pinned
        for i0, i1 in lid_runs(lids, self.pool.pin_rows):
            src, dst = slice(lids[i0], lids[i0] + i1 - i0), slice(lo + i0, lo + i1)
            self.w13[dst].copy_(self.pool.w13[src], non_blocking=pinned)
            self.w2[dst].copy_(self.pool.w2[src], non_blocking=pinned)
        self.bytes_h2d += len(lids) * self.pool.expert_bytes


def lid_runs(lids: list[int], pin_rows: int) -> list[tuple[int, int]]:
    """Maximal runs [i0, i1) of `lids` (ascending) that are consecutive pool rows inside one
    page-locked registration of `pin_rows` rows: one host copy must stay inside one
    registration (a copy spanning two fails with "invalid argument")."""
    runs, i, n = [], 0, len(lids)
    while i < n:
        j = i + 1
        while j < n and lids[j] == lids[j - 1] + 1 and lids[j] % pin_rows != 0:
            j += 1
        runs.append((i, j))
        i = j
    return runs
