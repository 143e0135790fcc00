"""Do cache fills pay? Each fill races its victim over one visit of each one's layer.

A visit is one MoE layer's routing in one step (`ExpertCache.touch`); a lid's layer is
`lid // lids_per_layer`. A race is settled when both sides' layers have been visited once after
the fill: +1 when the filled expert is asked for (and still resident) and the victim is not,
-1 the other way round (a miss the fill caused), 0 for both or neither. A fill into a free slot
has no victim (its side counts 0). `gain` is the running mean of the outcomes: about 0 under
near-uniform routing (each has the same chance at its one visit), positive with temporal
locality, negative when the steps' working set exceeds the cache (fills are evicted before
their layer comes round again). Policy adaptive reads it to decide whether fills are worth
their bytes (engine/experts/policy.py).

The mean is an exponential moving average corrected for its start at 0, as Adam corrects its
moments: divided by the weight the outcomes so far carry, 1 - (1 - OUTCOME_EMA)^n. Uncorrected,
it needed ~16 straight wins to pass FETCH_ALL_GAIN (0.15). Where misses are rare (native routing
on the H200 peer slice: ~0.4 fills a token) that took hundreds of tokens, and adaptive spent
them running misses on the CPU, which then missed again: 469 tok/s against transfer's 635
(fourteenth session), 392 against 601 (fifteenth); corrected, 602 against 560 in the same
session's last table. Under near-uniform routing races are many
(~55 fills a token at 12 layers), so an early corrected mean's noise lasts a step or two.
"""

from __future__ import annotations

OUTCOME_EMA = 0.01  # weight of the newest race outcome in `gain`
# Only fills of calls of at most this many tokens race (decode batches). A prefill chunk too
# short to stream (a prompt or tool output of tens to hundreds of tokens) fills most of every
# layer at once; decode then asks for 8 of those experts, so its hundreds of races settle at 0
# or -1 on the first decode step and pulled the gain from ~0.6 to ~0 after every prompt
# (simulated on the bench's Zipf 1.0 / locality 0.7 trace, 12 layers, 458 slots). That step
# then split its misses with the CPU, which locality punishes: on the peer slice at one token
# adaptive ran 0.6-1.5 experts a token on the CPU and trailed transfer by 6-9%.
RACE_MAX_TOKENS = 16
# Races settled before `gain` reads other than 0: one or two early outcomes alone would set it
# to +-1 (and the verdict's hysteresis would then hold a fetch-all for a while).
MIN_RACES = 16


class FillRaces:
    def __init__(self, lids_per_layer: int) -> None:
        self.lids_per_layer = lids_per_layer
        # layer -> races awaiting that layer's next visit; a race is
        # [filled lid, victim lid or -1, filled's result, victim's result], -1 until settled.
        self.pending: dict[int, list[list[int]]] = {}
        self._mean = 0.0  # the moving average, from 0
        self._weight = 0.0  # the weight its outcomes carry: 1 - (1 - OUTCOME_EMA)^settled
        self.settled = 0

    @property
    def gain(self) -> float:
        """The running mean of the settled races' outcomes, in [-1, 1]; 0 before MIN_RACES."""
        return self._mean / self._weight if self.settled >= MIN_RACES else 0.0

    @gain.setter
    def gain(self, gain: float) -> None:
        """Pin the mean as if many races had settled at `gain` (tests, a restored cache)."""
        self._mean, self._weight, self.settled = gain, 1.0, max(self.settled, MIN_RACES)

    def start(self, filled: int, victim: int) -> None:
        """A fill of `filled` into the slot `victim` held (-1: a free slot)."""
        race = [filled, victim, -1, -1 if victim >= 0 else 0]
        per = self.lids_per_layer
        self.pending.setdefault(filled // per, []).append(race)
        if victim >= 0 and victim // per != filled // per:
            self.pending.setdefault(victim // per, []).append(race)

    def visit(self, layer: int, lids: list[int], slot_of: list[int]) -> None:
        """`layer` asked for `lids` (its distinct lids) with the host table `slot_of` as it is
        before this visit's fills: the filled side wins when asked for and still resident, the
        victim's when asked for and absent."""
        races = self.pending.pop(layer, None)
        if not races:
            return
        asked, per = set(lids), self.lids_per_layer
        for race in races:
            filled, victim = race[0], race[1]
            if filled // per == layer and race[2] < 0:
                race[2] = int(filled in asked and slot_of[filled] >= 0)
            if victim // per == layer and race[3] < 0:
                race[3] = int(victim in asked and slot_of[victim] < 0)
            if race[2] >= 0 and race[3] >= 0:
                self._mean += OUTCOME_EMA * (race[2] - race[3] - self._mean)
                self._weight += OUTCOME_EMA * (1.0 - self._weight)
                self.settled += 1

    def drop(self, filled: set[int]) -> None:
        """Forget the races of fills evicted by something other than a fill (a resize): their
        outcome says nothing about fills."""
        if not filled:
            return
        for layer in list(self.pending):
            races = [r for r in self.pending[layer] if r[0] not in filled]
            if races:
                self.pending[layer] = races
            else:
                del self.pending[layer]

    def drop_pending(self) -> None:
        """Forget the races not yet settled; the mean stays (a hand-back from the device
        path: adaptive's verdict must outlive it)."""
        self.pending.clear()

    def clear(self) -> None:
        self.pending.clear()
        self._mean = self._weight = 0.0
        self.settled = 0
