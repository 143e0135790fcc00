"""Captured CUDA graphs for decode steps.

A decode step of a 48-layer MoE launches hundreds of small kernels; launched one by one from
Python they cost far more than the bytes they move (DESIGN section 7: 397 us eager vs 160 us
graphed for one layer's eight experts). So decode batches of 1..max_batch sequences replay a
graph captured once per padded batch size.

Everything a graph reads lives in static buffers that each step overwrites: token ids,
positions, KV slots, page tables, KV lengths. Rows past the real batch are padding: they point
at the scratch page (never handed to a request) with a KV length of 1, so they compute garbage
that nobody reads and cannot corrupt a live sequence. The attention kernel's split count is
derived from `max_pages * page_size`, a Python int fixed at capture, so it needs no host sync.
Graphs hold raw pointers to the KV pool: whoever replaces the pool must capture again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from freetoken_agent.engine.graph_inputs import GraphInputs
from freetoken_agent.engine.layers.attention import AttentionMetadata
from freetoken_agent.engine.layers.recurrent import RecurrentMetadata
from freetoken_agent.engine.models.base import MoeCausalLM
from freetoken_agent.engine.runner import StepInputs

if TYPE_CHECKING:
    from freetoken_agent.engine.experts.offload import OffloadedExpertBank


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No cyclic garbage collection while graphs are captured: a collection runs finalizers,
    and an old engine's expert pool unregistering its pinned memory inside a capture is a call
    the driver forbids there. On the device that broke the capture and left the registration
    behind the freed memory, so the next pool's registration failed (error 712) and a copy
    from the reused addresses failed with "invalid argument"."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# B real sequences, Bp padded batch size of a graph, H hidden, Pm pages per sequence at most

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    def __init__(
        self,
        model: MoeCausalLM,
        page_size: int,
        max_batch: int,
        max_pages: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.max_pages = max_pages
        self.device = device
        sizes = [b for b in BATCH_SIZES if b < max_batch] + [max_batch]
        self.sizes = sorted(set(sizes))
        n = self.sizes[-1]
        # The step's inputs, in one block a step copies at once (graph_inputs.py); hybrid
        # models read each row's recurrent state slot (padding rows: the scratch slot 0).
        self.static_inputs = GraphInputs(n, max_pages, page_size, device)
        io = self.static_inputs
        self.input_ids, self.positions = io.input_ids, io.positions
        self.slot_mapping, self.page_table = io.slot_mapping, io.page_table
        self.kv_lens, self.state_slots = io.kv_lens, io.state_slots
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.recurrent = model.spec.is_hybrid
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:bs],
            slot_mapping=self.slot_mapping[:bs],
            page_table=self.page_table[:bs],
            cu_q_lens=self.cu_q_lens[: bs + 1],
            kv_lens=self.kv_lens[:bs],
            max_q_len=1,
            max_kv_len=self.max_pages * self.page_size,
            recurrent=(
                RecurrentMetadata(self.state_slots[:bs], None, None) if self.recurrent else None
            ),
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                meta = self._meta(bs)
                self.model(self.input_ids[:bs], meta)  # warm-up: compile/autotune outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = self.model(self.input_ids[:bs], meta)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def fits(self, inputs: StepInputs) -> bool:
        b = inputs.cu_q_lens.shape[0] - 1
        return b <= self.sizes[-1] and inputs.page_table.shape[1] <= self.max_pages

    def replay(self, inputs: StepInputs, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one decode step; returns hidden states [B, H] (a view of the graph's output,
        valid until the next replay). `between`: called once the graph is launched."""
        b, bs = self._load(inputs)
        self.graphs[bs].replay()
        if between is not None:
            between()
        return self.outputs[bs][:b]

    def _load(self, inputs: StepInputs) -> tuple[int, int]:
        """Copy the step's inputs into the static buffers; returns (batch, padded batch)."""
        b = inputs.cu_q_lens.shape[0] - 1
        bs = next(s for s in self.sizes if s >= b)
        self.static_inputs.load(inputs, bs)
        if inputs.device_ids is not None:  # overlap: the ids the last step sampled, on the device
            self.input_ids[:b].copy_(inputs.device_ids)
        return b, bs


class OffloadedDecodeGraphs(DecodeGraphs):
    """Decode graphs over an offloaded expert bank (segmented_graphs.py, direct_graphs.py):
    the bank's GraphIO buffers, through which the graphs hand each layer's routing to the
    host, and the benchmarks' hook that draws a step's routing before it replays."""

    def __init__(
        self,
        model: MoeCausalLM,
        bank: OffloadedExpertBank,
        page_size: int,
        max_batch: int,
        max_pages: int,
        device: torch.device,
    ) -> None:
        self.bank = bank
        self.io = bank.attach_graph_io(max_batch, model.embed_tokens.weight.dtype)
        super().__init__(model, page_size, max_batch, max_pages, device)

    @property
    def model_bank(self):
        """The bank the model's MoE blocks call (the offloaded bank, or a wrapper of it)."""
        return self.model.expert_bank

    def _before_replay(self, b: int, bs: int) -> None:
        before = getattr(self.model_bank, "before_graph_step", None)
        if before is not None:  # benchmark routing replays draw this step's routing
            before(b, bs)
