"""The resizable device tier's memory: lanes of reserved device addresses.

When the checkpoints' device tier may change size (`max_device_rows` > `device_rows`, under
elastic memory), each layer's conv rows and ssm rows live in a lane of device addresses reserved
for `max_device_rows` rows and backed only up to `device_rows` (engine/device_memory.py), so the
views the kernels hold never move while rows are mapped and unmapped. This is how the rows lie
in memory, not which checkpoint holds which row: checkpoints.py decides that and calls here to
build the views and to find the byte ranges to map or unmap.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.device_memory import KV_CHUNK_BYTES, arena_memory

if TYPE_CHECKING:
    from freetoken_agent.engine.kv.checkpoints import CheckpointPool

# L recurrent layers, Cmax reserved device-tier rows (max_device_rows)


def lane_views(pool: CheckpointPool, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """[L, Cmax, *shape] over L lanes of Cmax rows each (a layer's rows dense)."""
    row = math.prod(shape)
    row_bytes = row * dtype.itemsize
    if pool.device.type == "cuda":
        chunk = KV_CHUNK_BYTES
    else:  # a simulated device: rows mapped in runs keeping a lane to 256 chunks
        chunk = row_bytes * -(-pool.max_device_rows // 256)
    lane = -(-pool.max_device_rows * row_bytes // chunk) * chunk
    memory = arena_memory(pool.n_layers * lane, pool.device, chunk)
    pool._lanes.append((memory, row_bytes))
    flat = memory.view().view(dtype)
    strides = [1]
    for d in reversed(shape[1:]):
        strides.insert(0, strides[0] * d)
    full = (pool.n_layers, pool.max_device_rows, *shape)
    return flat.as_strided(full, (lane // dtype.itemsize, row, *strides), 0)


def lane_spans(pool: CheckpointPool, lo_row: int, hi_row: int | None = None):
    """(memory, lo, hi) byte ranges of rows lo_row..hi_row-1 in every lane (hi_row None:
    to the lane's end, whole chunks)."""
    for memory, row_bytes in pool._lanes:
        lane = memory.nbytes // pool.n_layers
        for layer in range(pool.n_layers):
            start = layer * lane
            end = start + hi_row * row_bytes if hi_row is not None else start + lane
            yield memory, start + lo_row * row_bytes, end


def map_rows(pool: CheckpointPool, rows: int) -> bool:
    """Back rows 0..rows-1 of every lane."""
    return all(memory.map(lo, hi) for memory, lo, hi in lane_spans(pool, 0, rows))
