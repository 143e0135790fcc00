"""Sizing and building a hybrid model's recurrent memory: state slots and checkpoint pool.

GPU memory (DESIGN section 5) counts them with the KV pool: per running request one state slot
(every recurrent layer's conv and matrix state, fp32 matrices), plus the checkpoint pool's
device tier. The host tier holds checkpoints spilled from the device, in pinned memory.

With elastic memory the device tier is resizable, part of the split (engine/memory_manager.py):
it starts at this size and then holds the checkpoints in use plus a row per sequence, up to the
same 1/16 of the budget of the moment.

Defaults: the device tier gets 1/16 of the GPU budget (2 GiB at a 32 GB budget: about 30
checkpoints of a Qwen3.6-35B-A3B-shaped model, 66 MB each); the host tier min(16 GiB, 1/8 of
the machine's memory). On a CPU "device" both tiers default to a few rows per running request
(tests set them with `checkpoint_*_bytes`). Rows are capped: tiny models would otherwise get
millions.
"""

from __future__ import annotations

import os

import torch

from freetoken_agent.engine.config import EngineConfig, ModelSpec
from freetoken_agent.engine.kv.checkpoint_mode import CheckpointMode
from freetoken_agent.engine.kv.checkpoints import CheckpointPool
from freetoken_agent.engine.kv.recurrent_state import RecurrentStatePool
from freetoken_agent.engine.request import Recurrence

GiB = 1 << 30
MAX_ROWS = 4096  # per tier
CPU_ROWS_PER_SEQ = 4
HOST_SHARE = 8  # the host tier's default: 1/8 of physical memory, at most 16 GiB


def _shapes(spec: ModelSpec) -> tuple[int, tuple[int, int], tuple[int, int, int]]:
    lin = spec.linear
    return len(spec.recurrent_layers), lin.conv_state_shape, lin.ssm_state_shape


def state_bytes(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype) -> int:
    """Device bytes of the state slots (one per running request plus scratch)."""
    if not spec.is_hybrid:
        return 0
    per = RecurrentStatePool.bytes_per_slot(*_shapes(spec), dtype)
    return (config.max_num_seqs + 1) * per


def checkpoint_rows(
    spec: ModelSpec, config: EngineConfig, device: torch.device, dtype: torch.dtype, budget: int
) -> tuple[int, int]:
    """(device rows, host rows) of the checkpoint pool."""
    if not spec.is_hybrid or not CheckpointMode.parse(config.checkpoints).reuses:
        return 0, 0
    per = CheckpointPool.bytes_per_checkpoint(*_shapes(spec), dtype)
    if config.checkpoint_device_bytes is not None:
        dev_rows = config.checkpoint_device_bytes // per
    elif device.type == "cuda":
        dev_rows = budget // 16 // per
    else:
        dev_rows = CPU_ROWS_PER_SEQ * config.max_num_seqs
    if config.checkpoint_host_bytes is not None:
        host_rows = config.checkpoint_host_bytes // per
    elif device.type == "cuda":
        host_rows = min(16 * GiB, _physical_memory() // HOST_SHARE) // per
    else:
        host_rows = CPU_ROWS_PER_SEQ * config.max_num_seqs
    return int(min(max(dev_rows, 1), MAX_ROWS)), int(min(max(host_rows, 0), MAX_ROWS))


def recurrent_device_bytes(
    spec: ModelSpec, config: EngineConfig, device: torch.device, dtype: torch.dtype, budget: int
) -> int:
    """What the KV pool and expert slots must leave for recurrent memory on the device."""
    if not spec.is_hybrid:
        return 0
    rows, _ = checkpoint_rows(spec, config, device, dtype, budget)
    per = CheckpointPool.bytes_per_checkpoint(*_shapes(spec), dtype)
    return state_bytes(spec, config, dtype) + rows * per


def device_row_cap(spec: ModelSpec, dtype: torch.dtype, budget: int) -> int:
    """The most device rows elastic memory gives the checkpoints at `budget`: a 16th of it,
    the share a fixed tier gets on CUDA (at least 1, at most MAX_ROWS)."""
    per = CheckpointPool.bytes_per_checkpoint(*_shapes(spec), dtype)
    return int(min(max(budget // 16 // per, 1), MAX_ROWS))


def build_recurrence(
    spec: ModelSpec,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    budget: int,
    max_budget: int | None = None,
) -> Recurrence | None:
    """`max_budget`: with elastic memory, the most the budget may reach; the checkpoint device
    tier is then resizable up to `device_row_cap` there (unless its size was given)."""
    if not spec.is_hybrid:
        return None
    n_layers, conv, ssm = _shapes(spec)
    states = RecurrentStatePool(n_layers, config.max_num_seqs + 1, conv, ssm, dtype, device)
    dev_rows, host_rows = checkpoint_rows(spec, config, device, dtype, budget)
    dev_rows = max(dev_rows, 1)  # one row keeps the layers' snapshot views valid in mode none
    max_rows = None
    mode = CheckpointMode.parse(config.checkpoints)
    if max_budget is not None and mode.reuses and config.checkpoint_device_bytes is None:
        max_rows = max(dev_rows, device_row_cap(spec, dtype, max_budget))
    checkpoints = CheckpointPool(n_layers, dev_rows, host_rows, conv, ssm, dtype, device,
                                 max_device_rows=max_rows)  # fmt: skip
    return Recurrence(states, checkpoints, mode)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB
