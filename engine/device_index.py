"""Small host lists (slot and row indices) put on the device without a host wait."""

from __future__ import annotations

import torch


def on_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[R] `values` on `device`; on CUDA through pinned memory, queued on the current stream
    with no host wait (torch's caching host allocator keeps the buffer until the copy is done).
    Not inside a graph capture: the copy would read a buffer freed after it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
