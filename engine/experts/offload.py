"""The offloaded expert bank: experts in the CPU pool, a GPU slot cache in front of it.

Per MoE layer and step: route (done by the block), deduplicate the (token, choice) pairs into
the layer's distinct experts, look them up; hits run on the device from their slots; of the m
misses, the policy's q are filled into slots (evicting least-recently-used experts that this
layer does not need) and run on the device too, the other m - q run on the CPU straight from the
pool. The two partial sums (each over the pairs it owns, routing-weighted) are added. Which
branch computes a pair never changes what is computed: the same SwiGLU in fp32 from the same
bf16/fp32 weights, so every placement agrees with the all-resident run within float rounding.

`static` is the fixed placement of KTransformers and llama.cpp's `--n-cpu-moe`: whole layers,
from the last backwards, fill the slots at load and stay; every other expert runs on the CPU.

This version decides on the host (one sync per layer) and runs the CPU branch after the device
branch is queued; graph-captured routing control, the concurrent CPU executor and full-layer
prefill streaming are the next steps (DESIGN section 1, idea 2; issue 3).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from freetoken_agent.engine.config import ModelSpec
from freetoken_agent.engine.experts import calibration
from freetoken_agent.engine.experts.cache import ExpertCache
from freetoken_agent.engine.experts.policy import Bandwidths, fetch_count
from freetoken_agent.engine.experts.pool import ExpertPool
from freetoken_agent.engine.experts.streaming import LayerStreamer
from freetoken_agent.kernels.fused_moe import fused_moe

# T tokens, K top-k, H hidden, E experts per layer, N = L * E lids


@dataclass(slots=True)
class OffloadStats:
    """Counters since the last reset, read by `engine.stats()` and the benchmarks."""

    pairs: int = 0  # (token, choice) pairs routed
    experts: int = 0  # distinct (layer, expert) per step, summed
    hits: int = 0
    fetched: int = 0
    on_cpu: int = 0

    @property
    def miss_rate(self) -> float:
        return 1.0 - self.hits / self.experts if self.experts else 0.0


class OffloadedExpertBank:
    def __init__(
        self,
        spec: ModelSpec,
        pool: ExpertPool,
        n_slots: int,
        device: torch.device,
        policy: str,
        bandwidths: Bandwidths | None = None,
        stream_min_tokens: int = 256,
        double_buffer: bool = True,
    ) -> None:
        self.spec = spec
        self.n_experts = spec.n_experts
        self.pool = pool
        self.cache = ExpertCache(pool, n_slots, device)
        self.device = device
        self.policy = policy
        self.bandwidths = bandwidths or Bandwidths()
        self.stats = OffloadStats()
        self.stream_min_tokens = stream_min_tokens
        self.streamer = LayerStreamer(
            pool, self.cache, spec.n_experts, spec.n_moe_layers, device, double_buffer
        )

    # --- what the loader and the engine see ------------------------------------------------
    @property
    def w13(self) -> torch.Tensor:
        return self.pool.w13

    @property
    def w2(self) -> torch.Tensor:
        return self.pool.w2

    def projection(self, layer: int, expert: int, proj: str) -> torch.Tensor:
        return self.pool.projection(layer, expert, proj, self.n_experts)

    @property
    def nbytes(self) -> int:
        """Device bytes the experts take: the slots and the streaming buffers."""
        return self.cache.nbytes + self.streamer.nbytes

    def ready(self) -> None:
        """After the pool is loaded: pin it (CUDA) and make the static placement."""
        if self.device.type == "cuda":
            self.pool.pin()
        if self.policy == "static":
            self.place_static()
        self.stats = OffloadStats()
        self.cache.clear_counters()

    def place_static(self) -> None:
        """`static`: fill the slots with whole layers, last layer first, and keep them."""
        lids = []
        for layer in reversed(range(self.spec.n_moe_layers)):
            layer_lids = list(range(layer * self.n_experts, (layer + 1) * self.n_experts))
            if len(lids) + len(layer_lids) > self.cache.n_slots:
                break
            lids += layer_lids
        self.cache.preload(lids, pin=True)

    # --- one MoE layer ----------------------------------------------------------------------
    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int32 expert ids within the layer
        topk_weights: torch.Tensor,  # [T, K] fp32
    ) -> torch.Tensor:
        if hidden.shape[0] >= self.stream_min_tokens:
            return self._streamed(layer, hidden, topk_ids, topk_weights)
        lids = topk_ids.long() + layer * self.n_experts  # [T, K]
        uniq, counts = torch.unique(lids, return_counts=True)
        uniq_l, counts_l = uniq.tolist(), counts.tolist()  # the host decides (one sync)
        cache = self.cache
        cache.touch(uniq_l)
        pairs = zip(uniq_l, counts_l, strict=True)
        misses = [(c, lid) for lid, c in pairs if not cache.resident(lid)]
        # Fetch the misses that serve the most tokens first: they save the most CPU work.
        misses.sort(key=lambda x: (-x[0], x[1]))
        self._observe_fills()
        q = fetch_count(self.policy, len(misses), self.bandwidths)
        # The CPU branch needs the activations: start their copy before queueing the device
        # branch, so the device computes its experts while the host computes the others.
        staged = self._stage_hidden(hidden) if q < len(misses) else None
        fetched = cache.fill([lid for _, lid in misses[:q]], protect=set(uniq_l))
        on_cpu = [lid for _, lid in misses if not cache.resident(lid)]
        if on_cpu and staged is None:
            staged = self._stage_hidden(hidden)
        st = self.stats
        st.pairs += lids.numel()
        st.experts += len(uniq_l)
        st.hits += len(uniq_l) - len(misses)
        st.fetched += len(fetched)
        st.on_cpu += len(on_cpu)
        rows = cache.slot_of[lids]  # [T, K] slot, -1 where the expert runs on the CPU
        out = fused_moe(hidden, cache.w13, cache.w2, rows, topk_weights)
        if on_cpu:
            out = out + self._run_on_cpu(staged, lids, topk_weights, on_cpu).to(out.dtype)
        return out

    def _stage_hidden(self, hidden: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying the activations to host memory; returns (host tensor, ready event)."""
        if hidden.device.type != "cuda":
            return hidden, None
        host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        host.copy_(hidden, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _observe_fills(self) -> None:
        """Fold finished fills into the B_P estimate (online re-estimation)."""
        timings = self.cache.fill_timings
        done = [f for f in timings if f[1].query()]
        for start, end, nbytes in done:
            seconds = start.elapsed_time(end) / 1e3
            self.bandwidths.pcie = calibration.update(self.bandwidths.pcie, nbytes, seconds)
        self.cache.fill_timings = [f for f in timings if f not in done]

    def _streamed(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Long chunks: the whole layer from a staging buffer, the next layer copying behind."""
        w13, w2 = self.streamer.weights(layer)  # [E, 2I, H], [E, H, I]
        out = fused_moe(hidden, w13, w2, topk_ids, topk_weights)
        self.streamer.done(layer)
        self.stats.pairs += topk_ids.numel()
        return out

    def _run_on_cpu(
        self,
        staged: tuple[torch.Tensor, object],
        lids: torch.Tensor,
        topk_weights: torch.Tensor,
        on_cpu: list[int],
    ) -> torch.Tensor:
        """The pairs whose expert stays in the pool, computed from the pool on the CPU while
        the device computes the rest; times itself to re-estimate B_H."""
        cpu_lids = lids.cpu()
        weights = topk_weights.cpu()
        mask = torch.isin(cpu_lids, torch.tensor(on_cpu, dtype=cpu_lids.dtype))
        rows = torch.where(mask, cpu_lids, -1)  # [T, K] pool rows, -1 elsewhere
        hidden, ready = staged
        if ready is not None:
            ready.synchronize()
        start = time.perf_counter()
        part = calibration.cpu_experts(hidden.cpu(), self.pool.w13, self.pool.w2, rows, weights)
        if lids.device.type == "cuda":
            nbytes = len(on_cpu) * self.pool.expert_bytes
            seconds = time.perf_counter() - start
            self.bandwidths.cpu = calibration.update(self.bandwidths.cpu, nbytes, seconds)
        return part.to(lids.device, non_blocking=True)  # [T, H]

    def check_integrity(self) -> None:
        self.cache.check_integrity()
