"""The offloaded expert bank: experts in the CPU pool, a GPU slot cache in front of it.

Per MoE layer and step: route (done by the block), deduplicate the (token, choice) pairs into
the layer's distinct experts, look them up; hits run on the device from their slots; of the m
misses, the policy's q are filled into slots (evicting least-recently-used experts that this
layer does not need) and run on the device too, the other m - q run on the CPU straight from the
pool. The two partial sums (each over the pairs it owns, routing-weighted) are added. Which
branch computes a pair never changes what is computed: the same SwiGLU in fp32 from the same
bf16/fp32 weights, so every placement agrees with the all-resident run within float rounding.

`static` is the fixed placement of KTransformers and llama.cpp's `--n-cpu-moe`: whole layers,
from the last backwards, as many as the slots in service hold (refilled after a prefill
chunk's staging borrowed their slots, and following the elastic split); every other expert
runs on the CPU.

Eager steps (prefill chunks below the streaming threshold, CPU devices) decide on the host
with one sync per layer. Decode on CUDA replays captured graphs cut into one segment per MoE
layer (engine/segmented_graphs.py): the graph exports the routing, `resolve` places the misses,
and the next segment computes the experts; chunks of `stream_min_tokens` or more stream every
absent expert of every layer instead, the resident ones read in place (streaming.py). Policy
gpu-fill, and adaptive on its device and shared paths, place a layer's misses on the device
within one graph a step (device_path.py).
"""

from __future__ import annotations

import logging

import torch

from freetoken_agent.engine.arena import ElasticArena
from freetoken_agent.engine.config import ConfigError, ModelSpec, pins_fraction
from freetoken_agent.engine.experts.adaptive import AdaptiveFetches
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.cpu_branch import stage_hidden
from freetoken_agent.engine.experts.cpu_share import CpuShare
from freetoken_agent.engine.experts.device_path import DevicePath
from freetoken_agent.engine.experts.direct import RoutedLog, direct_ids, learn_after_step
from freetoken_agent.engine.experts.graph_decode import GraphDecode
from freetoken_agent.engine.experts.graph_io import GraphIO
from freetoken_agent.engine.experts.miss_placement import MissPlacement
from freetoken_agent.engine.experts.offload_stats import OffloadStats
from freetoken_agent.engine.experts.policy import (
    DEVICE_PATH_POLICIES,
    WHOLE_STEP_POLICIES,
    Bandwidths,
)
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.popular_pins import PopularPins
from freetoken_agent.engine.experts.streaming import (
    STREAMED_MOE_PAIRS,
    LayerStreamer,
    ring_slots,
)
from freetoken_agent.engine.l2_prefetcher import L2Prefetcher
from freetoken_agent.kernels.cpu.experts import default_threads as cpu_kernel_threads
from freetoken_agent.kernels.expert_fills import COPY_PROGRAMS
from freetoken_agent.kernels.fused_moe import PATH_LIMITS, fused_moe

log = logging.getLogger("freetoken.experts")

# T tokens, K top-k, H hidden, E experts per layer, N = L * E lids

# Policies direct and gpu-fill read misses from the pool in the decode kernels, which take
# this many (token, expert) pairs at most; longer eager chunks (below stream_min_tokens) fill
# instead, as transfer does.
DIRECT_MAX_PAIRS = PATH_LIMITS["decode_max_pairs"]


def decode_graph_kind(policy: str, device_path_ok: bool = True) -> str:
    """Which decode graphs a policy is captured with (runner.enable_cuda_graphs): one graph a
    step, each whole-step policy with its own layer path (the policy's name); both of
    adaptive's paths (`paths`, when the device path can run); or `segmented`."""
    if policy in WHOLE_STEP_POLICIES:
        return policy
    return "paths" if policy == "adaptive" and device_path_ok else "segmented"


def lends_staging(n_slots: int, n_experts: int, n_buffers: int, n_rows: int) -> bool:
    """Whether the prefill streamer's ring borrows cache slots (streaming.py): when, beside
    the lent ring, at least one layer's worth of slots stays in service, and the cache does not
    hold every expert anyway (then lending would only evict experts that never need to move)."""
    return ring_slots(n_experts, n_buffers) + n_experts <= n_slots < n_rows


class OffloadedExpertBank(GraphDecode):
    def __init__(
        self,
        spec: ModelSpec,
        pool: ExpertPool,
        n_slots: int,
        device: torch.device,
        policy: str,
        bandwidths: Bandwidths | None = None,
        stream_min_tokens: int = 512,  # EngineConfig.stream_min_tokens
        double_buffer: bool = True,
        arena: ElasticArena | None = None,
        fill_behind: bool = False,
        popular_pins: float | None = None,
        fill_through: bool = False,
        split_expert: bool = False,
        copy_programs: int = COPY_PROGRAMS,
    ) -> None:
        """`arena`: the slots are the arena's (engine/arena.py; `n_slots` then comes from its
        boundary), so the memory manager can resize the cache at runtime. `fill_behind`:
        EngineConfig.fill_behind (AdaptiveFetches.behind). `popular_pins`: EngineConfig's,
        the fraction of slots the device path pins for their use (popular_pins.py; None: the
        default, POPULAR_PINS).
        `fill_through`, `split_expert`: EngineConfig's (device_path.py, split_expert.py).
        `copy_programs`: the device path's copy kernel grid (placement.py resolves it)."""
        self.spec = spec
        self.n_experts = spec.n_experts
        self.pool = pool
        self.cache = ExpertCache(pool, n_slots, device, lids_per_layer=spec.n_experts, arena=arena)
        self.device = device
        self.policy = policy
        self.fill_behind = fill_behind
        self.fill_through = fill_through
        self.split_expert = split_expert  # read when the CPU worker starts (`ready`)
        self.copy_programs = copy_programs
        self.bandwidths = bandwidths or Bandwidths()
        # Policy adaptive's choice of fetches (adaptive.py).
        # Decode tokens a layer's device-side fills serve at most: the decode kernels read
        # the pool for at most DIRECT_MAX_PAIRS pairs (16 tokens at top-8). Whole-step graphs
        # hold batches up to it; adaptive's device path too (step_paths.py).
        self.device_tokens = DIRECT_MAX_PAIRS // spec.top_k
        self.adaptive = AdaptiveFetches(self.cache, spec.n_moe_layers, self.device_tokens)
        self._stats = OffloadStats()
        self.cache.on_device.stats = self._stats
        self.graph_io: GraphIO | None = None  # set when decode graphs are captured
        # Set while a whole-step graph captures: its layers then record gpu-fill's kernels
        # (under direct, direct's path; adaptive's segmented graphs record the stops).
        self.whole_step_capture = False
        # Whether the device path (policy gpu-fill, adaptive's `device`) can run: the kernels
        # read the pool over the link, so on CUDA it must be pinned (`ready`).
        self.device_path_ok = device.type != "cuda"
        # Policy gpu-fill's and adaptive's device paths, with the CPU worker (`ready`).
        self.device_path = DevicePath(self)
        # Where the host's decisions place a layer's misses (`_place`), static's layout too.
        self.placement = MissPlacement(self)
        self.popular: PopularPins | None = None
        self.use_popular_pins(popular_pins)
        # Only what the user asked for (None: the default, on for every policy).
        chosen_pins = popular_pins is not None and popular_pins > 0
        unused = [name for name, on in (("fill_through", fill_through),
                                        ("popular_pins", chosen_pins),
                                        ("split_expert", split_expert)) if on]  # fmt: skip
        if unused and policy not in DEVICE_PATH_POLICIES:
            log.warning("%s: no effect under policy %s, only on the device paths (gpu-fill, "
                        "adaptive)", " and ".join(unused), policy)  # fmt: skip
        self._hits: list[list[int]] = []  # graph decode: hits awaiting bookkeeping (flush_hits)
        self.routed = RoutedLog()  # direct: the eager step's routing, for after_step
        self.l2: L2Prefetcher | None = None  # EngineConfig.l2_prefetch (use_l2_prefetch)
        self.stream_min_tokens = stream_min_tokens
        buffers = 2 if double_buffer else 1
        self.streamer = LayerStreamer(
            pool,
            self.cache,
            spec.n_experts,
            spec.n_moe_layers,
            device,
            double_buffer,
            lend=lends_staging(self.cache.n_slots, spec.n_experts, buffers, pool.n_rows),
        )

    # --- what the loader and the engine see ------------------------------------------------
    @property
    def stats(self) -> OffloadStats:
        """The counters; under gpu-fill the device's are added first (one sync)."""
        if self.cache.on_device.owned:
            self.cache.on_device.fold()
        return self._stats

    @stats.setter
    def stats(self, stats: OffloadStats) -> None:
        self._stats = self.cache.on_device.stats = stats

    @property
    def w13(self) -> torch.Tensor:
        return self.pool.w13

    @property
    def w2(self) -> torch.Tensor:
        return self.pool.w2

    def projection(self, layer: int, expert: int, proj: str) -> torch.Tensor:
        return self.pool.projection(layer, expert, proj, self.n_experts)

    @property
    def min_slots(self) -> int:
        """The fewest slots `cache.resize` may leave: a streamer that lends its ring needs
        the smallest ring plus one layer in service (`lends_staging`); otherwise one slot. Not
        the last chunk's ring, which may have held whole layers (`widest_group`): the floor
        would have jumped with it, and a chunk's ring only widens where the slots allow."""
        s = self.streamer
        return ring_slots(self.n_experts, s.n_buffers) + self.n_experts if s.lend else 1

    @property
    def nbytes(self) -> int:
        """Device bytes the experts take: the slots and the streaming buffers."""
        return self.cache.nbytes + self.streamer.nbytes

    def ready(self) -> None:
        """After the pool is loaded: pin it (CUDA) and make the static placement. The CPU
        kernel's thread count is settled here, so a bad FREETOKEN_CPU_THREADS fails the load,
        not a decode step."""
        try:
            cpu_kernel_threads()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        pinned = self.device.type != "cuda" or self.pool.pin()
        self.device_path_ok = pinned
        if not pinned and self.policy in WHOLE_STEP_POLICIES:
            raise ConfigError(
                f"policy {self.policy!r} reads experts from pinned host memory, but the expert "
                "pool could not be pinned on this machine; load with policy='adaptive'"
            )
        if not pinned:  # adaptive without a device path: no path trials (reset_decisions)
            self.reset_decisions()
        if self.policy == "static":
            self.place_static()
        if self.policy == "adaptive":
            self.start_cpu_share()
        self.stats = OffloadStats()
        self.cache.clear_counters()

    def place_static(self, protect: frozenset[int] | set[int] = frozenset()) -> None:
        """`static`: the last layers whole, as many as the slots in service hold
        (MissPlacement.place_static)."""
        self.placement.place_static(protect)

    # --- one MoE layer ----------------------------------------------------------------------
    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int32 expert ids within the layer
        topk_weights: torch.Tensor,  # [T, K] fp32
    ) -> torch.Tensor:
        if self.graph_io is not None and self.graph_io.active:
            return self._captured(layer, hidden, topk_ids, topk_weights)
        self.flush_hits()  # a graph step that failed midway may have left some
        if hidden.shape[0] >= self.stream_min_tokens:
            return self._streamed(layer, hidden, topk_ids, topk_weights)
        self.streamer.release()  # a streamed chunk that failed midway still held slots
        lids = topk_ids.long() + layer * self.n_experts  # [T, K]
        if self.policy == "direct" and lids.numel() <= DIRECT_MAX_PAIRS:
            self.routed.add(lids)  # misses read from the pool; the cache learns after the step
            return self._direct(hidden, lids, topk_weights)
        if lids.numel() <= DIRECT_MAX_PAIRS and self.device_path.takes(hidden.shape[0]):
            return self._gpu_fill(layer, hidden, topk_ids, topk_weights, lids.numel())
        self.cache.inflight.settle()  # the table as the mirror has it (direct's late fills)
        uniq, counts = torch.unique(lids, return_counts=True)
        uniq_l, counts_l = uniq.tolist(), counts.tolist()  # the host decides (one sync)
        misses = self._misses(uniq_l, counts_l, lids.numel())
        # The CPU branch needs the activations: start their copy before the fills.
        staged = stage_hidden(hidden) if misses and self.policy != "transfer" else None

        def cpu_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hidden_cpu, ready = staged if staged is not None else stage_hidden(hidden)
            if ready is not None:
                ready.synchronize()
            return hidden_cpu, lids.cpu(), topk_weights.cpu()

        part, fetched = self._place(misses, uniq_l, cpu_inputs, hidden.shape[0])
        self.cache.publish(fetched)
        rows = self.cache.slot_of[lids]  # [T, K] slot, -1 where the expert runs on the CPU
        # Chunks below the streaming threshold wait on their fills: the kernel's buffers stay
        # within what the workspace was sized for (placement.workspace_bytes).
        add = None if part is None else part.to(hidden.device, non_blocking=True)
        return fused_moe(hidden, self.cache.w13, self.cache.w2, rows, topk_weights,
                         max_pairs=STREAMED_MOE_PAIRS, add=add)  # fmt: skip

    def _misses(self, uniq: list[int], counts: list[int], n_pairs: int) -> list[tuple[int, int]]:
        """Visit the layer (`_visited`); returns its misses as (tokens served, lid), the ones
        serving the most tokens first: fetched first, they save the most CPU work."""
        slot_of = self.cache.host_slot_of
        misses = [(c, lid) for lid, c in zip(uniq, counts, strict=True) if slot_of[lid] < 0]
        if max(counts, default=1) > 1:  # else `uniq`'s order (sorted lids) is already it
            misses.sort(key=lambda x: (-x[0], x[1]))
        self._visited(uniq, n_pairs, len(misses))
        return misses

    def _visited(self, uniq: list[int], n_pairs: int, n_misses: int) -> None:
        """One layer's visit, its distinct lids `uniq` serving `n_pairs` pairs: the cache's
        LRU moves and race visits (`touch`), and the counts."""
        self.cache.touch(uniq)
        st = self.stats
        st.pairs += n_pairs
        st.experts += len(uniq)
        st.hits += len(uniq) - n_misses

    def _place(
        self,
        misses: list[tuple[int, int]],
        uniq: list[int],
        cpu_inputs,
        n_tokens: int,
        after_compute: bool = True,
        into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Place a layer's misses (MissPlacement.place): the eager path's and `resolve`'s."""
        return self.placement.place(misses, uniq, cpu_inputs, n_tokens, after_compute, into)

    def decode_step_timed(self, n_tokens: int, seconds: float) -> None:
        """The runner's wall time of a decode-only step of `n_tokens` tokens (its sampled
        tokens read back, so the device work is done): adaptive learns its split from it."""
        if self.policy == "adaptive":
            self.adaptive.step_timed(n_tokens, seconds)

    def reset_decisions(self) -> None:
        """Forget what adaptive learnt of the fill race and the split modes (the benchmark,
        between measurements from an empty cache)."""
        # (no device path, no path trials: a pool that could not be pinned takes the stops)
        tokens = self.device_tokens if self.device_path_ok else 0
        every = self.adaptive.cpu_all_misses  # a setting, not something learnt: kept
        self.adaptive = AdaptiveFetches(self.cache, self.spec.n_moe_layers, tokens)
        self.adaptive.cpu_all_misses = every
        self.device_path.offer_paths(self.adaptive)
        self.cache.kept_layers = frozenset()
        if self.popular is not None:
            self.popular.reset()

    def use_popular_pins(self, fraction: float | None) -> None:
        """EngineConfig.popular_pins' pins for the device path, if this policy runs it and it
        has none yet (the benchmarks switch `policy` in place after loading under transfer).
        None: the default fraction, POPULAR_PINS."""
        fraction = pins_fraction(fraction)
        if self.popular is None and fraction > 0 and self.policy in DEVICE_PATH_POLICIES:
            self.popular = PopularPins(self.cache.on_device, self.n_experts, fraction)

    # --- policy direct (direct.py) ---------------------------------------------------------
    def _direct(self, hidden: torch.Tensor, lids: torch.Tensor, weights: torch.Tensor):
        """The layer's experts from their slots, the missing ones read from the pool (pinned:
        `ready` refuses to load direct without it)."""
        ids = direct_ids(self.cache.slot_of, lids)
        return fused_moe(hidden, self.cache.w13, self.cache.w2, ids, weights,
                         host_w13=self.pool.w13, host_w2=self.pool.w2)  # fmt: skip

    # --- between steps ---------------------------------------------------------------------
    def after_step(self, graph_tokens: int | None) -> None:
        """Between steps (the runner calls it after every step): policy direct learns from
        the step's routing (direct.py `learn_after_step`); the other policies decided within
        the step. The CPU worker's timings go into B_H; a worker that failed raises here
        (cpu_share.py), once."""
        self.flush_hits()
        if self.policy == "direct":
            learn_after_step(self, graph_tokens)
        self.device_path.after_step()
        if self.popular is not None:
            self.popular.after_step()

    def close(self) -> None:
        """Stop what runs beside the engine (the CPU worker); Engine.close calls it before the
        pool it reads goes."""
        self.device_path.close()

    # --- the device path (device_path.py) --------------------------------------------------
    @property
    def cpu_share(self) -> CpuShare | None:
        return self.device_path.cpu_share

    def start_cpu_share(self) -> None:
        self.device_path.start_share()

    def before_whole_step(self, n_tokens: int | None) -> None:
        self.device_path.before_whole_step(n_tokens)

    def _gpu_fill(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                  weights: torch.Tensor, live_pairs: int | None) -> torch.Tensor:  # fmt: skip
        return self.device_path.layer(layer, hidden, topk_ids, weights, live_pairs)

    def _streamed(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Long chunks: resident experts in their slots, every absent one streamed
        (streaming.py)."""
        out = self.streamer.moe(layer, hidden, topk_ids, topk_weights)
        self.stats.pairs += topk_ids.numel()
        return out

    def check_integrity(self) -> None:
        self.flush_hits()
        self.cache.check_integrity()
