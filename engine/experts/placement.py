"""Choosing the expert bank for a policy and a budget.

`resident` keeps every expert on the device. `adaptive` does too when they fit the budget beside
the dense weights, a KV pool of `kv_tokens` and the workspace; otherwise, like `transfer`, `cpu`
and `static`, it serves experts from the CPU pool through a slot cache sized to what is left.
`expert_slots` (an EngineConfig option) fixes the slot count directly: on a CPU "device" that is
how tests run the offloading code with a small cache.
"""

from __future__ import annotations

import logging

import torch

from freetoken_agent.engine.arena import ElasticArena, KVUnit, SlotUnit
from freetoken_agent.engine.config import ConfigError, EngineConfig, ModelSpec
from freetoken_agent.engine.device_memory import CHUNK_BYTES, virtual_memory_works
from freetoken_agent.engine.experts import calibration
from freetoken_agent.engine.experts.offload import OffloadedExpertBank, lends_staging
from freetoken_agent.engine.experts.policy import Bandwidths
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.resident import ResidentExpertBank
from freetoken_agent.engine.experts.stream_threshold import stream_threshold
from freetoken_agent.engine.experts.streaming import STREAMED_MOE_PAIRS, ring_slots
from freetoken_agent.engine.kv.pool import KVPool
from freetoken_agent.engine.kv.recurrence import recurrent_device_bytes
from freetoken_agent.engine.kv.recurrent_state import state_bytes
from freetoken_agent.kernels.cpu.experts import DTYPE_ID as CPU_KERNEL_DTYPES
from freetoken_agent.kernels.expert_fills import COPY_PROGRAMS
from freetoken_agent.kernels.fused_moe import PREFILL_CHUNK_PAIRS, prefill_workspace_bytes

CPU_EXPERT_DTYPES = tuple(CPU_KERNEL_DTYPES)  # what an offloaded bank's CPU branch can run

log = logging.getLogger("freetoken.experts")

GiB = 1 << 30


class BudgetError(ValueError):
    """The GPU budget cannot hold what must be resident."""


def size(nbytes: int) -> str:
    """Bytes for an error message: GiB from one GiB, MiB below (a tiny model's dense weights
    or a mistyped budget would read 0.00 GiB)."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.2f} MiB"


def workspace_bytes(
    spec: ModelSpec, config: EngineConfig, *, offloaded: bool, tokens: int | None = None
) -> int:
    """Activations of one step of `tokens` tokens (default: a full step, max_batched_tokens;
    engine/memory_workspace.py sizes smaller ones): per token the residual stream and
    projections (bf16), the fused MoE's prefill buffers (a chunk's pairs at a time: `offloaded`
    banks run it in STREAMED_MOE_PAIRS chunks, resident ones in the kernel's default), sampling
    logits and kernel scratch. `score()` of a long sequence allocates [T, vocab] logits beyond
    this (it is for evaluation, not serving).

    Measured on the H200 (`bench workspace`, 12-layer Qwen3-30B slice, 8192-token chunk): a
    prefill step's peak allocation 0.81 GB resident, 0.39 GB offloaded; this estimate 1.4 and
    1.0 GB. The per-token term keeps its margin for hybrid models' recurrent activations, and
    for a streamed layer's two fp32 sums of its parts (kernels/moe_parts.py; 8 * H bytes a
    token, a quarter of the term: 0.13 GB at that chunk)."""
    t = config.max_batched_tokens if tokens is None else tokens
    h, k = spec.hidden_size, max(spec.top_k, 1)
    itemsize = (config.dtype or spec.dtype).itemsize
    pairs = STREAMED_MOE_PAIRS if offloaded else PREFILL_CHUNK_PAIRS
    moe = prefill_workspace_bytes(t, k, h, spec.moe_intermediate_size, itemsize, pairs)
    logits = config.max_num_seqs * spec.vocab_size * 4 * 2
    shadow = 0  # hybrid run-ahead: a decode step's copies of its recurrent state rows
    if config.hybrid_run_ahead and spec.linear is not None:
        per_row = state_bytes(len(spec.recurrent_layers), spec.linear.conv_state_shape,
                              spec.linear.ssm_state_shape, config.dtype or spec.dtype)  # fmt: skip
        shadow = config.max_num_seqs * per_row
    return 256 * (1 << 20) + t * 16 * h * 2 + moe + logits + shadow


def gpu_budget(config: EngineConfig, device: torch.device, already_used: int) -> int:
    """The bytes the engine may use on the device in all (dense weights included)."""
    if config.gpu_budget is not None:
        return config.gpu_budget
    free, _ = torch.cuda.mem_get_info(device)
    return free + already_used - config.memory_reserve


def slot_count(
    spec: ModelSpec,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    dense: int,
    offloaded: bool = True,
) -> int:
    """Slots that fit beside dense weights, workspace and a `kv_tokens` KV pool. `offloaded`:
    the workspace of an offloaded bank (False: of a resident one, to ask whether all fit)."""
    n_rows = spec.n_moe_layers * spec.n_experts
    expert = 3 * spec.hidden_size * spec.moe_intermediate_size * dtype.itemsize
    if device.type != "cuda" and config.gpu_budget is None:
        # No budget on a CPU device unless one is given (a simulated GPU): nothing to check.
        return n_rows if config.expert_slots is None else config.expert_slots
    budget = gpu_budget(config, device, dense)
    if config.expert_slots is not None:  # the user's count: the budget must hold it
        slots = config.expert_slots * expert
        if budget < dense + slots:
            raise BudgetError(
                f"a GPU budget of {size(budget)} cannot hold the dense weights ({size(dense)}) "
                f"and the {config.expert_slots} expert slots asked for ({size(slots)})"
            )
        return config.expert_slots
    kv = -(-config.kv_tokens // config.page_size) * KVPool.page_bytes(
        len(spec.attention_layers), config.page_size, spec.n_kv_heads, spec.head_dim, dtype
    )
    buffers = 2 if config.double_buffer else 1
    recurrent = recurrent_device_bytes(spec, config, device, dtype, budget)
    workspace = workspace_bytes(spec, config, offloaded=offloaded)
    left = budget - dense - kv - recurrent - workspace
    if lends_staging(left // expert, spec.n_experts, buffers, n_rows):
        return min(n_rows, left // expert)  # the prefill ring borrows slots (streaming.py)
    staging = ring_slots(spec.n_experts, buffers) * expert
    left -= staging  # a staging ring of its own
    if left < expert:
        # The least that runs: one slot beside a staging ring of its own (lending it takes a
        # layer of slots more).
        least = dense + kv + recurrent + workspace + staging + expert
        rec = f", {size(recurrent)} of recurrent state" if recurrent else ""
        rest = (
            f"a {config.kv_tokens}-token KV pool ({size(kv)}), the workspace ({size(workspace)})"
            f"{rec}, prefill staging ({size(staging)}) and one expert slot ({size(expert)})"
        )
        if budget < dense:
            raise BudgetError(
                f"a GPU budget of {size(budget)} does not even hold the dense weights "
                f"({size(dense)}); offloading the experts also needs {rest}: at least "
                f"{size(least)} in all"
            )
        raise BudgetError(
            f"a GPU budget of {size(budget)} holds the dense weights ({size(dense)}) but not "
            f"{rest} beside them: at least {size(least)} in all"
        )
    return min(n_rows, left // expert)


def _all_fit(
    spec: ModelSpec, config: EngineConfig, device: torch.device, dtype: torch.dtype, dense: int
) -> bool:
    """Whether every expert fits the budget beside a resident bank's workspace (its prefill
    buffers are larger than an offloaded bank's: workspace_bytes)."""
    try:
        slots = slot_count(spec, config, device, dtype, dense, offloaded=False)
    except BudgetError:
        return False
    return slots >= spec.n_moe_layers * spec.n_experts


def offloads(
    spec: ModelSpec, config: EngineConfig, device: torch.device, dtype: torch.dtype, dense: int
) -> bool:
    """Whether `make_bank` serves the experts from the host pool, with `dense` device bytes
    of dense weights. A model with no MoE layer (a MoE family's config whose layers are all
    dense: mlp_only_layers, decoder_sparse_step) has no expert to offload: resident."""
    if config.policy == "resident" or spec.n_moe_layers == 0:
        return False
    fits_policies = ("adaptive", "direct", "gpu-fill")  # load resident when everything fits
    return not (config.policy in fits_policies and _all_fit(spec, config, device, dtype, dense))


def _say_what_has_no_effect(spec: ModelSpec, config: EngineConfig, n_rows: int) -> None:
    """One warning for an offload setting the model or the policy leaves without effect: it
    loaded all resident, or with fewer slots, without a word."""
    if spec.n_moe_layers == 0 and config.policy != "resident":
        log.warning("policy %r: the model has no MoE layer (every layer's MLP is dense), "
                    "so nothing is offloaded: all its weights are resident",
                    config.policy)  # fmt: skip
    elif config.expert_slots is not None and config.policy == "resident":
        log.warning("expert_slots %d: no effect under policy 'resident' (every expert stays on "
                    "the GPU)", config.expert_slots)  # fmt: skip
    elif config.expert_slots is not None and config.expert_slots > n_rows:
        log.warning("expert_slots %d: the model has %d routed experts in all, so %d slots hold "
                    "every one", config.expert_slots, n_rows, n_rows)  # fmt: skip


def make_bank(
    spec: ModelSpec,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    dense: int,
    pool: ExpertPool | None = None,
) -> ResidentExpertBank | OffloadedExpertBank:
    """`pool`: host experts already loaded (a benchmark comparing engines over one model
    builds its 58 GB pool once); by default an empty one the loader fills."""
    n_rows = spec.n_moe_layers * spec.n_experts
    _say_what_has_no_effect(spec, config, n_rows)
    if not offloads(spec, config, device, dtype, dense):
        experts = n_rows * 3 * spec.hidden_size * spec.moe_intermediate_size * dtype.itemsize
        if config.gpu_budget is not None and config.gpu_budget < dense + experts:
            # Checked here for a simulated GPU too (a CPU device with a budget), where the KV
            # sizing (loading.size_kv_pool) checks no budget.
            raise BudgetError(
                f"a GPU budget of {size(config.gpu_budget)} cannot hold the dense weights "
                f"({size(dense)}) and every expert ({size(experts)}), which policy "
                f"{config.policy!r} keeps on the GPU: raise the budget or offload the experts"
            )
        return ResidentExpertBank(spec, dtype, device)
    if dtype not in CPU_EXPERT_DTYPES:  # the first miss on the CPU would fail the step
        raise ConfigError(
            f"dtype {str(dtype)[6:]} runs only with every expert resident (policy 'resident', "
            f"or a budget that holds them all): offloaded experts run on the CPU kernel, which "
            f"reads {', '.join(str(d)[6:] for d in CPU_EXPERT_DTYPES)}"
        )
    slots = slot_count(spec, config, device, dtype, dense)
    if pool is None:
        pool = ExpertPool.empty(spec, dtype)
    elif (pool.n_rows, pool.w13.dtype) != (n_rows, dtype):
        raise ValueError(f"a pool of {pool.n_rows} {pool.w13.dtype} rows for a model of "
                         f"{n_rows} {dtype} experts")  # fmt: skip
    arena = elastic_arena(spec, config, device, dtype, slots, dense)
    measured = calibration.cached(spec.hidden_size, spec.moe_intermediate_size, dtype)
    if measured is None and config.policy == "adaptive" and device.type == "cuda":
        # A warning: an entry for another shape or dtype (calibrate's default is 2048 x 768
        # bf16) is no entry for this model, and the defaults can be far off this host's.
        log.warning("no bandwidth calibration for this machine and expert shape (%d x %d %s): "
                    "the q* split runs on defaults until `freetoken calibrate --model MODEL` "
                    "measures them", spec.hidden_size, spec.moe_intermediate_size,
                    str(dtype).removeprefix("torch."))  # fmt: skip
    bandwidths = measured.bandwidths() if measured else Bandwidths()
    stream_min = config.stream_min_tokens
    if stream_min is None:  # derived: experts/stream_threshold.py
        expert = 3 * spec.hidden_size * spec.moe_intermediate_size * dtype.itemsize
        buffers = 2 if config.double_buffer else 1
        lends = lends_staging(slots, spec.n_experts, buffers, n_rows)  # as the bank will
        resident = min(1.0, slots / n_rows)
        staging = ring_slots(spec.n_experts, buffers) / n_rows if lends else 0.0
        stream_min = stream_threshold(
            spec.n_experts, spec.top_k, expert, bandwidths, resident, staging=staging
        )
        log.info("prefill chunks of %d tokens or more stream whole layers", stream_min)
    return OffloadedExpertBank(
        spec,
        pool,
        slots,
        device,
        config.policy,
        bandwidths=bandwidths,
        stream_min_tokens=stream_min,
        double_buffer=config.double_buffer,
        arena=arena,
        fill_behind=config.fill_behind,
        popular_pins=config.popular_pins,
        fill_through=config.fill_through,
        split_expert=config.split_expert,
        # The user's grid, else this host's timed one, else the kernel's default.
        copy_programs=config.copy_programs
        or (measured.copy_programs if measured else COPY_PROGRAMS),
    )


def gpu_ceiling(config: EngineConfig, device: torch.device, budget: int) -> int:
    """The most the elastic budget may grow to (EngineConfig.gpu_ceiling), at least `budget`."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not virtual_memory_works(index):  # the arena is one allocation of its full size
            return budget
    if config.gpu_ceiling is not None:
        return max(config.gpu_ceiling, budget)
    if device.type == "cuda":
        return max(torch.cuda.mem_get_info(device)[1] - config.memory_reserve, budget)
    return budget


def elastic_arena(
    spec: ModelSpec,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    slots: int,
    dense: int,
) -> ElasticArena | None:
    """The arena KV pages and expert slots share when memory is elastic: `kv_tokens` of KV and
    the `slots` the budget left (slot_count) at load, with room up to the ceiling (addresses
    only: the arena backs what it uses)."""
    budget_known = device.type == "cuda" or config.gpu_budget is not None
    if not (config.elastic and budget_known and config.expert_slots is None):
        return None
    kv = KVUnit(len(spec.attention_layers), config.page_size, spec.n_kv_heads, spec.head_dim, dtype)
    slot = SlotUnit(spec.hidden_size, spec.moe_intermediate_size, dtype)
    pages = -(-config.kv_tokens // config.page_size) + 1  # + the scratch page
    # One slot unit of slack: the first slot starts at the next slot boundary after the pages.
    # Memory is released and mapped in chunks no larger than a move of the split.
    nbytes = pages * kv.nbytes + (slots + 1) * slot.nbytes
    budget = gpu_budget(config, device, dense)
    nbytes += gpu_ceiling(config, device, budget) - budget  # room to grow into
    chunk = min(CHUNK_BYTES, config.elastic_group_bytes)
    # Slots from the top, `pages` backed: with room to grow the boundary's page bound is more.
    boundary = (nbytes // slot.nbytes - slots) * slot.nbytes
    return ElasticArena(nbytes, device, kv, slot, boundary, chunk, pages=pages)
