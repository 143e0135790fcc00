"""Captured decode graphs for an offloaded expert bank: one segment per MoE layer.

Which experts a decode step misses is known only after each layer's router has run, and the
misses must be fetched or run on the CPU before that layer's experts are summed. So the step's
graph is captured in segments cut inside each MoE layer, after its router:

    seg_0 = embed, layers up to MoE layer 0's router          -> exports routing of layer 0
    seg_j = experts of MoE layer j-1, ..., router of layer j  -> exports routing of layer j
    seg_L = experts of the last MoE layer, final norm

Between seg_j and seg_j+1 the host reads layer j's routing from pinned memory and places its
misses (`OffloadedExpertBank.resolve`). Waiting for every segment would leave the device idle
for the host's turn at each of the 48 layers, so the host runs ahead: it keeps up to `run_ahead`
segments queued beyond the one it checks, betting that the layers it has not checked yet miss
nothing. Most layers of most steps hit (the cache holds what routing reuses), and the bet costs
nothing then. When layer j did miss, the segments queued after seg_j computed with experts
absent; they are simply run again from seg_j+1 once the misses are in place. Running a segment
again is exact: every segment reads only static inputs and tensors kept alive from the segments
before it, and writes the same outputs (and the same KV slots) afresh.

Keeping those tensors alive is the one subtlety. The segments share one memory pool; a tensor
that seg_j+1 reads may have died during capture after seg_j+1 and been reused by seg_j+2, which
a re-run of seg_j+1 after a speculative seg_j+2 would then read corrupted. So while one batch
size is captured, every tensor produced is held (a dispatch mode keeps references), and no
memory is reused within a step. Different batch sizes share the pool as plain decode graphs do:
one step replays one size's segments only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from freetoken_agent.engine.cuda_graphs import OffloadedDecodeGraphs
from freetoken_agent.engine.experts.offload import OffloadedExpertBank
from freetoken_agent.engine.models.base import MoeCausalLM
from freetoken_agent.engine.recurrent_shadow import RecurrentShadow
from freetoken_agent.engine.runner import StepInputs

# B real sequences, Bp padded batch of a graph, L MoE layers (L + 1 segments)

# Segments queued beyond the one being checked. Each costs one segment of wasted device time
# when the checked layer misses, and hides the host's check (event wait, lookup, launch: tens
# of microseconds) behind device work when it does not. Two would hide a check shorter than one
# segment; four leaves room for the host's jitter. The bet is placed layer by layer: a segment
# is queued ahead only past layers that missed in fewer than half of the recent steps (a
# running average per layer), so layers whose experts live on the CPU (`static`) or that miss
# under near-uniform routing stop the run-ahead, and layers that hit let it through.
RUN_AHEAD = 4
MISS_EMA = 0.1  # weight of the newest step in each layer's running miss rate
# Run ahead past a layer whose running miss rate is below this (`miss_gate`): a bet lost costs
# the segments queued after it (run again once its misses are placed), a bet won hides the
# host's check. Under Zipf routing many layers miss in some steps and hit in others.
MISS_GATE = 0.5


class _KeepAlive(TorchDispatchMode):
    """Holds a reference to every tensor an op returns, so the allocator reuses none of them."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.held.append(out)
        return out


def _abort_capture(graph: torch.cuda.CUDAGraph) -> None:
    """End the capture a failure interrupted: a stream left capturing fails every later
    launch on it (the engine then retries the capture or decodes without graphs). The driver
    refuses to end an invalidated capture cleanly; the failure that invalidated it is the one
    worth raising, so this one is dropped."""
    if torch.cuda.is_current_stream_capturing():
        with contextlib.suppress(RuntimeError):
            graph.capture_end()


class SegmentedDecodeGraphs(OffloadedDecodeGraphs):
    miss_gate = MISS_GATE  # per instance where a benchmark sweeps it

    def __init__(
        self,
        model: MoeCausalLM,
        bank: OffloadedExpertBank,
        page_size: int,
        max_batch: int,
        max_pages: int,
        device: torch.device,
        run_ahead: int = RUN_AHEAD,
        shadow: RecurrentShadow | None = None,
    ) -> None:
        self.run_ahead = run_ahead
        self.shadow = shadow  # hybrid models running ahead: the state to re-run from
        self.segments: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.reruns = 0  # segments launched again after a miss (a measure of wasted work)
        # Host seconds spent waiting for layers' routing: the step's device-bound share (a
        # step that got slower on the device waits longer here; one slower on the host not).
        self.wait_s = 0.0
        self.missed_layers = 0  # layers that had a miss to place (each a stall of the step)
        self.miss_rate = [0.0] * bank.spec.n_moe_layers  # per MoE layer, running average
        super().__init__(model, bank, page_size, max_batch, max_pages, device)
        n = len(next(iter(self.segments.values())))
        assert n == bank.spec.n_moe_layers + 1, "every MoE layer must end one segment"
        self.done = [torch.cuda.Event() for _ in range(n)]

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.io.active = True
        try:
            with torch.cuda.stream(stream):
                for bs in reversed(self.sizes):
                    self.model(self.input_ids[:bs], self._meta(bs))  # warm-up, unsplit
                    self.segments[bs] = self._capture_segments(bs, pool)
                    self.io.cpu_part.zero_()  # the warm-up and capture added nothing real
        finally:
            self.io.active = False
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _capture_segments(self, bs: int, pool) -> list[torch.cuda.CUDAGraph]:
        """One step at padded batch `bs`, captured as L + 1 graphs (the bank calls `split`)."""
        segments: list[torch.cuda.CUDAGraph] = []

        def begin() -> None:
            segments.append(torch.cuda.CUDAGraph())
            segments[-1].capture_begin(pool=pool)

        def split() -> None:
            segments[-1].capture_end()
            begin()

        self.io.split = split
        try:
            with _KeepAlive():
                begin()
                try:
                    self.outputs[bs] = self.model(self.input_ids[:bs], self._meta(bs))
                except BaseException:
                    _abort_capture(segments[-1])
                    raise
                segments[-1].capture_end()
        finally:
            # The next size's warm-up runs unsplit: a stale hook would end a finished graph.
            self.io.split = lambda: None
        return segments

    def _stream(self):
        return torch.cuda.current_stream(self.device)

    def replay(self, inputs: StepInputs, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one decode step, placing each MoE layer's misses between its segments; returns
        hidden states [B, H] (valid until the next replay). `between`: called once, when the
        first segments are queued, before the host waits for layer 0's routing (overlap
        scheduling completes the previous step there)."""
        b, bs = self._load(inputs)
        self._before_replay(b, bs)
        self.bank.settle_fills()  # the last step's fills behind, before any segment reads
        segments, done = self.segments[bs], self.done
        # The stream the segments replay on, looked up once: Event.record() without one looks
        # it up per call, ~5 us of Python each (41 a step).
        stream = self._stream()
        n_layers = len(segments) - 1
        launched = 0  # segments queued (in order) for this step's current attempt
        rate = self.miss_rate
        if self.shadow is not None:
            self.shadow.save(self.state_slots[:bs])
        for layer in range(n_layers):
            # seg_k computes layer k-1's experts: queueing it bets that layer k-1 hits.
            while (
                launched < len(segments)
                and launched <= layer + self.run_ahead
                and (launched <= layer or rate[launched - 1] < self.miss_gate)
            ):
                segments[launched].replay()
                done[launched].record(stream)
                launched += 1
            if between is not None:
                between()
                between = None
            t0 = time.perf_counter()
            done[layer].synchronize()  # seg_layer exported this layer's routing
            self.wait_s += time.perf_counter() - t0
            missed = self.bank.resolve(layer, b)
            rate[layer] += MISS_EMA * (missed - rate[layer])
            if missed:
                self.missed_layers += 1
                self.reruns += launched - (layer + 1)
                if self.shadow is not None:  # recurrent layers that ran ahead: back to start
                    self.shadow.restore(layer + 1, launched)
                launched = layer + 1  # what ran after it computed without its misses
        while launched < len(segments):
            segments[launched].replay()
            launched += 1
        if between is not None:  # no MoE layer stopped the host
            between()
        # The hits' bookkeeping, while the device runs the segments still queued (and before
        # anything between steps reads the cache: the safe point's elastic split).
        self.bank.flush_hits()
        return self.outputs[bs][:b]
