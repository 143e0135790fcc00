"""The thinking budget (engine/thinking_budget.py): once a think block has taken its budget of
tokens, the forced close ("\\n</think>\\n\\n") goes out token by token; a block the model closes
itself, or never opens, is left alone, and so is every row and every step the rule does not
force (bit-identical logits). End to end on the CPU demo model, in the plain and the overlapped
loop alike; refused for a model without think tokens."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from overlap_runs import both_loops
from packed_masks import packed_mask
from thinking_model import forced_close_at
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.logits_processors import apply_processors
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.request import Request, Status
from freetoken_agent.engine.sampling_params import SamplingParamsError
from freetoken_agent.engine.thinking_budget import MAX_WAIT, ThinkingMarkers


def _markers(rng: random.Random, vocab: int) -> ThinkingMarkers:
    open_id, close_id, newline = rng.sample(range(vocab), 3)
    return ThinkingMarkers(open_id, close_id, (newline, close_id, newline, newline))


def _expected(out: list[int], m: ThinkingMarkers, opened: bool, budget: int) -> list[bool]:
    """Oracle: per output position, whether it was forced (written from the rule's text)."""
    forced = [False] * len(out)
    if opened:
        start = 0
    elif out and out[0] == m.open_id:
        start = 1
    else:
        return forced
    block = out[start : start + budget]
    if m.close_id in block:  # closed by the model within its budget
        return forced
    for j in range(len(m.forced)):
        if start + budget + j < len(out):
            forced[start + budget + j] = True
    return forced


@pytest.mark.parametrize("opening", ["prompt", "first_token", "none"])
def test_the_forced_close_comes_after_the_budget_and_nowhere_else(rng_seed, opening):
    rng = random.Random(rng_seed)
    vocab = rng.randint(30, 200)
    m = _markers(rng, vocab)
    for _ in range(20):
        budget = rng.randint(0, 8)
        text = [t for t in range(vocab) if t not in (m.open_id, m.close_id)]  # no marker
        prompt = [rng.choice(text) for _ in range(rng.randint(1, 6))]
        word = rng.choice(text)
        if opening == "prompt":  # opened, maybe after an earlier closed block
            prompt += rng.choice([[], [m.open_id, word, m.close_id]]) + [m.open_id, word]
        elif rng.random() < 0.5:  # a closed block in the prompt opens nothing
            prompt += [m.open_id, word, m.close_id]
        sp = SamplingParams(max_tokens=50, thinking_token_budget=budget)
        req = Request("r0", prompt, sp)
        req.status = Status.RUNNING
        p_close = rng.choice([0.0, 0.1, 0.3])  # how often the model closes the block itself
        forced_at = []
        for step in range(budget + 12):
            logits = torch.randn(1, vocab)
            if step == 0 and opening == "first_token":
                logits[0, m.open_id] = 50.0
            elif rng.random() < p_close:
                logits[0, m.close_id] = 50.0
            before = logits.clone()
            apply_processors(logits, [req], thinking=m)
            finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
            if torch.equal(logits, before):
                forced_at.append(False)
            else:
                assert len(finite) == 1, (step, finite)
                forced_at.append(True)
            token = int(logits[0].argmax())
            req.output_ids.append(token)
            req.num_sampled += 1
        expected = _expected(req.output_ids, m, opening == "prompt", budget)
        assert forced_at == expected, (req.output_ids, budget, opening, rng_seed)
        if any(expected):
            i = expected.index(True)
            assert tuple(req.output_ids[i : i + len(m.forced)]) == m.forced


def test_a_grammar_that_forbids_the_close_drops_the_budget(rng_seed):
    rng = random.Random(rng_seed)
    vocab = rng.randint(40, 120)
    m = _markers(rng, vocab)
    allowed = [t for t in range(vocab) if t not in m.forced]
    mask = packed_mask(vocab, allowed)
    req = Request("g", [m.open_id], SamplingParams(max_tokens=9, thinking_token_budget=0))
    req.status = Status.RUNNING
    for _ in range(4):
        logits = torch.randn(1, vocab)
        before = logits.clone()
        apply_processors(logits, [req], masks={"g": mask}, thinking=m)
        assert torch.equal(logits, before)  # nothing forced: the grammar's row is the model's
        req.output_ids.append(rng.choice(allowed))
        req.num_sampled += 1


def test_the_close_waits_for_a_grammar_to_allow_it(rng_seed):
    """A grammar refusing the close for k steps (the middle of a multi-byte character): the
    close begins at the first step it is allowed, up to MAX_WAIT steps late; later, dropped."""
    rng = random.Random(rng_seed)
    vocab = rng.randint(40, 120)
    m = _markers(rng, vocab)
    every = packed_mask(vocab, list(range(vocab)))
    no_close = packed_mask(vocab, [t for t in range(vocab) if t not in m.forced])
    for k in range(MAX_WAIT + 2):
        budget = rng.randint(0, 4)
        req = Request("g", [m.open_id], SamplingParams(max_tokens=30, thinking_token_budget=budget))
        req.status = Status.RUNNING
        forced_at = []
        for step in range(budget + k + len(m.forced) + 2):
            refusing = budget <= step < budget + k
            mask = no_close if refusing else every
            logits = torch.randn(1, vocab)
            before = logits.clone()
            apply_processors(logits, [req], masks={"g": mask}, thinking=m)
            forced_at.append(not torch.equal(logits, before))
            allowed = [t for t in range(vocab) if t not in m.forced and t != m.close_id]
            token = int(logits[0].argmax()) if forced_at[-1] else rng.choice(allowed)
            req.output_ids.append(token)
            req.num_sampled += 1
        if k <= MAX_WAIT:
            start = budget + k
            assert forced_at == [start <= i < start + len(m.forced) for i in range(len(forced_at))]
            assert tuple(req.output_ids[start : start + len(m.forced)]) == m.forced
        else:
            assert not any(forced_at), (k, forced_at)


def test_the_close_waits_for_a_character_to_end(rng_seed):
    """An output that ends inside a character for k steps at the budget (Request.mid_character,
    the detokenizer's word): the close begins when the character is whole, at most MAX_WAIT
    steps late; past that it begins anyway."""
    rng = random.Random(rng_seed)
    vocab = rng.randint(40, 120)
    m = _markers(rng, vocab)
    text = [t for t in range(vocab) if t not in m.forced and t != m.open_id]
    for k in (0, rng.randint(1, MAX_WAIT), MAX_WAIT + rng.randint(1, 3)):
        budget = rng.randint(0, 4)
        req = Request("c", [m.open_id], SamplingParams(max_tokens=60, thinking_token_budget=budget))
        req.status = Status.RUNNING
        forced_at = []
        for step in range(budget + k + len(m.forced) + 2):
            req.mid_character = budget <= step < budget + k
            logits = torch.randn(1, vocab)
            before = logits.clone()
            apply_processors(logits, [req], thinking=m)
            forced_at.append(not torch.equal(logits, before))
            token = int(logits[0].argmax()) if forced_at[-1] else rng.choice(text)
            req.output_ids.append(token)
            req.num_sampled += 1
        start = budget + min(k, MAX_WAIT)
        assert forced_at == [start <= i < start + len(m.forced) for i in range(len(forced_at))]


def test_the_model_closing_the_block_during_the_wait_ends_the_budget(rng_seed):
    """The close waits for a character, and meanwhile the model writes `</think>` itself:
    nothing is forced after it (a second close would land in the answer)."""
    rng = random.Random(rng_seed)
    vocab = rng.randint(40, 120)
    m = _markers(rng, vocab)
    text = [t for t in range(vocab) if t not in m.forced and t != m.open_id]
    budget, wait = rng.randint(0, 4), rng.randint(1, 3)
    req = Request("w", [m.open_id], SamplingParams(max_tokens=40, thinking_token_budget=budget))
    req.status = Status.RUNNING
    for step in range(budget + wait + 8):
        req.mid_character = budget <= step < budget + wait
        logits = torch.randn(1, vocab)
        if step == budget + wait - 1:  # the model's own close, while the wait lasts
            logits[0, m.close_id] = 50.0
        before = logits.clone()
        apply_processors(logits, [req], thinking=m)
        assert torch.equal(logits, before), step  # nothing forced, ever
        token = int(logits[0].argmax()) if step == budget + wait - 1 else rng.choice(text)
        req.output_ids.append(token)
        req.num_sampled += 1
    assert req.output_ids.count(m.close_id) == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


def _load(path, overlap: bool) -> Engine:
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=512,
                       overlap_schedule=overlap)  # fmt: skip


def test_on_the_demo_model_in_both_loops(model_dir, rng_seed):
    """A prompt that opens a think block: the budgeted request's first `budget` tokens are
    the unbudgeted one's (same seed), then the forced close, then its answer; a request
    beside it without a budget gives its tokens as alone."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir, False)
    m = engine.thinking
    assert m is not None and m.forced == tuple(engine.tokenizer.encode("\n</think>\n\n"))
    tail = engine.tokenizer.encode("<|im_start|>assistant\n<think>\n")
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(3, 20))] + tail
               for _ in range(2)]  # fmt: skip
    budget = rng.randint(0, 10)
    most = budget + len(m.forced) + rng.randint(1, 6)
    options = {"temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1 << 30),
               "ignore_eos": True, "max_tokens": most + MAX_WAIT}  # fmt: skip
    budgeted = SamplingParams(thinking_token_budget=budget, **options)
    free = SamplingParams(**options)
    unbudgeted = engine.generate(prompts[0], free).token_ids
    alone = engine.generate(prompts[1], free).token_ids
    plan = {0: [(prompts[0], budgeted, {}), (prompts[1], free, {})]}
    events, lagged = both_loops(lambda overlap: _load(model_dir, overlap), plan)
    assert lagged.overlap.lagged_steps > 0
    got = [events[rid] for rid in sorted(events, key=lambda r: int(r.split("-")[1]))]
    tokens = [[t for _, t, *_ in e if t is not None] for e in got]
    where = (budget, rng_seed, tokens[0], unbudgeted)
    if m.close_id in unbudgeted[:budget]:  # the model closed it itself: nothing forced
        assert tokens[0] == unbudgeted, where
    else:
        decode = engine.tokenizer.decode
        start = forced_close_at(tokens[0], m.forced, budget, MAX_WAIT, decode)
        assert tokens[0][:start] == unbudgeted[:start], where  # a wait's tokens: the model's
    assert tokens[1] == alone


def test_refusals(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(thinking_token_budget=bad)
        assert e.value.fields == ("thinking_token_budget",)
    make_tiny("qwen3_moe", tmp_path, seed=rng.randrange(1 << 30))  # no tokenizer: no markers
    engine = Engine.load(tmp_path, device="cpu", progress=False)
    assert engine.thinking is None
    with pytest.raises(InvalidRequestError, match="no <think> and </think>"):
        engine.submit([1, 2, 3], SamplingParams(thinking_token_budget=rng.randint(0, 9)))
    assert not engine.has_unfinished()


def test_the_engine_default_applies_where_a_request_sets_none(model_dir, tmp_path, rng_seed):
    """EngineConfig.thinking_budget: a request without its own budget gets it (the caller's
    SamplingParams left as they were), one with its own keeps that; a model without think
    tokens ignores the default, with a warning, and serves requests as before."""
    rng = random.Random(rng_seed)
    default, own = rng.sample(range(0, 10), 2)
    engine = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=512, thinking_budget=default)  # fmt: skip
    m = engine.thinking
    prompt = [rng.randrange(3, 1000) for _ in range(5)]
    prompt += engine.tokenizer.encode("<|im_start|>assistant\n<think>\n")
    common = {"temperature": 0, "ignore_eos": True,
              "max_tokens": 10 + MAX_WAIT + len(m.forced) + 2}  # fmt: skip
    free = SamplingParams(**common)
    unbudgeted = Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096,
                             max_model_len=512).generate(prompt, free).token_ids  # fmt: skip
    for sp, budget in ((free, default), (SamplingParams(thinking_token_budget=own, **common), own)):
        tokens = engine.generate(prompt, sp).token_ids
        if m.close_id not in unbudgeted[:budget]:
            start = forced_close_at(tokens, m.forced, budget, MAX_WAIT, engine.tokenizer.decode)
            assert tokens[:start] == unbudgeted[:start]
    assert free.thinking_token_budget is None
    with pytest.raises(ValueError, match="thinking_budget"):
        Engine.load(model_dir, device="cpu", progress=False, thinking_budget=-1)

    make_tiny("qwen3_moe", tmp_path, seed=rng.randrange(1 << 30))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("freetoken.engine").addHandler(handler)
    try:
        plain = Engine.load(tmp_path, device="cpu", progress=False, thinking_budget=default)
    finally:
        logging.getLogger("freetoken.engine").removeHandler(handler)
    assert any("thinking_budget" in r.getMessage() for r in records)
    out = plain.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3
