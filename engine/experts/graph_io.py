"""The buffers through which captured decode graphs and the offloaded bank's host decisions meet.

A decode graph cannot stop to ask the host which experts are missing, so it is captured in
segments that end after each MoE layer's router (engine/segmented_graphs.py). At the end of a
segment the graph copies the layer's routing and activations into pinned host memory (`ids`,
`weights`, `hidden`); the host reads them, fetches or runs the misses (writing the CPU's partial
sum to `cpu_part` on the device) and only then lets the next segment compute the layer's experts.
`split` is the capture hook that ends one segment and begins the next; `active` is set while the
model runs for capture (and its warm-up), so the bank records instead of deciding.
`distinct_lids` turns one layer's routing read here into what the host decides on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

# L MoE layers, T tokens per step at most, K top-k, H hidden


class GraphIO:
    def __init__(
        self,
        n_layers: int,
        max_tokens: int,
        top_k: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        pinned = device.type == "cuda"
        shape_k, shape_h = (n_layers, max_tokens, top_k), (n_layers, max_tokens, hidden)
        self.ids = torch.zeros(shape_k, dtype=torch.int32, pin_memory=pinned)  # [L, T, K]
        self.ids_np = self.ids.numpy()
        self.weights = torch.zeros(shape_k, dtype=torch.float32, pin_memory=pinned)  # [L, T, K]
        self.hidden = torch.zeros(shape_h, dtype=dtype, pin_memory=pinned)  # [L, T, H]
        # The CPU's partial sums stay fp32 up to the MoE sum's one rounding
        # (calibration.cpu_experts says why).
        self.cpu_stage = torch.zeros(shape_h, dtype=torch.float32, pin_memory=pinned)  # [L, T, H]
        self.cpu_part = torch.zeros(shape_h, dtype=torch.float32, device=device)  # [L, T, H]
        self.active = False
        self.split: Callable[[], None] = lambda: None
        self._views: dict[tuple[int, int], LayerViews] = {}

    def views(self, layer: int, n_tokens: int) -> LayerViews:
        """The first `n_tokens` rows of `layer` in each buffer the host reads or writes at a
        stop, made once: slicing four buffers at every stop cost eight tensor ops."""
        key = (layer, n_tokens)
        if key not in self._views:
            rows = slice(0, n_tokens)
            self._views[key] = LayerViews(
                self.hidden[layer, rows],
                self.weights[layer, rows],
                self.cpu_stage[layer, rows],
                self.cpu_part[layer, rows],
            )
        return self._views[key]


class LayerViews(NamedTuple):
    """One layer's rows of a step in GraphIO's buffers."""

    hidden: torch.Tensor  # [T, H] pinned: the activations the graph exported
    weights: torch.Tensor  # [T, K] pinned: the routing weights
    cpu_stage: torch.Tensor  # [T, H] fp32 pinned: the CPU's partial sum
    cpu_part: torch.Tensor  # [T, H] fp32 on the device: what the next segment adds


def distinct_lids(ids: np.ndarray) -> tuple[list[int], list[int]]:
    """The sorted distinct lids of `ids` [T, K] and the pairs each serves, as lists. On a
    few dozen ids this is 3-6x cheaper than np.unique (~8 us), which ran for every MoE layer of
    every decode step: 40 a step on the Qwen3.6 shape."""
    return distinct_of(ids.ravel().tolist())


def distinct_of(flat: list[int]) -> tuple[list[int], list[int]]:
    """`distinct_lids` of a flat list of lids."""
    uniq = sorted(set(flat))
    if len(uniq) == len(flat):  # one token's top-k: distinct experts
        return uniq, [1] * len(uniq)
    counts = Counter(flat)
    return uniq, [counts[lid] for lid in uniq]
