"""Where one MoE layer's misses go, decided on the host: the offloaded bank's placement.

The eager path (offload.py) and decode under segmented graphs (`GraphDecode.resolve`) hand a
layer's misses here, through the bank's `_place`: the policy's share is filled into slots
(`_fetches`: every miss under direct and gpu-fill, adaptive's choice, static's kept layers,
transfer's q*), some of those behind the layer's compute (adaptive with
EngineConfig.fill_behind: the CPU computes them this time), and the rest runs on the CPU while
the copies cross the link. `static` keeps its layout of whole layers here (`place_static`).

The bank keeps the state (its policy, cache, adaptive fetches, bandwidths and counters, which
the benchmarks and tests may swap in place, so each is read from it at use); this class is its
placement half, as DevicePath is its device-path half.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.experts import layer_layout
from freetoken_agent.engine.experts.cpu_branch import observe_fills, run_on_cpu
from freetoken_agent.engine.experts.fill_races import RACE_MAX_TOKENS
from freetoken_agent.engine.experts.policy import WHOLE_STEP_POLICIES, fetch_count

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.offload import OffloadedExpertBank

# T tokens, K top-k, H hidden


class MissPlacement:
    def __init__(self, bank: OffloadedExpertBank) -> None:
        self.bank = bank
        self._placed_after = -1  # static: cache.vacates when its layers were last made whole

    def place_static(self, protect: frozenset[int] | set[int] = frozenset()) -> None:
        """`static`: the last layers whole, as many as the slots in service hold, as llama.cpp's
        `--n-cpu-moe` keeps the first layers' experts on the CPU; every other layer's misses run
        on the CPU. The layers follow the slots: a prefill chunk's staging borrows slots (its
        lend evicts the coldest experts, kept ones too) and the elastic split moves their
        count, so each call with misses (`_fetches`) places again and fetches the kept layers'
        missing experts back (victims from other layers, never in `protect`). Pinning the
        layers once at load had to leave the staging's slots (two layers' worth) out of them
        for good: at 8.59 GB on the peer slice, 2 whole layers where 4 fit while decoding."""
        cache = self.bank.cache
        n_layers = self.bank.spec.n_moe_layers
        n = min(layer_layout.whole_layers(cache), n_layers)
        layers = frozenset(range(n_layers - n, n_layers))
        if layers != cache.kept_layers or cache.vacates != self._placed_after:
            cache.kept_layers = layers
            layer_layout.complete(cache, layers, set(protect))
            self._placed_after = cache.vacates  # a later lend or shrink may evict kept ones

    def place(
        self,
        misses: list[tuple[int, int]],
        uniq: list[int],
        cpu_inputs,
        n_tokens: int,
        after_compute: bool = True,
        into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Place the misses: the policy's share is filled into slots (the layer's own experts
        are never evicted for them), the rest runs on the CPU while the copies cross the link.
        `cpu_inputs()` returns (hidden [T, H], lids [T, K], weights [T, K]) on the host;
        `n_tokens` is T (only decode-sized calls start fill races: fill_races.py).
        Returns (the CPU's partial sum [T, H] on the host, in `into` when given, or None; the
        lids filled); the caller publishes the filled slots (`cache.publish`) once it no longer
        needs to overlap them."""
        if not misses:
            return None, []
        bank = self.bank
        # The copies are asynchronous: issued first, they cross the link while the CPU works.
        # Not from a second thread: torch ops hold the GIL, and handing it back and forth
        # with the thread driving the kernel cost milliseconds a step on the H200 host.
        protect = set(uniq)  # the layer's own experts: never victims of its fills
        want = self._fetches(misses, protect, n_tokens)
        race = n_tokens <= RACE_MAX_TOKENS  # decode's fills measure whether fills pay
        behind: list[int] = []  # filled behind the layer's compute (EngineConfig.fill_behind)
        if bank.fill_behind and race and bank.policy == "adaptive":
            n = bank.adaptive.behind([count for count, _ in misses[: len(want)]], bank.bandwidths)
            want, behind = want[: len(want) - n], want[len(want) - n :]
        # A prefill chunk's fills take their victims from the layers it has passed first
        # (victims.py): the LRU's oldest are the layers it is about to use. Not static's:
        # its kept layers are the layout it is measured by, and only they fill.
        prefill = not race and bank.policy != "static"
        ahead = (uniq[0] // bank.n_experts + 1) * bank.n_experts if prefill else None
        fetched = bank.cache.fill(
            want, protect, after_compute=after_compute, publish=False, race=race, ahead_from=ahead
        )
        try:
            return self._place_rest(misses, uniq, cpu_inputs, race, protect, behind, fetched, into)
        except BaseException:
            # The host maps hold the fills already: left unpublished, the device table would
            # disagree with them for every later step (a lid counted resident that the kernels
            # skip, an evicted one read from its new tenant's weights): wrong tokens for other
            # requests, where a failed step must fail only its own.
            bank.cache.publish(fetched)
            raise

    def _place_rest(
        self,
        misses: list[tuple[int, int]],
        uniq: list[int],
        cpu_inputs,
        race: bool,
        protect: set[int],
        behind: list[int],
        fetched: list[int],
        into: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, list[int]]:
        """`place` once the fills are issued: the fills behind, then the CPU's share."""
        bank = self.bank
        bank.stats.fetched += len(fetched)
        # The finished fills' timings into B_P once this stop's copies are on their way: at a
        # decode stop the device waits from the routing's arrival to the first copy (on the
        # H200 host 83-127 us of host work a stop, `bench profile-offload`'s stop clock), and
        # the event queries here need not be part of it; the estimate lags by one stop.
        observe_fills(bank.cache, bank.bandwidths)
        # The policy's rest, and any fill that found every slot protected.
        on_cpu = [lid for _, lid in misses if not bank.cache.resident(lid)]
        if behind:
            # The layer waits only for `fetched`: published now (the caller gets none to
            # publish), before the fills behind queue on the copy stream (publishing makes
            # compute wait for what is queued there). Those start before the CPU's work, so
            # the link moves them meanwhile; their table entries wait for the copies
            # (cache.inflight), and the CPU computes them this time.
            bank.cache.publish(fetched)
            fetched = []
            started = bank.cache.inflight.start(behind, protect)
            bank.stats.behind += len(started)
            bank.stats.fetched += len(started)
        cuda = bank.device.type == "cuda"
        part = None
        if on_cpu:
            part = run_on_cpu(bank.pool, bank.bandwidths, *cpu_inputs(), on_cpu, timed=cuda,
                              into=into, source="decode" if race else "prompt")  # fmt: skip
        bank.stats.on_cpu += len(on_cpu)
        return part, fetched

    def _fetches(
        self, misses: list[tuple[int, int]], protect: set[int], n_tokens: int
    ) -> list[int]:
        """Which misses the policy fills into slots, in order (direct: a chunk too long for
        the kernels' host reads fills them all, as transfer does)."""
        bank, lids = self.bank, [lid for _, lid in misses]
        if bank.policy in WHOLE_STEP_POLICIES:
            return lids
        if bank.policy == "adaptive":
            tokens = [c for c, _ in misses]
            return bank.adaptive.choose(lids, tokens, protect, bank.bandwidths, n_tokens)
        if bank.policy == "static":
            self.place_static(protect)
            return lids if bank.cache.kept(lids[0]) else []  # one layer's misses
        return lids[: fetch_count(bank.policy, len(lids), bank.bandwidths)]
