"""A grammar's packed mask row, as engine/constrained.py packs them, for processor tests."""

from __future__ import annotations

import numpy as np


def packed_mask(vocab: int, ids: list[int]) -> np.ndarray:
    """A packed mask row [W] int32 (bit i of word w: id 32 w + i) allowing `ids`."""
    bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)
