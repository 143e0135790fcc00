"""Prompt log-probabilities (engine/prompt_logprobs.py) on the CPU: a request with
SamplingParams.prompt_logprobs gets, for each prompt token after the first, its value in the
model's raw distribution at the position before it, held to `Engine.score`'s logits of the same
prompt; whatever the chunks and slices the prefill is cut into, beside other requests (which
are unaffected), under overlap or not, after a preemption, and however often the prompt was
sent before (no cached prefix is reused). A prompt-only request (max_tokens 0) ends "length"
with its entries and no token."""

from __future__ import annotations

import random

import pytest
from logprob_checks import check_prompt_entries, event_rows, run_batch, scored_logprobs

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import VOCAB_SIZE, ensure_demo_model
from freetoken_agent.engine import prompt_logprobs, runner

TOL = 1e-4  # float32 logits computed in other shapes (chunks, batches) than the reference's


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


def _load(path, overlap: bool = False, **options) -> Engine:
    """A step's token budget is at least max_num_seqs (scheduler.py): a small one, so that a
    small max_batched_tokens cuts prompts into chunks."""
    options.setdefault("max_num_seqs", 6)
    return Engine.load(path, device="cpu", progress=False, overlap_schedule=overlap, **options)


def _prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(lo, hi))]


def _batch(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Two requests asking (k random, one of them prompt-only or not) beside three that do
    not (one asking for the generated tokens' logprobs, and decoding past the others'
    prefills: the overlapped loop then lags), all greedy to fixed lengths."""
    batch = []
    for i in range(5):
        asks = i < 2
        longest = rng.randint(30, 40) if i == 2 else rng.randint(2, 10)
        sp = SamplingParams(
            max_tokens=0 if i == 1 and rng.random() < 0.5 else longest,
            temperature=0,
            ignore_eos=True,
            logprobs=rng.randint(0, 4) if i == 2 else None,
            prompt_logprobs=rng.choice([0, rng.randint(1, 20), 20]) if asks else None,
        )
        batch.append((_prompt(rng, 20, 70) if asks else _prompt(rng, 2, 30), sp))
    rng.shuffle(batch)
    return batch


def _without(batch):
    """The batch with nobody asking; a prompt-only request becomes one of max_tokens 1 (it
    exists only with prompt_logprobs), which computes the same chunks and ends in the same
    step: every step runs the same rows as with them."""
    fields = SamplingParams.__dataclass_fields__
    plain = []
    for p, sp in batch:
        options = {f: getattr(sp, f) for f in fields}
        options.update(prompt_logprobs=None, max_tokens=max(sp.max_tokens, 1))
        plain.append((p, SamplingParams(**options)))
    return plain


def _count_chunks(monkeypatch) -> dict[str, int]:
    """request id -> the chunks whose entries the runner computed for it."""
    counts: dict[str, int] = {}
    compute = runner.chunk_entries

    def counted(model, hidden, chunk):
        counts[chunk.request.id] = counts.get(chunk.request.id, 0) + 1
        return compute(model, hidden, chunk)

    monkeypatch.setattr(runner, "chunk_entries", counted)
    return counts


@pytest.mark.parametrize("overlap", [False, True])
def test_entries_are_the_scored_distribution_beside_others(demo, rng_seed, overlap, monkeypatch):
    rng = random.Random(rng_seed)
    rows = rng.choice([1, 3, 7])  # logits rows a slice computes (the other tests: whole chunks)
    monkeypatch.setattr(prompt_logprobs, "LOGITS_SLICE_BYTES", rows * 4 * VOCAB_SIZE)
    chunk = rng.choice([8, 16, 24])  # so each asking prompt spans several chunks
    batch = _batch(rng)
    engine = _load(demo, overlap, max_batched_tokens=chunk)
    computed = _count_chunks(monkeypatch)
    outs, events = run_batch(engine, batch)
    if overlap:
        assert engine.overlap.lagged_steps >= 3, rng_seed
    reference = _load(demo)
    for (prompt, sp), out, evs in zip(batch, outs, events, strict=True):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None and all(e.prompt_logprobs is None for e in evs)
            continue
        ref = scored_logprobs(reference, prompt)
        check_prompt_entries(out.prompt_logprobs, prompt, ref, sp.prompt_logprobs, TOL, rng_seed)
        # The first event carries them (a prompt-only request's only one), no other does.
        assert evs[0].prompt_logprobs == out.prompt_logprobs, rng_seed
        assert all(e.prompt_logprobs is None for e in evs[1:]), rng_seed
        assert out.stats["reused_tokens"] == 0, rng_seed
        assert computed[out.request_id] >= len(prompt) // chunk, rng_seed  # in several chunks
    # Asking changes nothing else: every generating request's events are the same without it.
    _, plain_events = run_batch(_load(demo, overlap, max_batched_tokens=chunk), _without(batch))
    for (_, sp), evs, plain_evs in zip(batch, events, plain_events, strict=True):
        if sp.max_tokens > 0:
            assert event_rows(evs) == event_rows(plain_evs), rng_seed


def test_a_preempted_request_keeps_each_entry_once(demo, rng_seed):
    """Preempted while prefilling (the pool filled by two decoding requests), the request
    computes its prompt again from position 0: its entries are each position's, once."""
    rng = random.Random(rng_seed)
    engine = _load(demo, kv_tokens=192, max_batched_tokens=16)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for _ in range(2):  # two running requests that fill the pool as they decode
        engine.submit(_prompt(rng, 60, 60), sp)
    for _ in range(rng.randint(2, 4)):
        engine.step()
    ids = _prompt(rng, 90, 120)
    k = rng.randint(0, 20)
    asking = SamplingParams(max_tokens=rng.randint(0, 4), temperature=0, ignore_eos=True,
                            prompt_logprobs=k)  # fmt: skip
    rid = engine.submit(ids, asking)
    req = engine._requests[rid]
    computed_then_preempted = False
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        computed_then_preempted |= 0 < req.preempted_at < len(ids) and not req.output_ids
    assert computed_then_preempted, rng_seed  # some rows were kept, then computed again
    out = engine._collect(rid)
    check_prompt_entries(out.prompt_logprobs, ids, scored_logprobs(_load(demo), ids), k, TOL,
                         rng_seed)  # fmt: skip


def test_entries_given_are_not_computed_again(demo, rng_seed, monkeypatch):
    """Preempted while decoding (it is the newest request), the request prefills its prompt
    and output again: the entries its first event gave are final, not computed again (the
    work would only repeat them) and still the output's."""
    rng = random.Random(rng_seed)
    late = []  # the output's length at each computation of its entries
    compute = runner.chunk_entries
    watched_request = []

    def watched(model, hidden, chunk):
        if watched_request and chunk.request is watched_request[-1]:
            late.append(len(chunk.request.output_ids))
        return compute(model, hidden, chunk)

    monkeypatch.setattr(runner, "chunk_entries", watched)
    # Whether the pool fills while this request decodes depends on the drawn lengths: a few
    # draws, each a fresh engine, until one preempts it there (about 4 in 5 do).
    for _ in range(6):
        engine = _load(demo, kv_tokens=192, max_batched_tokens=16)
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for _ in range(2):  # two older requests that fill the pool as they decode
            engine.submit(_prompt(rng, 40, 60), sp)
        ids = _prompt(rng, 20, 40)
        k = rng.randint(0, 20)
        asking = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=k)
        rid = engine.submit(ids, asking)
        req = engine._requests[rid]
        watched_request.append(req)
        late.clear()
        first, preempted_decoding = None, False
        while engine.has_unfinished():
            for event in engine.step():
                first = first or (event if event.request_id == rid else None)
            preempted_decoding |= req.status.name == "WAITING" and bool(req.output_ids)
        if preempted_decoding:
            break
    assert preempted_decoding, rng_seed
    assert late and not any(late), (rng_seed, late)
    assert engine._collect(rid).prompt_logprobs == first.prompt_logprobs, rng_seed
    check_prompt_entries(first.prompt_logprobs, ids, scored_logprobs(_load(demo), ids), k, TOL,
                         rng_seed)  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cached_prompt_is_computed_again(demo, rng_seed, overlap):
    """The prompt sent before (its pages in the prefix cache, by a request that does not ask
    and one that does): the asking request reuses none of it and reports every entry, the
    same each time."""
    rng = random.Random(rng_seed)
    engine = _load(demo, overlap, max_batched_tokens=rng.choice([16, 2048]))
    ids = _prompt(rng, 40, 90)
    k = rng.randint(0, 20)
    engine.generate(ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    asking = SamplingParams(max_tokens=rng.randint(0, 3), temperature=0, ignore_eos=True,
                            prompt_logprobs=k)  # fmt: skip
    first, again = engine.generate(ids, asking), engine.generate(ids, asking)
    ref = scored_logprobs(_load(demo), ids)
    for out in (first, again):
        assert out.stats["reused_tokens"] == 0, rng_seed
        check_prompt_entries(out.prompt_logprobs, ids, ref, k, TOL, rng_seed)
    engine.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_only_requests_end_after_their_prompt(demo, rng_seed, overlap, monkeypatch):
    """max_tokens 0: no token sampled (no row drawn for it), finish_reason "length", one event
    (no token, the entries); a one-token prompt too (its chunk is decode-shaped: under overlap
    it must not be launched as a decode step, which samples)."""
    rng = random.Random(rng_seed)
    engine = _load(demo, overlap, max_batched_tokens=rng.choice([8, 2048]))
    reference = _load(demo)
    drawn = []  # the requests whose rows were sampled
    sample_tokens = engine.runner.sample_tokens

    def watched(*args, **kwargs):
        reqs, sampled = sample_tokens(*args, **kwargs)
        drawn.extend(r.id for r in reqs)
        return reqs, sampled

    monkeypatch.setattr(engine.runner, "sample_tokens", watched)
    for ids in (_prompt(rng, 1, 1), _prompt(rng, 2, 60)):
        k = rng.randint(0, 20)
        sp = SamplingParams(max_tokens=0, prompt_logprobs=k)
        events = list(engine.stream(ids, sp))
        assert len(events) == 1, (rng_seed, events)
        (event,) = events
        assert event.finished and event.finish_reason == "length" and event.token_id is None
        assert event.text == "" and event.error is None, rng_seed
        if len(ids) > 1:
            check_prompt_entries(event.prompt_logprobs, ids, scored_logprobs(reference, ids), k,
                                 TOL, rng_seed)  # fmt: skip
        else:
            assert event.prompt_logprobs == [None], rng_seed
        out = engine.generate(ids, sp)  # the same request again: computed alike, alone
        assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
        assert out.prompt_logprobs == event.prompt_logprobs, rng_seed
        assert out.stats["completion_tokens"] == 0, rng_seed
    engine.check_integrity()
    assert not engine.has_unfinished() and not drawn, drawn


def test_a_first_token_read_a_step_late_carries_them(demo, rng_seed):
    """Overlap: the prompt's last chunk is its last token alone (the chunk budget cut it so), a
    decode-shaped step that the overlapped loop launches and reads on the next call; the first
    event, accepted there, carries the entries all the same."""
    rng = random.Random(rng_seed)
    chunk = rng.choice([8, 16])
    ids = _prompt(rng, chunk * 3 + 1, chunk * 3 + 1)
    k = rng.randint(0, 20)
    engine = _load(demo, True, max_batched_tokens=chunk)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=k)
    rid = engine.submit(ids, sp)
    events, read_late = [], []
    while engine.has_unfinished() or engine.overlap.inflight is not None:
        in_flight = engine.overlap.inflight is not None
        got = engine.step()
        read_late += [in_flight] * len(got)
        events += got
    assert read_late[0], rng_seed  # the first token was read a call after its launch
    assert [e.request_id for e in events] == [rid] * 3, rng_seed
    ref = scored_logprobs(_load(demo), ids)
    check_prompt_entries(events[0].prompt_logprobs, ids, ref, k, TOL, rng_seed)
    assert engine._collect(rid).prompt_logprobs == events[0].prompt_logprobs, rng_seed
