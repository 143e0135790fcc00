"""ModelRunner: executes a Batch: builds the step's tensors, runs the model, samples.

It holds the model, the KV pool and the per-request random generators; it decides nothing
about which tokens run (the Scheduler did). Decode-only batches on CUDA replay captured graphs
(see `cuda_graphs.py`); everything else runs eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from freetoken_agent.engine.constrained import allowed_tokens
from freetoken_agent.engine.kv.pool import SCRATCH_PAGE, KVPool
from freetoken_agent.engine.layers.attention import AttentionMetadata
from freetoken_agent.engine.layers.recurrent import RecurrentMetadata
from freetoken_agent.engine.layers.sampler import Sampled, sample
from freetoken_agent.engine.logits_processors import apply_processors, count_sampled
from freetoken_agent.engine.models.base import MoeCausalLM
from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.engine.prompt_logprobs import PromptEntries, chunk_entries, scored_rows
from freetoken_agent.engine.request import Batch, Request, ScheduledChunk, Status
from freetoken_agent.engine.thinking_budget import ThinkingMarkers
from freetoken_agent.engine.token_logprobs import attach, entries, raw_logprobs

# T tokens in the step, B chunks (sequences), S page size, V vocab


def generator_seed(seed: int) -> int:
    """The CPU generator's seed for a request's `seed` (any 64-bit value). torch's CPU generator
    keeps the low 32 bits of what it is given, so seeds that differ only above bit 31 drew the
    same numbers (a client's base + (run << 32) got one sample for every run; n choices seeded
    seed + i crossed into seed 0's). Seeds in [0, 2**32) are given as they are, their draws
    unchanged; any other is mixed down to 32 bits (splitmix64's finaliser over its 64 bits),
    so two distinct seeds draw alike only by chance (2**-32), not by structure."""
    z = seed % 2**64  # (-1 and 2**64 - 1 are the same 64 bits, as torch takes them)
    if z < 2**32:
        return z
    z = (z + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


@dataclass(slots=True)
class StepOutput:
    """What a step produced. Read by the Engine to update requests."""

    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # the asking ones' tokens
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # score requests: [n, V]
    # Requests asking for prompt_logprobs: their chunk's entries (prompt_logprobs.py).
    prompt_logprobs: dict[str, PromptEntries] = field(default_factory=dict)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass is enqueued (`ModelRunner.launch`): what sampling needs."""

    batch: Batch
    inputs: StepInputs
    hidden: torch.Tensor  # [T, H], or [B, H] from a graph (valid until the next replay)
    graphed: bool
    start: float  # perf_counter at launch


@dataclass(slots=True)
class StepInputs:
    """Host-side arrays of one step, before they move to the device."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    page_table: np.ndarray  # [B, max_pages] int32
    cu_q_lens: np.ndarray  # [B + 1] int32
    kv_lens: np.ndarray  # [B] int32
    max_q_len: int
    max_kv_len: int
    state_slots: np.ndarray  # [B] int64: each sequence's recurrent state row (0: none)
    snap_slots: np.ndarray | None  # [T] int64: checkpoint row written after token t, or -1
    # [T] int64 on the device: the token ids when the host does not know them yet (overlap
    # scheduling: the previous step's sampled tokens); `input_ids` then holds placeholders.
    device_ids: torch.Tensor | None = None


def build_inputs(chunks: list[ScheduledChunk], page_size: int) -> StepInputs:
    if all(len(c.token_ids) == 1 and not c.snapshots for c in chunks):
        return _decode_inputs(chunks, page_size)
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    kv_lens = np.array([c.start + len(c.token_ids) for c in chunks], dtype=np.int32)
    tables, page_table = _page_tables(chunks)
    positions, slots, ids = [], [], []
    for c, pages in zip(chunks, tables, strict=True):
        pos = np.arange(c.start, c.start + len(c.token_ids), dtype=np.int64)
        positions.append(pos)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
        ids.append(np.asarray(c.token_ids, dtype=np.int64))
    cu = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    snap_slots = None
    if any(c.snapshots for c in chunks):
        snap_slots = np.full(int(cu[-1]), -1, dtype=np.int64)
        for b, c in enumerate(chunks):
            for boundary, ckpt in c.snapshots:  # the state after token boundary - 1
                snap_slots[cu[b] + boundary - 1 - c.start] = ckpt.row
    return StepInputs(
        input_ids=np.concatenate(ids),
        positions=np.concatenate(positions),
        slot_mapping=np.concatenate(slots),
        page_table=page_table,
        cu_q_lens=cu,
        kv_lens=kv_lens,
        max_q_len=int(q_lens.max()),
        max_kv_len=int(kv_lens.max()),
        state_slots=np.array([c.request.state_slot for c in chunks], dtype=np.int64),
        snap_slots=snap_slots,
    )


def _decode_inputs(chunks: list[ScheduledChunk], page_size: int) -> StepInputs:
    """`build_inputs` for a step of one token per sequence (every decode step): the same
    arrays, from scalars, without the per-chunk arrays and concatenations of the general path
    (13 us against 59 at four requests and 1k tokens of context on this host); the page tables
    come from each request's cached array (`Request.page_array`)."""
    b, s = len(chunks), page_size
    tables, page_table = _page_tables(chunks)
    starts = [c.start for c in chunks]
    slots = [int(pages[p // s]) * s + p % s for p, pages in zip(starts, tables, strict=True)]
    positions = np.array(starts, dtype=np.int64)
    kv_lens = (positions + 1).astype(np.int32)
    return StepInputs(
        input_ids=np.array([c.token_ids[0] for c in chunks], dtype=np.int64),
        positions=positions,
        slot_mapping=np.array(slots, dtype=np.int64),
        page_table=page_table,
        cu_q_lens=np.arange(b + 1, dtype=np.int32),
        kv_lens=kv_lens,
        max_q_len=1,
        max_kv_len=int(kv_lens.max()),
        state_slots=np.array([c.request.state_slot for c in chunks], dtype=np.int64),
        snap_slots=None,
    )


def _page_tables(chunks: list[ScheduledChunk]) -> tuple[list[np.ndarray], np.ndarray]:
    """Each chunk's request's pages ([n_pages] int64, its cached `page_array`) and the step's
    page table [B, max pages] int32 of them, padded with the scratch page."""
    tables = [c.request.page_array() for c in chunks]
    page_table = np.full((len(chunks), max(1, *map(len, tables))), SCRATCH_PAGE, dtype=np.int32)
    for row, pages in zip(page_table, tables, strict=True):
        row[: len(pages)] = pages
    return tables, page_table


def to_device(
    inputs: StepInputs, device: torch.device, recurrent: bool = False
) -> tuple[torch.Tensor, AttentionMetadata]:
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    rec = None
    ids = inputs.device_ids if inputs.device_ids is not None else t(inputs.input_ids)
    if recurrent:
        decode = inputs.max_q_len == 1 and inputs.snap_slots is None
        rec = RecurrentMetadata(
            state_slots=t(inputs.state_slots),
            snap_slots=None if inputs.snap_slots is None else t(inputs.snap_slots),
            seq_bounds=None if decode else tuple(int(x) for x in inputs.cu_q_lens),
        )
    meta = AttentionMetadata(
        positions=t(inputs.positions),
        slot_mapping=t(inputs.slot_mapping),
        page_table=t(inputs.page_table),
        cu_q_lens=t(inputs.cu_q_lens),
        kv_lens=t(inputs.kv_lens),
        max_q_len=inputs.max_q_len,
        max_kv_len=inputs.max_kv_len,
        recurrent=rec,
    )
    return ids, meta


class ModelRunner:
    def __init__(
        self,
        model: MoeCausalLM,
        kv: KVPool,
        device: torch.device,
        seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
        thinking: ThinkingMarkers | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back (logits_processors.py)
        self.thinking = thinking  # what a thinking budget forces (thinking_budget.py)
        model.bind_kv_cache(kv.k, kv.v)
        # CPU generators: a CUDA step draws each row's noise seed from them on the host.
        self._default_generator = torch.Generator()
        self._default_generator.manual_seed(generator_seed(seed))
        self._generators: dict[str, torch.Generator] = {}
        self.graphs = None  # set by enable_cuda_graphs
        self.launched = 0  # forward passes enqueued (prefill and decode steps)
        # Called after each step with the tokens a graph replayed (None: an eager step): an
        # offloaded bank under policy direct learns from the step's routing there.
        self.after_step: Callable[[int | None], None] | None = None
        # Called with (tokens, seconds) after each decode-only step that sampled: adaptive
        # offloading measures its modes by it (engine/experts/split_trials.py).
        self.on_decode_step: Callable[[int, float], None] | None = None

    def enable_cuda_graphs(
        self, max_batch: int, max_pages: int, offloaded=None, states=None
    ) -> None:
        """Capture decode graphs; with an offloaded bank, segmented ones that stop for its
        decisions after each MoE layer's router (see segmented_graphs.py). `states`: a hybrid
        model's RecurrentStatePool, to run ahead with (EngineConfig.hybrid_run_ahead)."""
        from freetoken_agent.engine.cuda_graphs import DecodeGraphs
        from freetoken_agent.engine.direct_graphs import DirectDecodeGraphs
        from freetoken_agent.engine.experts.offload import WHOLE_STEP_POLICIES, decode_graph_kind
        from freetoken_agent.engine.path_graphs import PathDecodeGraphs
        from freetoken_agent.engine.recurrent_shadow import RecurrentShadow
        from freetoken_agent.engine.segmented_graphs import RUN_AHEAD, SegmentedDecodeGraphs

        page_size = self.kv.page_size
        if offloaded is None:
            self.graphs = DecodeGraphs(self.model, page_size, max_batch, max_pages, self.device)
            return
        kind = decode_graph_kind(offloaded.policy, offloaded.device_path_ok)

        def whole_step(cpu_share: bool = False, split: bool = False) -> DirectDecodeGraphs:
            # Batches past `device_tokens` exceed the kernels' pool reads: a whole-step policy
            # steps them eagerly, adaptive takes its stops path (path_graphs.py).
            whole_batch = min(max_batch, offloaded.device_tokens)
            return DirectDecodeGraphs(self.model, offloaded, page_size, whole_batch, max_pages,
                                      self.device, cpu_share, split)  # fmt: skip

        if kind in WHOLE_STEP_POLICIES:  # no host decision: one graph a step
            self.graphs = whole_step()
            return
        # Recurrent layers update their state in place, so a segment run again after a missed
        # layer would apply its tokens twice: hybrid models run ahead only with step-start
        # copies of that state to re-run from (recurrent_shadow.py).
        shadow = None
        if self.model.spec.is_hybrid and states is not None:
            shadow = RecurrentShadow(self.model.spec, states.conv, states.ssm)
        run_ahead = 0 if self.model.spec.is_hybrid and shadow is None else RUN_AHEAD
        self.graphs = SegmentedDecodeGraphs(
            self.model, offloaded, page_size, max_batch, max_pages, self.device, run_ahead,
            shadow,
        )  # fmt: skip
        if kind == "paths":  # adaptive's device paths (step_paths.py): two more sets
            shared = whole_step(cpu_share=True) if offloaded.cpu_share is not None else None
            split = None
            if offloaded.device_path.split is not None:
                split = whole_step(cpu_share=True, split=True)
            self.graphs = PathDecodeGraphs(self.graphs, whole_step(), shared, split)

    def _sampled_rows(
        self, hidden: torch.Tensor, inputs: StepInputs, sampling: list[int]
    ) -> torch.Tensor:
        """[B', H] the last row of each chunk in `sampling`. A decode step where every chunk
        samples (nearly every step) takes `hidden` as it is: an index list, its copy to the
        device and a gather were three host launches of every step."""
        n_chunks = inputs.cu_q_lens.shape[0] - 1
        if inputs.max_q_len == 1 and len(sampling) == n_chunks:
            return hidden  # [B, H]: one token per chunk, all sampled, in order
        last = inputs.cu_q_lens[1:].astype(np.int64) - 1  # [B] each chunk's last token
        return hidden[torch.from_numpy(last[sampling]).to(self.device)]

    def generator_for(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self._default_generator
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(generator_seed(seed))
            self._generators[request_id] = g
        return g

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def apply_copies(self, copies: list[tuple[int, int, int]]) -> None:
        for src, dst, n in copies:
            self.kv.copy_prefix(src, dst, n)

    @torch.inference_mode()
    def run(self, batch: Batch, masks: Mapping[str, np.ndarray] | None = None) -> StepOutput:
        """`masks`: packed allowed-id rows of constrained requests (see constrained.py), applied
        to their logits here, after the model (and any CUDA graph) and before sampling."""
        step = self.launch(batch)
        reqs, sampled = self.sample_tokens(step, masks)
        out = StepOutput()
        if sampled is not None:
            reported = sampled.reported.tolist()  # NOT_FINITE rows: the engine fails them
            out.sampled = {r.id: t for r, t in zip(reqs, reported, strict=True)}
            found = entries(sampled.logprobs, reported)  # the device is done with them too
            out.logprobs = {r.id: e for r, e in zip(reqs, found, strict=True) if e is not None}
        chunks, inputs = batch.chunks, step.inputs
        for i, c in enumerate(chunks):
            lo, hi = int(inputs.cu_q_lens[i]), int(inputs.cu_q_lens[i + 1])
            if c.request.score_only:
                out.logits[c.request.id] = self.model.compute_logits(step.hidden[lo:hi])
            elif n := scored_rows(c):  # a prefill chunk: never a graph's [B, H] rows
                out.prompt_logprobs[c.request.id] = chunk_entries(
                    self.model, step.hidden[lo : lo + n], c
                )
        self.step_done(step)
        if self.on_decode_step is not None and batch.is_decode_only and reqs:
            # .tolist() above waited for the sampled tokens: the step's device work is done.
            self.on_decode_step(len(chunks), time.perf_counter() - step.start)
        return out

    @torch.inference_mode()
    def launch(
        self,
        batch: Batch,
        device_ids: torch.Tensor | None = None,
        between: Callable[[], None] | None = None,
    ) -> LaunchedStep:
        """Enqueue the step's forward pass (a graph replay for a decode-only batch that fits,
        else eagerly); nothing waits for it but the offloaded graphs' own stops. For overlap
        scheduling (engine/overlap.py): `device_ids` [B] are the token ids on the device, of
        a decode batch whose ids the host does not know yet; `between` is called once the
        step's first kernels are queued (before an offloaded graph's first stop)."""
        start = time.perf_counter()
        self.launched += 1
        inputs = build_inputs(batch.chunks, self.kv.page_size)
        inputs.device_ids = device_ids
        graphed = self.graphs is not None and batch.is_decode_only and self.graphs.fits(inputs)
        if graphed:
            hidden = self.graphs.replay(inputs, between)  # [B, H]: one token per chunk
        else:
            input_ids, meta = to_device(inputs, self.device, self.model.spec.is_hybrid)
            hidden = self.model(input_ids, meta)  # [T, H]
            if between is not None:
                between()
        return LaunchedStep(batch, inputs, hidden, graphed, start)

    @torch.inference_mode()
    def sample_tokens(
        self,
        step: LaunchedStep,
        masks: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[list[Request], Sampled | None]:
        """The requests whose chunks sample, in order, and their tokens [B'] int64 on the
        device, with the reported ones and the log-probabilities of the rows that ask for
        them (token_logprobs.py); None when no chunk samples. Waits for nothing
        (layers/sampler.py). The log-probabilities are the raw logits'; logit bias, penalties
        and min_tokens apply after them and before the constraint mask, and the penalised
        requests' counts take the sampled tokens on the device right after the draw
        (logits_processors.py)."""
        chunks = step.batch.chunks
        sampling = [i for i, c in enumerate(chunks) if c.sample and c.request.samples]
        if not sampling:
            return [], None
        logits = self.model.compute_logits(self._sampled_rows(step.hidden, step.inputs, sampling))
        reqs = [chunks[i].request for i in sampling]
        params = [r.sampling for r in reqs]
        raw = raw_logprobs(logits, params)  # the model's own logits; None unless a row asks
        # Under overlap a row may belong to a request its previous step just finished (the
        # row is dropped at accept): a generator made for it now would outlive the request,
        # and a later request reusing its id would draw from it (not seeded afresh).
        gens = [
            None if r.status is Status.FINISHED else self.generator_for(r.id, r.sampling.seed)
            for r in reqs
        ]
        masks = masks or {}
        # In place; nothing if no row asks.
        penalised = apply_processors(logits, reqs, self.eos_token_ids, masks, self.thinking)
        allowed = allowed_tokens([r.id for r in reqs], masks, logits.shape[-1], self.device)
        sampled = sample(logits, params, gens, allowed)
        count_sampled(penalised, sampled.tokens)
        for r in reqs:  # counted at the draw (Request.num_sampled says why)
            r.num_sampled += 1
        return reqs, attach(sampled, raw)

    def step_done(self, step: LaunchedStep) -> None:
        """After a step's sampling is enqueued: the offloaded bank's between-steps work."""
        if self.after_step is not None:
            self.after_step(len(step.batch.chunks) if step.graphed else None)
