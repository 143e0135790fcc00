"""EngineConfig: how the engine runs a model (device, memory, batching, and the switches of the
step paths, each beside the measurement behind its default), with the policy names it accepts
(`POLICIES`) and popular_pins' default (`POPULAR_PINS`, `pins_fraction`).

What the checkpoint is (ModelSpec) is config.py's; config.py re-exports these names, so
`from freetoken_agent.engine.config import EngineConfig` keeps working.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from freetoken_agent.kernels.expert_fills import COPY_PROGRAMS_MAX

POLICIES = ("adaptive", "transfer", "cpu", "static", "direct", "gpu-fill", "resident")


# The fields that are byte counts (named in the refusal of a value that is not an integer).
_BYTES = frozenset({"gpu_budget", "checkpoint_device_bytes", "checkpoint_host_bytes",
                    "elastic_group_bytes", "memory_reserve", "gpu_ceiling"})  # fmt: skip
# The least value of integer fields that have one (a negative count made a tensor of negative
# size deep in the load; max_model_len 0 read as "the model's").
_LEAST = {"kv_pages": 2, "kv_tokens": 1, "max_model_len": 1, "expert_slots": 1,
          "gpu_budget": 1, "checkpoint_device_bytes": 0, "checkpoint_host_bytes": 0,
          "elastic_group_bytes": 1, "memory_reserve": 0, "gpu_ceiling": 1,
          "copy_programs": 1}  # fmt: skip
SEED_MIN, SEED_END = -(2**63), 2**64  # what torch.Generator.manual_seed accepts


def check_option_names(names: Iterable[str]) -> None:
    """Refuse options EngineConfig has no field for (Engine.load's `**options`), naming them
    and the closest field: a misspelt option was a bare TypeError from the dataclass."""
    known = [f.name for f in fields(EngineConfig)]
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = [f"{n!r}" + "".join(f" (did you mean {m!r}?)"
                                    for m in difflib.get_close_matches(n, known, 1))
                 for n in unknown]  # fmt: skip
        raise TypeError(
            f"unknown engine option(s) {', '.join(hints)}; EngineConfig's fields are "
            f"{', '.join(known)}"
        )


# EngineConfig.popular_pins' default, named: a slots dataclass's class attribute is a descriptor.
POPULAR_PINS = 0.8


def pins_fraction(popular_pins: float | None) -> float:
    """EngineConfig.popular_pins resolved: the fraction of slots the device paths pin (None:
    the default, POPULAR_PINS)."""
    return POPULAR_PINS if popular_pins is None else popular_pins


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs a model: device, memory, batching. Set by `Engine.load`."""

    device: str = "cpu"
    dtype: torch.dtype | None = None  # None: the checkpoint's dtype
    gpu_budget: int | None = None  # bytes; None: free device memory minus a reserve
    policy: str = "adaptive"
    page_size: int = 16  # tokens per KV page
    kv_pages: int | None = None  # None: sized from the budget (or kv_tokens on the CPU)
    kv_tokens: int = 65536  # KV capacity in tokens when no budget sizes it
    max_num_seqs: int = 32  # requests decoding together
    max_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    cuda_graphs: bool = True  # capture batched decode in CUDA graphs (CUDA only)
    # FTW checkpoints: check every expert row against the manifest's CRC32 as the load copies
    # it (a CheckpointError names the bank and the rows). Off: zlib.crc32 hashes 4.2 GB/s on
    # one thread (measured on the dev box's AMD EPYC, zlib 1.2.13), slower than a PCIe 4/5 NVMe
    # disk reads (7-14 GB/s) and far slower than the page cache, and a load is meant to be
    # bound by the disk. Every load checks what costs nothing (manifest fields, shapes, dtype,
    # file sizes); `freetoken convert` reads its banks back, `freetoken verify DIR` checks a
    # copied checkpoint once.
    verify_checksums: bool = False
    expert_slots: int | None = None  # offloading: GPU expert slots (None: sized from budget)
    # Offloading: chunks of at least this many tokens stream whole layers instead of placing
    # their misses expert by expert. Measured on the H200 host (`bench stream-threshold`, peer
    # slice, uniform routing, stream_threshold_12l_s14_kept.json): streaming a chunk took
    # 189-193 ms at any length; placing it 92-137 ms at 64-256 tokens, 157-179 at 384-512,
    # 184-186 at 768-1024 and 194 at 1536. Past 512 the two are within 5%, and streaming
    # leaves the cache as decode had it (its ring lends few slots: streaming.py), where
    # placing evicts.
    # None: derived from the calibrated bandwidths and the slots' share of the experts
    # (experts/stream_threshold.py): its model is within 2-24% of both measured times, but
    # the two stay so close past 512 tokens that it derives thousands. An experiment.
    stream_min_tokens: int | None = 512
    double_buffer: bool = True  # False: a staging ring of one buffer (the ablation)
    # Hybrid models, segmented decode: run ahead of the host's miss checks as attention-only
    # models do, re-running from step-start copies of the recurrent state after a miss
    # (recurrent_shadow.py). Off until measured on the device.
    hybrid_run_ahead: bool = False
    # Decode-sized projections (<= 8 rows) on CUDA through the Triton skinny matmul instead of
    # cuBLAS (kernels/gemv.py). Off: even with cuBLAS on the H200 host (48 layers all
    # resident, tok/s b=1 / b=4: 296.1 / 664.2 -> 294.2 / 671.1; NOTES, twenty-third session).
    skinny_gemv: bool = False
    # Decode-sized steps on CUDA ask L2 for o_proj's weight beside RoPE and attention, and on
    # the offloaded device path for the MoE rows beside the fill copy: side-stream prefetches
    # while HBM idles (kernels/l2_prefetch.py, engine/l2_prefetcher.py). Off: it lost at 48
    # layers, all resident b=1 296.1 -> 283.9 tok/s, gpu-fill 258.4 -> 246.0 (NOTES, s23).
    l2_prefetch: bool = False
    # One-row decode steps on CUDA run each MoE router in one launch, the linear layer with the
    # softmax and top-k (kernels/triton/route.py), instead of cuBLAS's GEMV and the top-k
    # kernel (engine/layers/moe.py FUSED_ROUTER_ROWS). Measured on the H200 host (twenty-first
    # session, `bench fusions`, 48 layers all resident): b=1 274.4 -> 281.4 tok/s; at b=4 the
    # kernel is slower (route 15.3 us against 8.4 for F.linear and the top-k), so wider steps
    # keep cuBLAS.
    fused_router: bool = True
    # One-row decode steps on CUDA run each attention layer's o_proj, the residual add and the
    # post-attention RMSNorm in one launch (kernels/triton/proj_norm.py) instead of cuBLAS's
    # GEMV, its split-K reduce and the norm kernel (engine/models/base.py
    # FUSED_PROJ_NORM_ROWS). Measured as fused_router: b=1 274.4 -> 281.7 tok/s, both 289.4;
    # b=4 624.2 -> 609.3, so wider steps keep cuBLAS.
    fused_proj_norm: bool = True
    # One-row decode steps on CUDA run each attention layer's input RMSNorm (with the residual
    # add), the q/k/v projection, the per-head q/k norms, RoPE and the KV store in one launch
    # (kernels/triton/norm_qkv.py) instead of the norm kernel, cuBLAS's GEMV and the rope
    # kernel (engine/layers/attention.py FUSED_NORM_QKV_ROWS). Off: no faster on the H200 host
    # (thirty-eighth session, `bench fusions` at 48 layers, all resident, 4 rounds: b=1 308.7
    # against 310.3 tok/s under PDL `light`, 312.6 against 312.7 under `on`): PDL already hides
    # most of the two small launches it saves, and its Triton projection is a little slower
    # than cuBLAS's.
    fused_norm_qkv: bool = False
    # One-row decode steps on CUDA run each attention layer's whole block (input RMSNorm with
    # the residual add, q/k/v projection, per-head q/k norms, RoPE, the KV store, attention,
    # o_proj, the residual add, the post-attention RMSNorm) as ONE persistent launch of one
    # program per SM, its phases separated by grid-wide counters
    # (kernels/triton/attention_block.py) instead of five launches. Off: faster alone, slower
    # in the step on the H200 host (thirty-ninth session): `bench attention-half` 30.4 against
    # 31.6 us a layer at 256 cached tokens, 32.3 against 34.1 at 1024, but `bench fusions` at
    # 48 layers, all resident, b=1 299.0 against 310.3 tok/s (the default path's kernels
    # overlap their neighbours under PDL; the block was not PDL-aware then, and is now,
    # unmeasured).
    attention_block: bool = False
    # Offloaded decode under adaptive, while fills pay (temporal locality, as Zipf traces): a
    # stopping layer waits for q* of its misses' fills and runs the rest on the CPU while they
    # too are filled, behind its compute, for the steps after (AdaptiveFetches.behind).
    # Off: slower on the H200 host (Zipf b=1, 12 layers 304 -> 255 tok/s, 48 layers 90 -> 78;
    # one expert on its CPU took as long as its fill); kept for hosts with a slower link.
    fill_behind: bool = False
    # The device path's cache (gpu-fill, adaptive's device and shared paths) pins this
    # fraction of its slots for the experts each layer used most (engine/experts/
    # popular_pins.py), choosing again every 64 decode steps; the rest stay LRU. 0: all LRU.
    # Replayed on skewed synthetic traces 0.8 cut the misses by 18-19%, uniform routing
    # unchanged. Measured on the H200 host, 48 layers / 32 GB, Zipf 1.0 / locality 0.7 (tok/s,
    # b=1 / b=4): gpu-fill 113.8 / 159.1 -> 118.2 / 176.6, adaptive 108.4 / 156.0 -> 117.9 /
    # 170.7 (misses 0.070 -> 0.063 a pair at b=1); native routing unchanged (262.0 / 538.0
    # -> 260.8 / 538.6). Half-lives and budget: popular_pins.py. None: POPULAR_PINS on the
    # device paths and silence elsewhere; a number is the user's choice, and a policy without
    # a device path warns that it has no effect (`pins_fraction` resolves it).
    popular_pins: float | None = None
    # The device path's misses cross the link inside the MoE kernels: a moved expert's pairs
    # read it from the pinned pool and the kernels store each tile they read into its new
    # slot, so no copy kernel runs before them and a layer's hits compute while its misses
    # stream (engine/experts/device_path.py). Not where the decode graph holds adaptive's
    # CPU worker (its shared path): there the copy kernel stays. Off: slower on the H200
    # host, 48 layers / 32 GB gpu-fill (tok/s, b=1 / b=4) native 265.1 / 512.0 -> 213.1 /
    # 388.7, Zipf 112.6 / 155.8 -> 99.6 / 158.5: a decode kernel's few programs per expert
    # read the link slower than the copy kernel's, and its stores slow its loads. Kept for
    # links close to HBM speed (unified memory, as GH200's).
    fill_through: bool = False
    # adaptive's `split` step path (engine/experts/split_expert.py): every fill of the device
    # path cut between the link and the CPU worker, which copies its columns into the slot
    # behind the step. Off by default: on the H200 host (twenty-ninth session, 48 layers /
    # 32 GB, bench/results/NOTES.md) adaptive offered it kept it under Zipf routing and beat
    # gpu-fill by 3-4% (124.9 / 182.0 against 120.7 / 175.4 tok/s at b=1 / 4), but another run
    # timed it at too low a cut and kept `device`, and trying it cost native b=4 7% (532.6
    # against 572.0); the cut's model changed after, unmeasured. On: adaptive's path trials
    # measure it against the other paths.
    split_expert: bool = False
    # The device path's copy kernel: how many programs walk a layer's fills over the link
    # (kernels/triton/expert_fills.py). None: the grid `freetoken calibrate` timed fastest on
    # this host (calibration.py), else 32.
    copy_programs: int | None = None
    # Launch each decode step before the last one's tokens are read on the host, so the
    # step boundary's host work runs beside the device (engine/overlap.py). On: measured on
    # the H200 host, all resident 48 layers b=1 256.5 -> 273.9 tok/s greedy, 209.9 -> 241.6
    # sampled (12 layers: 825 -> 950, 497 -> 728); offloaded adaptive 48 layers / 32 GB native
    # 157.7 -> 165.9, the 12-layer slice Zipf 276.7 -> 289.9 (NOTES, seventeenth session).
    overlap_schedule: bool = True
    # Where the token embedding table lives (engine/layers/embedding.py): None (auto) keeps an
    # untied table in pinned host memory when the experts are offloaded on CUDA, where its
    # device bytes are worth more as expert slots; True asks for it whenever the table is
    # untied (on a CPU device: counted outside the budget, as on CUDA); False never.
    host_embeddings: bool | None = None
    # Hybrid models: where recurrent state is checkpointed for cross-request reuse:
    # "anchors" (the Session's semantic boundaries), "positional:N" (every N tokens, as
    # llama.cpp's context checkpoints) or "none" (no reuse across requests).
    checkpoints: str = "anchors"
    checkpoint_device_bytes: int | None = None  # None: sized from the budget (loading.py)
    checkpoint_host_bytes: int | None = None  # None: a share of host memory (loading.py)
    # Elastic memory: with experts offloaded under a known budget (CUDA, or an explicit
    # gpu_budget on the CPU), KV pages and expert slots share one arena whose split the
    # MemoryManager moves at safe points. False: the split stays as loaded (a fixed baseline).
    elastic: bool = True
    elastic_group_bytes: int = 64 << 20  # the split moves in groups of this many bytes
    # Elastic memory lends expert slots the part of a full step's workspace the next step
    # cannot need (engine/memory_workspace.py: ~70 slots at the 8 GiB tier while decoding),
    # evicting them when a prompt comes. False: the whole workspace stays outside the split.
    lend_workspace: bool = True
    # On CUDA the elastic budget also follows free device memory: it keeps `memory_reserve`
    # bytes free for the driver and other programs, yields when another program takes VRAM
    # and grows back when it is released (up to the user's budget, or without one up to
    # gpu_ceiling: memory freed after load is taken too); read every
    # `memory_poll_s` seconds at the safe points (and by an idle EngineService).
    follow_free_memory: bool = True
    memory_reserve: int = 1 << 30  # also what a load without gpu_budget leaves free
    # The most the elastic budget may grow to, in all, when memory frees up or the user raises
    # it (bytes): the arena reserves addresses for it and backs only what it uses. None: on
    # CUDA the device's total memory less memory_reserve; on the CPU the budget itself.
    gpu_ceiling: int | None = None
    memory_poll_s: float = 0.5
    # The thinking budget of requests that set none (SamplingParams.thinking_token_budget;
    # engine/thinking_budget.py), as llama.cpp's --reasoning-budget: on a laptop a reasoning
    # model's thinking is minutes before the answer. None: no limit. Ignored, with one warning
    # at load, for a model without think tokens.
    thinking_budget: int | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pins_fraction(self) -> float:
        """popular_pins resolved (`pins_fraction`)."""
        return pins_fraction(self.popular_pins)

    def __post_init__(self) -> None:
        # Counts and byte sizes must be integers (a "8GB" budget failed deep in the load). The
        # fields are found by their annotations as written here, "int" or "int | None" (this
        # module's future annotations are strings): a field written otherwise is not checked.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and not (
                (value is None and f.type != "int")
                or (isinstance(value, numbers.Integral) and not isinstance(value, bool))
            ):
                if isinstance(value, float) and value.is_integer():  # 8e9 bytes
                    setattr(self, f.name, int(value))
                    continue
                raise ValueError(
                    f"{f.name} must be an integer{' or None' if f.type != 'int' else ''}, got "
                    f"{value!r}" + (" (a count of bytes)" if f.name in _BYTES else "")
                )
        self._check_kinds()
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be positive")
        if self.stream_min_tokens is not None and self.stream_min_tokens < 1:
            raise ValueError(f"stream_min_tokens must be positive, got {self.stream_min_tokens}")
        if self.popular_pins is not None and not 0.0 <= self.popular_pins < 1.0:
            raise ValueError(f"popular_pins is a fraction of the slots in [0, 1), got "
                             f"{self.popular_pins}")  # fmt: skip
        if self.copy_programs is not None and self.copy_programs > COPY_PROGRAMS_MAX:
            raise ValueError(f"copy_programs must be at most {COPY_PROGRAMS_MAX}, got "
                             f"{self.copy_programs}")  # fmt: skip
        if not SEED_MIN <= self.seed < SEED_END:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_END}), got {self.seed}")
        if not 0 < self.memory_poll_s < float("inf"):
            raise ValueError(f"memory_poll_s must be a positive number, got {self.memory_poll_s}")
        from freetoken_agent.engine.kv.checkpoint_mode import CheckpointMode

        CheckpointMode.parse(self.checkpoints)  # a bad mode is refused at load, by name
        budget = self.thinking_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):  # fmt: skip
            raise ValueError(f"thinking_budget must be an integer >= 0 or None, got {budget!r}")

    def _check_kinds(self) -> None:
        """Switches must be booleans ("false" read as true), fractions and periods real
        numbers, and the counts that have a least value at least that."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.type.endswith("| None"):
                continue
            if f.type.startswith("bool") and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r:.40}")
            if f.type.startswith("float") and (
                isinstance(value, bool) or not isinstance(value, numbers.Real)
            ):
                raise ValueError(f"{f.name} must be a number, got {value!r:.40}")
            least = _LEAST.get(f.name)
            if least is not None and value < least:
                raise ValueError(f"{f.name} must be at least {least}, got {value}")
