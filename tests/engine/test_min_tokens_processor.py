"""min_tokens as a logits processor (engine/logits_processors.py), on fresh random logits: the
ids that would end a request are -inf exactly while fewer than min_tokens tokens were sampled
before this one, counted at the draw (`Request.num_sampled`: a token drawn but not yet accepted
counts); a grammar that allows nothing but them wins; other rows stay bit-identical."""

from __future__ import annotations

import random

import torch
from packed_masks import packed_mask

from freetoken_agent.engine.logits_processors import apply_processors
from freetoken_agent.engine.request import Request, Status
from freetoken_agent.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _running(
    rng: random.Random, i: int, sampling: SamplingParams, drawn: int, in_flight: bool | None = None
) -> Request:
    """A running request that drew `drawn` tokens, the last of them maybe not accepted yet
    (overlap's token in flight: one fewer output id; None: at random)."""
    if in_flight is None:
        in_flight = rng.random() < 0.5
    in_flight = in_flight and drawn > 0
    output = [rng.randrange(3, 50) for _ in range(drawn - in_flight)]
    req = Request(f"r{i}", [rng.randrange(3, 50)], sampling, output_ids=output)
    req.status, req.num_sampled = Status.RUNNING, drawn
    return req


def test_the_end_is_held_back_while_fewer_than_min_tokens_were_drawn(rng_seed):
    rng = random.Random(rng_seed)
    vocab = rng.randint(40, 300)
    eos = frozenset(rng.sample(range(vocab), rng.randint(1, 3)))
    m = rng.randint(1, 6)
    sp = SamplingParams(max_tokens=20, min_tokens=m)
    reqs = [
        _running(rng, 0, sp, m, in_flight=True),  # the m-th drawn, not accepted: free
        _running(rng, 1, sp, m - 1, in_flight=False),  # m - 1 drawn and accepted: held
        _running(rng, 2, sp, m - 1),  # overlap's dropped row: left alone
    ]
    reqs[2].status = Status.FINISHED
    held = [[], sorted(eos), []]
    for i in range(3, rng.randint(5, 10)):
        m = rng.choice([0, rng.randint(1, 6)])
        drawn = rng.randint(0, m + 2)
        stop_ids = rng.sample(range(vocab + 20), rng.randint(0, 3))  # some past the vocabulary
        sp = SamplingParams(max_tokens=20, min_tokens=m, stop_token_ids=stop_ids,
                            ignore_eos=rng.random() < 0.3)  # fmt: skip
        reqs.append(_running(rng, i, sp, drawn))
        ends = [t for t in sp.end_ids(eos) if t < vocab]
        held.append(ends if drawn < m else [])
    logits = torch.randn(len(reqs), vocab)
    before = logits.clone()
    apply_processors(logits, reqs, eos)
    for i, (req, ends) in enumerate(zip(reqs, held, strict=True)):
        want = before[i].clone()
        want[ends] = NEG_INF
        where = (i, req.num_sampled, len(req.output_ids), req.sampling, sorted(eos), rng_seed)
        assert torch.equal(logits[i], want), where


def test_a_grammar_that_allows_only_the_end_wins(rng_seed):
    """Holding back the only ids a grammar allows would leave nothing to sample: the end is
    held only while the grammar allows something else."""
    rng = random.Random(rng_seed)
    vocab = rng.randint(40, 300)
    eos = frozenset(rng.sample(range(vocab), rng.randint(1, 3)))
    sp = SamplingParams(max_tokens=20, min_tokens=rng.randint(2, 9))
    reqs = [_running(rng, i, sp, rng.randint(0, sp.min_tokens - 1)) for i in range(3)]
    other = rng.choice([t for t in range(vocab) if t not in eos])
    ends = rng.sample(sorted(eos), rng.randint(1, len(eos)))
    masks = {
        "r0": packed_mask(vocab, ends),  # the grammar can only end: it wins
        "r1": packed_mask(vocab, [*ends, other]),  # it can go on: the end is held back
    }  # r2: no grammar, held back
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_processors(logits, reqs, eos, masks)
    assert torch.equal(logits[0], before[0]), (ends, rng_seed)
    for i in (1, 2):
        assert torch.isneginf(logits[i, sorted(eos)]).all(), (i, rng_seed)
        rest = [t for t in range(vocab) if t not in eos]
        assert torch.equal(logits[i, rest], before[i, rest]), (i, rng_seed)
