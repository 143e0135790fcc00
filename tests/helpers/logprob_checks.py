"""Token log-probabilities' tests (CPU and CUDA): drive an engine through a batch of requests,
some asking for logprobs, and hold what it reports to an independent transformers forward."""

from __future__ import annotations

import random

import torch

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.outputs import GenerationOutput, TokenEvent


def mixed_batch(rng: random.Random, n: int = 5) -> list[tuple[list[int], SamplingParams]]:
    """Requests of every kind at once: greedy and seeded sampled (temperature, top-k, top-p:
    the reported logprobs must ignore all of them), asking for 0..20 alternatives or none,
    ending by length at different steps, and one with random stop ids (it may end early, its
    row in flight dropped under overlap). At least one asks and one does not."""
    asks = [True, False] + [rng.random() < 0.6 for _ in range(n - 2)]
    rng.shuffle(asks)
    batch = []
    for i, ask in enumerate(asks):
        sampled = rng.random() < 0.5
        sp = SamplingParams(
            max_tokens=rng.randint(6, 18),
            temperature=rng.choice([0.6, 1.0, 1.4]) if sampled else 0.0,
            top_k=rng.choice([0, 5, 40]) if sampled else 0,
            top_p=rng.choice([1.0, 0.8]) if sampled else 1.0,
            seed=rng.randrange(1 << 30),
            ignore_eos=True,
            stop_token_ids=[rng.randrange(3, 320) for _ in range(4)] if i == 0 else [],
            logprobs=rng.choice([0, 1, rng.randint(2, 20), 20]) if ask else None,
        )
        batch.append(([rng.randrange(3, 320) for _ in range(rng.randint(3, 40))], sp))
    return batch


def run_batch(
    engine: Engine, batch: list[tuple[list[int], SamplingParams]]
) -> tuple[list[GenerationOutput], list[list[TokenEvent]]]:
    """Submit all at once, step to the end; each request's output and events, in order."""
    rids = [engine.submit(p, sp) for p, sp in batch]
    events: dict[str, list[TokenEvent]] = {r: [] for r in rids}
    for _ in range(500):
        for ev in engine.step():
            events[ev.request_id].append(ev)
        engine.check_integrity()
        if not engine.has_unfinished():
            break
    while engine.overlap.inflight is not None:  # nothing is left in flight past the ends
        engine.step()
    outs = [engine._collect(r) for r in rids]
    return outs, [events[r] for r in rids]


def without_logprobs(batch):
    """The same batch with nobody asking."""
    return [(p, SamplingParams(**{**_fields(sp), "logprobs": None})) for p, sp in batch]


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in SamplingParams.__dataclass_fields__}


def event_rows(events: list[TokenEvent]) -> list[tuple]:
    return [(e.index, e.token_id, e.text, e.finished, e.finish_reason, e.error) for e in events]


@torch.no_grad()
def reference_logprobs(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[n, V] float64: transformers' log_softmax at the positions that produced `generated`
    (teacher-forced on prompt + generated)."""
    ids = torch.tensor([prompt + generated], device=hf.device)
    logits = hf(ids).logits[0].double().cpu()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def check_against_reference(
    out: GenerationOutput, k: int, ref: torch.Tensor, tol: float, seed: int
) -> None:
    """Each token's reported logprob is the reference's for it; its top entries are k ids, the
    reference's k largest (up to ties within `tol`), sorted, each with its reference value."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids), seed
    vocab = ref.shape[-1]
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        where = f"seed {seed}, output token {i}"
        row = ref[i]
        assert entry.token_id == token, where
        assert abs(entry.logprob - row[token].item()) <= tol, (where, entry.logprob, row[token])
        assert len(entry.top) == min(k, vocab), (where, k, entry.top)
        if not k:
            continue
        ids = [t for t, _ in entry.top]
        values = [v for _, v in entry.top]
        assert len(set(ids)) == len(ids), where
        assert values == sorted(values, reverse=True), (where, values)
        for t, v in entry.top:
            assert abs(v - row[t].item()) <= tol, (where, t, v, row[t])
        others = row.clone()
        others[ids] = -torch.inf
        assert others.max().item() <= values[-1] + tol, (where, "a larger one left out")


def scored_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """[P, V] float64: log_softmax of `Engine.score`'s logits of `ids` (a fresh engine's: the
    reference prompt entries are held to; row p scores token p + 1)."""
    return torch.log_softmax(engine.score(ids).double(), dim=-1)


def check_prompt_entries(entries, ids: list[int], ref: torch.Tensor, k: int, tol: float,
                         seed: int) -> None:  # fmt: skip
    """A prompt's entries (engine/prompt_logprobs.py) against `ref` = `scored_logprobs(ids)`:
    one per prompt token, the first None; entry p is token p's value in row p - 1, its rank
    there (counted up to ties within `tol`), and the k largest of that row, sorted."""
    assert entries is not None and len(entries) == len(ids), (seed, len(entries or []))
    assert entries[0] is None, seed
    vocab = ref.shape[-1]
    for p in range(1, len(ids)):
        where = f"seed {seed}, prompt token {p}"
        entry, row, token = entries[p], ref[p - 1], ids[p]
        assert entry is not None and entry.token_id == token, (where, entry)
        value = row[token].item()
        assert abs(entry.logprob - value) <= tol, (where, entry.logprob, value)
        surely_ahead = int((row > value + tol).sum())
        maybe_ahead = int((row >= value - tol).sum())
        assert surely_ahead + 1 <= entry.rank <= maybe_ahead, (where, entry.rank)
        assert len(entry.top) == min(k, vocab), (where, k, entry.top)
        if not k:
            continue
        top_ids = [t for t, _ in entry.top]
        values = [v for _, v in entry.top]
        assert len(set(top_ids)) == len(top_ids) and values == sorted(values, reverse=True), where
        for t, v in entry.top:
            assert abs(v - row[t].item()) <= tol, (where, t, v, row[t])
        others = row.clone()
        others[top_ids] = -torch.inf
        assert others.max().item() <= values[-1] + tol, (where, "a larger one left out")
