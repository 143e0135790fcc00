"""The offloaded bank's device path: a MoE layer that places its own misses on the device.

Policy gpu-fill runs it for every decode step, adaptive for the steps its PathTrials hold on
`device`, `shared` or `split` (step_paths.py). Per layer: the plan (kernels/expert_fills.py)
looks the layer's lids up and gives each miss a victim slot, or, on the shared path, sends the
CPU worker its share of them (cpu_share.py), or, on the split path, cuts each fill between the
link and the worker (split_expert.py); the copy kernel moves the link's share from the pinned
pool; the MoE kernels compute from the slots, and their sum over k waits for the worker's
answer and adds it.
With EngineConfig.fill_through and no CPU worker in the graph, there is no copy kernel: the MoE
kernels read each moved expert from the pool and store it into its slot as they go (a group
of more than 16 pairs on one moved expert reads it over the link once per 16). The cache
belongs to the device meanwhile (device_fills.py: `own`, `release`).

The bank keeps the state; this class is its device-path half (as GraphDecode is its half under
segmented graphs), split out to keep each file to one concept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.experts.cpu_share import CpuShare, CpuShareFailed
from freetoken_agent.engine.experts.policy import DEVICE_PATH_POLICIES
from freetoken_agent.engine.experts.split_expert import SplitExpert
from freetoken_agent.engine.experts.step_paths import CPU_PATHS, DEVICE_PATHS
from freetoken_agent.engine.l2_prefetcher import MOE_ROW_FRACTION
from freetoken_agent.kernels.expert_fills import copy_fills, plan_fills
from freetoken_agent.kernels.fused_moe import fused_moe
from freetoken_agent.kernels.l2_prefetch import prefetch_rows
from freetoken_agent.kernels.reference_fills import LIVE_PAIRS, CpuAnswer

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.adaptive import AdaptiveFetches
    from freetoken_agent.engine.experts.offload import OffloadedExpertBank

# T tokens, K top-k, H hidden


class DevicePath:
    def __init__(self, bank: OffloadedExpertBank) -> None:
        self.bank = bank
        # adaptive's `shared` path: the CPU worker's share of the device path (`start_share`).
        self.cpu_share: CpuShare | None = None
        # Set by the whole-step graph set being captured: whether its layers hold the post
        # and the answer (adaptive's `shared` set; direct_graphs.py).
        self.capture_share = False
        # adaptive's `split` path (`start_share`), and whether the set being captured cuts its
        # fills (its own graph set).
        self.split: SplitExpert | None = None
        self.capture_split = False

    def start_share(self) -> None:
        """adaptive's `shared` path: start the CPU worker, where the pool is pinned (or the
        device is the CPU) and the SIMD kernel is built. Decode graphs captured before it
        have no shared set: capture again after (the benchmark switching policies does)."""
        bank = self.bank
        # device_tokens is 0 past DIRECT_MAX_PAIRS experts a token (top-k > 128): no device
        # path, so no share of its misses either.
        served = bank.device_tokens > 0
        if self.cpu_share is None and served and bank.device_path_ok and CpuShare.possible():
            spec = bank.spec
            self.cpu_share = CpuShare(bank.pool, bank.device, bank.device_tokens, spec.top_k,
                                      spec.hidden_size)  # fmt: skip
            if bank.split_expert:  # EngineConfig.split_expert
                cache = bank.cache
                self.split = SplitExpert(cache.on_device, self.cpu_share, bank.pool, cache.w13,
                                         cache.w2)  # fmt: skip
        self.offer_paths(bank.adaptive)

    def offer_paths(self, adaptive: AdaptiveFetches) -> None:
        """Which of its paths adaptive may take: `shared` with a worker, `split` while its
        copies behind and worker hold (SplitExpert.check)."""
        adaptive.shared_ok = self.cpu_share is not None
        adaptive.split_ok = self.split is not None and self.split.check()

    def takes(self, n_tokens: int) -> bool:
        """Whether an eager call of `n_tokens` tokens takes the device path: always under
        gpu-fill, when adaptive holds `device`, `shared` or `split` for this batch size."""
        bank = self.bank
        if bank.policy == "gpu-fill":
            return True
        ok = bank.policy == "adaptive" and bank.device_path_ok
        return ok and bank.adaptive.path(n_tokens) in DEVICE_PATHS

    def layer(
        self,
        layer: int,
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        weights: torch.Tensor,  # [T, K]
        live_pairs: int | None,
    ) -> torch.Tensor:
        """The layer plans and copies its own fills on the device, then computes from the
        slots (a miss that found no slot from the pool). `live_pairs` None: a captured step,
        whose real pair count was written before the replay (`before_whole_step`)."""
        bank, share = self.bank, self.cpu_share
        cache, fills, pool = bank.cache, bank.cache.on_device, bank.pool
        if live_pairs is not None:
            fills.own()  # eager: a captured step was owned before its replay
            if layer == 0:
                self._set_share(hidden.shape[0])
        # On adaptive's `shared` path the layer posts the CPU's share (CPU_SHARE) and adds the
        # worker's answer; a captured step holds both for any share, in the shared set only.
        shared = self._posts(hidden.shape[0], live_pairs)
        post = share.post(hidden, weights) if shared else None
        # The split path cuts each fill; its CPU part comes back through the same post.
        split = self._splits(hidden.shape[0], live_pairs)
        tables = cache.on_device.split if split else None
        uses = bank.popular.uses if bank.popular is not None else None
        # EngineConfig.fill_through: a moved expert's pairs read it from the pool and the MoE
        # kernels store it into its slot as they go, with no copy kernel. Not with the CPU's
        # share: not measured there (the summing kernel's wait would come after fills made
        # inside the MoE kernels, as it comes after the copy kernel's).
        through = bank.fill_through and not shared
        rows = plan_fills(topk_ids, layer * bank.n_experts, cache.slot_of, fills.lid_of,
                          fills.stamp, fills.state, fills.moves, live_pairs, post,
                          uses=uses, through=through, split=tables)  # fmt: skip
        prefetch = bank.l2 is not None and not through  # (beside the fill copy: none here)
        if prefetch:  # the rows' gate/up lines into L2 beside the fill copy
            bank.l2.start(prefetch_rows, cache.w13, rows, MOE_ROW_FRACTION)
        if not through:
            copy_fills(fills.state, fills.moves, pool.w13, pool.w2, cache.w13, cache.w2,
                       split=split, programs=bank.copy_programs)  # fmt: skip
        if prefetch:
            bank.l2.join(hidden.device)
        # The worker's answer is waited for by the MoE sum over k, after the copies and the
        # MoE kernels of the slots' experts, which run while the worker computes.
        collect = CpuAnswer(fills.state, share.box, share.timeout_s, split) if shared else None
        # rows_settled: the plan wrote the rows, and the copy kernel runs between it and the
        # MoE kernels (FREETOKEN_PDL's `prefetch` may then read them early; not with
        # fill-through, where the plan is the kernel just before).
        return fused_moe(hidden, cache.w13, cache.w2, rows.view(topk_ids.shape), weights,
                         host_w13=pool.w13, host_w2=pool.w2, collect=collect,
                         rows_settled=not through, fill_slot_of=cache.slot_of if through else None,
                         slot_cols=tables.cols if split else None)  # fmt: skip

    def _posts(self, n_tokens: int, live_pairs: int | None) -> bool:
        """Whether a layer posts to the CPU worker: in a capture, as its graph set says; an
        eager call of `n_tokens` tokens while adaptive holds `shared` or `split` for them."""
        bank = self.bank
        if self.cpu_share is None or bank.policy != "adaptive":
            return False
        if live_pairs is None:
            return self.capture_share
        return bank.adaptive.path(n_tokens) in CPU_PATHS

    def _splits(self, n_tokens: int, live_pairs: int | None) -> bool:
        """Whether a layer cuts its fills (the `split` path): in a capture, as its graph set
        says; an eager call while adaptive holds `split` for `n_tokens` tokens."""
        if self.split is None or self.bank.policy != "adaptive":
            return False
        if live_pairs is None:
            return self.capture_split
        return self.bank.adaptive.path(n_tokens) == "split"

    def before_whole_step(self, n_tokens: int | None) -> None:
        """Before a whole-step graph replays `n_tokens` real tokens (None: before capture,
        whose warm-up must fill nothing): the device owns the cache and the plans learn how
        many pairs are real, and adaptive's share for the step."""
        bank = self.bank
        if bank.policy not in DEVICE_PATH_POLICIES:
            return
        fills = bank.cache.on_device
        fills.own()
        pairs = 0 if n_tokens is None else n_tokens * bank.spec.top_k
        fills.state[LIVE_PAIRS : LIVE_PAIRS + 1].fill_(pairs)
        self._set_share(n_tokens)  # (gpu-fill: none, and the split path's copies drained)

    def _set_share(self, n_tokens: int | None) -> None:
        """The CPU's share for the next step of `n_tokens` tokens (None: a capture's warm-up,
        none): q*'s on adaptive's `shared` path, none on the others; on the `split` path the
        cut (split_expert.py), and on any other the split path's copies behind drained."""
        share, bank = self.cpu_share, self.bank
        if share is None:
            return
        adaptive = n_tokens is not None and bank.policy == "adaptive"
        path = bank.adaptive.path(n_tokens) if adaptive else None
        if path == "shared":
            value = share.fixed_share(bank.bandwidths, bank.adaptive.share_offset(n_tokens),
                                      bank.adaptive.held_share)  # fmt: skip
        else:
            value = 0
        # Where fills do not pay, a layer's share may take all its misses: the fill the bound
        # keeps (for the cache's learning, reference_fills.py) is evicted before its expert
        # comes back, and where the copy kernel reads the host more slowly than the CPU does
        # (34 GB/s against 150 on the sixty-first session's H100 host: the peer slice's
        # uniform b=1 kept the share at 0.85, one fill a layer) it sets the layer's pace.
        # Only once the race has judged (before, its gain reads 0, as if fills did not pay: a
        # held path never judges) and while the cache has no free slot (a fill into one evicts
        # nothing; the mirror's count is an upper bound while the device owns the cache).
        adaptive = bank.adaptive
        all_misses = (value > 0 and adaptive.cpu_all_misses and adaptive.fills_judged()
                      and not adaptive.fills_pay() and bank.cache.free_slots_seen == 0)  # fmt: skip
        bank.cache.on_device.set_share(value, all_misses)
        if self.split is not None:
            if path == "split" and share.broken is None:
                span = self.split.offset_span(bank.bandwidths)
                self.split.enter(bank.bandwidths, bank.adaptive.cut_offset(n_tokens, span))
            else:
                self.split.drain()
        if value or path == "split":
            share.wake()

    def after_step(self) -> None:
        """The CPU worker's timings into B_H; a worker that failed raises (cpu_share.py)."""
        if self.split is not None and self.bank.adaptive.split_ok and not self.split.check():
            self.bank.adaptive.drop_split()  # (the next step's drain evicts its slots)
        if self.cpu_share is not None:
            self.cpu_share.observe(self.bank.bandwidths)
            try:
                self.cpu_share.check()
            except CpuShareFailed:
                if self.bank.adaptive.split_ok:  # no more cut fills: nobody computes them
                    self.bank.adaptive.drop_split()
                raise

    def close(self) -> None:
        if self.split is not None:
            self.split.close()
        if self.cpu_share is not None:
            self.cpu_share.close()
