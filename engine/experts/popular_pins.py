"""Popularity pins for the device path's cache (EngineConfig.popular_pins, 0.8 by default).

Why: the device path evicts the least recently used slot (kernels/reference_fills.py). Under
skewed routing with temporal locality (the Zipf traces; trained routers are skewed too) LRU
keeps every recent expert and so lets popular ones go, which then miss again. Every
`REPIN_EVERY` decode steps this pins, in each MoE layer, the resident experts used most
(counted by the fill plans in `uses`, halved every `HALF_LIFE` steps so the counts follow
drifting routing): a pinned slot's stamp is PINNED, which no plan takes as a victim; the
other slots stay LRU. A slot pinned before and no longer among the most used gets the
clock, as if just used. Replayed on the synthetic traces (`bench cache-policies`, 48 layers,
2686 slots), pinning 0.8 of the slots cuts LRU's misses by 18-19% (Zipf 1.0 / locality 0.7:
0.0788 -> 0.0642; Zipf 0.8 / 0.5: 0.1734 -> 0.1412) and leaves uniform routing as it was
(0.5915 -> 0.5778); the oracle that pins the trace's true favourites reaches 0.0579. On the
H200 host (48 layers / 32 GB, Zipf 1.0 / 0.7) 0.8 took the misses from 0.070 to 0.063 a pair
and gpu-fill from 113.8 to 118.2 tok/s at b=1, 159.1 to 176.6 at b=4; native routing as before.

Pins never change results, only which slots hold which experts. They live in the device's
stamps while the device owns the cache: `DeviceFills.own` rebuilds the stamps from the
host's LRU (dropping them), and `release` hands the pinned slots back as the most recent.
Slots pinned for other reasons (kept layers, slots out of service) are never touched, and
count for none of the fraction. All of it runs as tensor ops on the compute stream between
steps: no host sync. A hand-back drops the pins (`own` rebuilds the stamps from the host's
LRU); the first owned step after it chooses them again from the counts, which survive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from freetoken_agent.kernels.reference_fills import CLOCK, PINNED

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.device_fills import DeviceFills

# S slots, N = L * E lids

REPIN_EVERY = 64  # decode steps between two choices of the pinned set
HALF_LIFE = 512  # decode steps between two halvings of the use counts


class PopularPins:
    def __init__(
        self, fills: DeviceFills, lids_per_layer: int, fraction: float, every: int = REPIN_EVERY
    ) -> None:
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"popular_pins must be a fraction of the slots in (0, 1): {fraction}")
        self.fills = fills
        self.lids_per_layer = lids_per_layer
        self.fraction = fraction
        self.every = every
        n_lids = fills.cache.pool.n_rows
        self.n_layers = n_lids // lids_per_layer
        self.uses = torch.zeros(n_lids, dtype=torch.int32, device=fills.cache.device)  # [N]
        self.steps = 0  # decode steps the device owned the cache
        self.choices = 0  # times `repin` chose the pins (the benchmark reports it)
        self._handed_back = fills.releases  # hand-backs seen: `own` after one drops the pins

    def reset(self) -> None:
        """Forget the counts (the benchmark, between measurements from an empty cache)."""
        self.uses.zero_()
        self.steps = 0
        self.choices = 0

    def after_step(self) -> None:
        """A step ended: count it if the device path ran it (it owns the cache), halve the
        counts every HALF_LIFE such steps and choose the pins every `every`."""
        if not self.fills.owned:
            return
        self.steps += 1
        if self.steps % HALF_LIFE == 0:
            self.uses.bitwise_right_shift_(1)
        # Again after a hand-back too (a prefill, adaptive's stops, the memory manager's look
        # at the cache): `own` rebuilt the stamps without the pins, and the counts survived.
        if self.steps % self.every == 0 or self.fills.releases != self._handed_back:
            self._handed_back = self.fills.releases
            self.repin()

    def per_layer(self) -> torch.Tensor:
        """Pins a layer gets (a 0-d tensor: reading it would sync): the fraction of the slots
        the plans may use, shared evenly; slots pinned for other reasons (kept layers, lent
        or out of service) count for none, so the LRU keeps its share beside them."""
        f = self.fills
        usable = ((f.stamp != PINNED) | f.popular).sum()
        return (usable * self.fraction).floor().long() // self.n_layers

    def repin(self) -> torch.Tensor:
        """Pin each layer's `per_layer()` most used resident experts (ties: the lower slot),
        unpin the rest of the earlier pins. Returns the new pins [S] bool. Tensor ops only,
        no host sync (bincount would read its input's bounds back: searchsorted instead)."""
        f = self.fills
        self.choices += 1
        lid = f.lid_of.long()  # [S]
        ours = f.popular  # [S] bool: the pins this chose last time
        movable = (lid >= 0) & (f.stamp >= 0) & ((f.stamp != PINNED) | ours)
        score = torch.where(movable, self.uses[lid.clamp(min=0)].long(), -1)  # [S]
        layer = torch.where(movable, lid.clamp(min=0) // self.lids_per_layer, self.n_layers)
        order = torch.argsort(layer * (1 << 40) - score, stable=True)  # by layer, most used first
        in_order = layer[order]
        layers = torch.arange(self.n_layers + 1, device=lid.device)
        starts = torch.searchsorted(in_order, layers)  # [L + 1] each layer's first position
        rank = torch.arange(order.numel(), device=order.device) - starts[in_order]
        chosen = torch.zeros_like(ours)
        keep = (rank < self.per_layer()) & (in_order < self.n_layers) & (score[order] > 0)
        chosen[order] = keep
        clock = f.state[CLOCK]
        pinned = torch.full_like(f.stamp, PINNED)
        f.stamp.copy_(torch.where(chosen, pinned, torch.where(ours, clock, f.stamp)))
        ours.copy_(chosen)
        return chosen
