"""The convenience front-ends over the engine's loop: `Engine.generate`, `Engine.stream` and
`Engine.score` submit requests and call `step()` until theirs are done.

They live apart from engine.py because they are clients of the loop, not part of it: each
uses what any caller of the engine has (`submit`, `step`, `abort`) plus the per-request
tables the engine keeps for its callers (`_requests`, `_events`, `_scores`, read and dropped
through `_collect` and `_pop`). The Engine methods of the same names delegate here and keep
the user-facing docstrings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from freetoken_agent.engine.outputs import GenerationOutput, InvalidRequestError, TokenEvent
from freetoken_agent.engine.prompt_input import Prompt
from freetoken_agent.engine.request import Status
from freetoken_agent.engine.sampling_params import SamplingParams, not_sampling_params

if TYPE_CHECKING:
    from freetoken_agent.engine.engine import Engine

# T tokens


def _one_prompt(prompts) -> bool:
    """Whether `generate` was given one prompt: a string, a flat list of ints (or an empty
    list, refused as an empty prompt), or a tensor or array of at most one dimension. (A 1-D
    tensor's items are 0-d tensors: taken for a list of prompts, it ran each id as a prompt
    of its own.)"""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        return prompts.ndim <= 1
    if not len(prompts):
        return True
    first = prompts[0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        return first.ndim == 0
    return not isinstance(first, (str, list, tuple))


def generate(
    engine: Engine,
    prompts: Prompt | Sequence[Prompt],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    **options,
) -> GenerationOutput | list[GenerationOutput]:
    """Submit every prompt, step until all are finished, collect their outputs in order.
    However it ends early (a refused prompt, a failed step, Ctrl-C out of a step), what it
    submitted and did not collect is aborted and dropped: nothing is left queued."""
    single = _one_prompt(prompts)
    batch = [prompts] if single else list(prompts)
    if isinstance(sampling, Mapping):  # else read below as a list of per-prompt params
        raise InvalidRequestError(not_sampling_params(sampling))
    if sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling or SamplingParams()] * len(batch)
    else:
        params = list(sampling)
        if len(params) != len(batch):
            raise InvalidRequestError(f"{len(batch)} prompts but {len(params)} SamplingParams")
    ids = []
    try:
        for p, sp in zip(batch, params, strict=True):
            ids.append(engine.submit(p, sp, **options))
        while True:  # checked and collected under the lock: another thread's step may be
            # finishing one of them (its status set before its last event is queued)
            with engine.lock:
                if all(engine._requests[r].status is Status.FINISHED for r in ids):
                    outputs = [engine._collect(r) for r in ids]
                    break
            engine.step()
    finally:
        _drop(engine, ids)
    return outputs[0] if single else outputs


def _drop(engine: Engine, ids: Sequence[str]) -> None:
    """Abort and forget the requests of `ids` still in the tables (collected ones are not)."""
    for rid in ids:
        if rid in engine._requests:
            engine.release(rid)


def stream(
    engine: Engine,
    prompt: Prompt,
    sampling: SamplingParams | None = None,
    *,
    stop: Callable[[], bool] | None = None,
    **options,
) -> Iterator[TokenEvent]:
    """Submit, then alternate draining this request's event queue and stepping; the request
    is aborted and its tables dropped however the iteration ends. `stop`, asked before each
    step: True ends the stream there (the request aborted), so a long prompt's prefill, whose
    chunks yield no event, can be stopped after the chunk running (`freetoken chat`'s
    Ctrl-C)."""
    rid = engine.submit(prompt, sampling, **options)
    queue = engine._events[rid]
    try:
        while True:
            while queue:
                event = queue.popleft()
                yield event
                if event.finished:
                    return
            with engine.lock:  # (another thread's step sets the status, then queues the end)
                ended = engine._requests[rid].status is Status.FINISHED and not queue
            if ended:
                return
            if stop is not None and stop():
                return
            engine.step()
    finally:
        engine.release(rid)


@torch.inference_mode()
def score(engine: Engine, token_ids: Sequence[int]) -> torch.Tensor:
    """Submit a score-only request (one sampled token, no prefix reuse), step until it is
    finished and concatenate the logits chunks `RequestOutcomes.update` kept for it:
    [T, vocab]."""
    rid = engine.submit(token_ids, SamplingParams(max_tokens=1), _score=True)
    req = engine._requests[rid]
    try:
        while True:
            with engine.lock:  # (as generate's)
                if req.status is Status.FINISHED:
                    chunks = engine._scores.pop(rid)
                    break
            engine.step()
    finally:
        _drop(engine, [rid])
    if req.finish_reason == "error":
        raise RuntimeError(f"scoring failed: {req.error}")
    return torch.cat(chunks).cpu()
