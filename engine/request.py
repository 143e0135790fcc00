"""What the scheduler schedules: requests, a step's chunks and batch, and a hybrid model's
recurrent state (engine/scheduler.py decides; these carry ids and tokens, never tensors, but
for one: a penalised or biased request's TokenHistory, its counts on the device, which must
follow it through overlapped steps the host has not read yet: logits_processors.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from freetoken_agent.engine.kv.checkpoint_mode import CheckpointMode
from freetoken_agent.engine.kv.radix import Node
from freetoken_agent.engine.outputs import TokenLogprob
from freetoken_agent.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from freetoken_agent.engine.logits_processors import TokenHistory


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One generation (or scoring) request. Owned by the Scheduler from submit to finish."""

    id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    # With sampling.logprobs set: one per entry of output_ids.
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With sampling.prompt_logprobs set: one slot per prompt token, filled by position as the
    # prefill computes them (the first stays None: engine/prompt_logprobs.py); else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    nodes: list[Node | None] = field(default_factory=list)  # locked tree node per page, or None
    num_computed: int = 0  # tokens whose K/V are in `pages`
    num_reused: int = 0  # tokens taken from the prefix cache (summed over admissions)
    num_prefilled: int = 0  # tokens computed while prefilling (re-prefills after preemption too)
    # Of its prompt, the tokens the prefix cache gave at its first admission: what its usage
    # reports (a readmission after preemption may resume past the prompt, from its own
    # generated tokens: work, counted in num_reused, not the prompt's reuse).
    prompt_reused: int = 0
    # Tokens sampled for it, counted when drawn (ModelRunner.sample_tokens), not when the host
    # accepts them: min_tokens asks how many came before the one being sampled, and under
    # overlap a drawn token may not be accepted yet (logits_processors.py).
    num_sampled: int = 0
    prefilling: bool = True  # from admission until the first token sampled after it
    # Its output ends inside a character (a multi-byte one whose bytes come in several
    # tokens): set at each accept; the thinking budget's close waits for the character.
    mid_character: bool = False
    use_prefix_cache: bool = True
    score_only: bool = False  # compute logits at every position, sample nothing
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_admit_time: float | None = None  # its first admission (queue time's end)
    first_token_time: float | None = None
    finish_time: float | None = None
    admissions: int = 0
    # Hybrid models: boundaries where prefilling takes checkpoints (sorted), generated tokens
    # before which decoding takes one, the state slot while running (0: none), checkpoints
    # taken but not yet hung on the tree (boundary, Checkpoint).
    snapshot_plan: list[int] = field(default_factory=list)
    anchor_tokens: frozenset[int] = frozenset()
    state_slot: int = 0
    pending_checkpoints: list[tuple[int, Any]] = field(default_factory=list)
    # Overlap scheduling: a decode checkpoint taken before the next step, kept at the accept
    # only if the token in flight is an anchor token (AheadCheckpoints.checkpoint_ahead).
    ahead_checkpoint: tuple[int, Any] | None = None
    num_resumed: int = 0  # tokens covered by restored checkpoints (summed over admissions)
    resume_boundary: int = 0  # the checkpoint the admission being tried restored (0: none)
    resume_checkpoint: Any = None  # that checkpoint: what its new ones would fall back to
    # Preemptions: tokens computed at the last one, and how many self-preemptions in a row,
    # alone in the engine, came with nothing computed since the one before (such a request
    # cannot progress: it is failed, not retried).
    preempted_at: int = -1
    fruitless_preemptions: int = 0
    # Logit bias, penalties and min_tokens: the request's state on the device, built at its
    # first sampling and kept until it finishes, preemptions included (logits_processors.py).
    token_history: TokenHistory | None = field(default=None, repr=False)
    # `pages` as an int64 array for the step's page table (`page_array`): (the list it mirrors,
    # the array of its first entries).
    _page_mirror: tuple[list[int], np.ndarray] | None = field(default=None, repr=False)

    @property
    def samples(self) -> bool:
        """Whether the chunk that reaches its last known token samples one: not for a score
        request, nor a prompt-only one (max_tokens 0: it ends there, sampling_params.py)."""
        return not self.score_only and self.sampling.max_tokens > 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def at_length(self, max_model_len: int, more: int = 0) -> bool:
        """Whether the request has reached its length (max_tokens, or the model's) once
        `more` tokens are appended (overlap scheduling asks before the token in flight is)."""
        n_out = len(self.output_ids) + more
        return n_out >= self.sampling.max_tokens or self.n_tokens + more >= max_model_len

    def page_array(self) -> np.ndarray:
        """`pages` as an int64 array [n]. Every step's page table holds every page of every
        running request: converting the whole list each decode step cost ~50 us per request at
        32k tokens of context and ~200 us at 128k (this host). The list only grows in place
        (append, extend) and is otherwise replaced by a new list (the scheduler, kv/vacate.py),
        so the mirror extends by the new tail and is rebuilt for a new list
        (`check_page_mirror`, in the scheduler's integrity check, holds it to that)."""
        pages, mirror = self.pages, self._page_mirror
        if mirror is None or mirror[0] is not pages or len(mirror[1]) > len(pages):
            arr = np.asarray(pages, dtype=np.int64)
        elif len(mirror[1]) < len(pages):
            arr = np.concatenate([mirror[1], np.asarray(pages[len(mirror[1]) :], np.int64)])
        else:
            return mirror[1]
        self._page_mirror = (pages, arr)
        return arr

    def check_page_mirror(self) -> None:
        if self._page_mirror is not None and self._page_mirror[0] is self.pages:
            arr = self._page_mirror[1]
            assert arr.tolist() == self.pages[: len(arr)], f"request {self.id}: pages mirror stale"

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building `tokens`: at 100k tokens of context, the whole
        list built (and freed) for one decode step's token cost ~0.7 ms of every step on the
        device's host."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + len(token_ids)) of its sequence."""

    request: Request
    start: int
    token_ids: list[int]
    sample: bool  # the chunk reaches the end of the known tokens: pick the next one
    # Hybrid models: (boundary, Checkpoint) snapshots the kernels write during this chunk.
    snapshots: list[tuple[int, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    """What the ModelRunner executes in one step. Built by the Scheduler; no tensors."""

    chunks: list[ScheduledChunk]

    @property
    def n_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(len(c.token_ids) == 1 and c.sample and not c.snapshots for c in self.chunks)


@dataclass(slots=True)
class Recurrence:
    """A hybrid model's per-request state slots and checkpoint pool (engine/kv/), and the
    checkpoint mode. The scheduler calls their id-level methods; they own the tensors."""

    states: Any  # RecurrentStatePool
    checkpoints: Any  # CheckpointPool
    mode: CheckpointMode

    @property
    def device_bytes(self) -> int:
        """What the state slots and the checkpoints' device tier hold on the device now."""
        return self.states.nbytes + self.checkpoints.device_bytes

    @property
    def fixed_device_bytes(self) -> int:
        """The part elastic memory does not move: the state slots, and the checkpoints' device
        tier unless it is resizable (then it is part of the split)."""
        ck = self.checkpoints
        return self.states.nbytes + (0 if ck.resizable else ck.device_bytes)
