"""min_tokens end to end on the CPU demo model (it has a tokenizer, for stop strings): an end
made the likeliest token (a logit_bias on EOS or on a stop id) is held back until min_tokens
tokens, then ends the request at once; a stop string that ends within the first min_tokens
tokens' text does not stop it; a grammar still ends where it must. The plain and the overlapped
loop give the same events, and requests beside it without min_tokens are untouched."""

from __future__ import annotations

import random

import pytest
from overlap_runs import both_loops

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.request import Status


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


def _load(path, overlap: bool) -> Engine:
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=512,
                       overlap_schedule=overlap)  # fmt: skip


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(rng.randint(3, 20))]


def _tokens(events: list[tuple]) -> list[int]:
    return [token for _, token, *_ in events if token is not None]


@pytest.mark.parametrize("end", ["eos", "stop_token_id"])
def test_a_likely_end_is_held_back_until_min_tokens(model_dir, rng_seed, end):
    """The end carries +100: without min_tokens the request ends at its first token; with
    min_tokens m it ends at token m + 1, on that end, the m before it none of the ends. A
    greedy request beside them gives its tokens as alone."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir, False)
    ends = set(engine.eos_token_ids)
    options: dict = {"temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1 << 30)}
    if end == "eos":
        token = rng.choice(sorted(ends))
    else:  # EOS off: only the stop id ends it
        token = rng.choice([t for t in range(3, 1000) if t not in ends])
        ends = {token}
        options.update(ignore_eos=True, stop_token_ids=[token, rng.randrange(2000, 3000)])
    m = rng.randint(1, 12)
    held = SamplingParams(max_tokens=m + rng.randint(1, 9), min_tokens=m, logit_bias={token: 100},
                          **options)  # fmt: skip
    hasty = SamplingParams(max_tokens=m + 1, logit_bias={token: 100}, **options)
    plain = SamplingParams(max_tokens=rng.randint(4, 20), temperature=0, ignore_eos=True)
    prompts = [_prompt(rng) for _ in range(3)]
    alone = engine.generate(prompts[2], plain).token_ids
    plan = {0: [(p, sp, {}) for p, sp in zip(prompts, [held, hasty, plain], strict=True)]}
    events, lagged = both_loops(lambda overlap: _load(model_dir, overlap), plan)
    assert lagged.overlap.lagged_steps > 0
    got = [events[rid] for rid in sorted(events, key=lambda r: int(r.split("-")[1]))]
    tokens = [_tokens(e) for e in got]
    where = (m, token, rng_seed)
    assert len(tokens[0]) == m + 1 and tokens[0][-1] == token, (tokens[0], where)
    assert not ends & set(tokens[0][:m]), (tokens[0], where)
    assert got[0][-1][4] == "stop" and tokens[1] == [token] and got[1][-1][4] == "stop", where
    assert tokens[2] == alone, where


def test_a_stop_string_within_min_tokens_does_not_stop_it(model_dir, rng_seed):
    """A stop string taken from the text of the first min_tokens tokens (ending at its last
    character, or anywhere in it): it would stop a request without min_tokens there; with it,
    the text runs on to its first occurrence that ends past those tokens (greedy, EOS off: the
    tokens are the free run's)."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir, False)
    prompt, n = _prompt(rng), 40
    free = list(engine.stream(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
    text = "".join(e.text for e in free)
    lengths = [len("".join(e.text for e in free[: j + 1])) for j in range(n)]  # after token j
    m = rng.choice([j + 1 for j in range(1, n // 2) if lengths[j] > lengths[j - 1]])
    at = lengths[m - 1]  # the first m tokens' text
    if rng.random() < 0.5:  # ends with token m's last character: an off-by-one would take it
        start = at - rng.randint(1, min(3, at - lengths[m - 2]))
    else:
        start = rng.randrange(at)
    stop = text[start : min(at, start + rng.randint(1, 3))]
    first = text.find(stop)
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, stop=[stop])
    assert engine.generate(prompt, sp).text == text[:first]  # it would stop there
    sp.min_tokens = m
    events, _ = both_loops(lambda overlap: _load(model_dir, overlap), {0: [(prompt, sp, {})]})
    (got,) = events.values()
    cut = text.find(stop, at - len(stop) + 1)  # its first occurrence ending past them
    want_text, want_reason = (text[:cut], "stop") if cut >= 0 else (text, "length")
    where = (stop, m, text, rng_seed)
    assert "".join(e[2] for e in got) == want_text and got[-1][4] == want_reason, where
    assert len(want_text) >= at and len(got) > m, where


def test_num_sampled_counts_the_token_in_flight(model_dir, rng_seed):
    """Under overlap, after every call, each running request has drawn its output ids and its
    token in flight, if one is (what min_tokens counts)."""
    rng = random.Random(rng_seed)
    engine = _load(model_dir, True)
    for _ in range(rng.randint(2, 4)):
        m = rng.randint(1, 10)
        sp = SamplingParams(max_tokens=m + 5, min_tokens=m, temperature=rng.choice([0, 1.0]))
        engine.submit(_prompt(rng), sp)
    while engine.has_unfinished():
        engine.step()
        inflight = engine.overlap.inflight
        pending = {id(c.request) for c in inflight.batch.chunks} if inflight else set()
        for req in engine._requests.values():
            if req.status is Status.RUNNING:
                assert req.num_sampled == len(req.output_ids) + (id(req) in pending), req.id
    assert engine.overlap.lagged_steps > 0


def test_a_grammar_ends_where_it_must(model_dir, rng_seed):
    """`"ab" | "abc"` with EOS made the likeliest: after "ab" the grammar may end or go on;
    min_tokens holds the end back, so it goes on to "abc", where the grammar is complete and
    ends the request short of min_tokens (the grammar wins), with no error."""
    pytest.importorskip("llguidance")
    rng = random.Random(rng_seed)
    engine = _load(model_dir, rng.random() < 0.5)
    bias = {t: 100 for t in engine.eos_token_ids}
    prompt = _prompt(rng)
    for grammar, min_tokens, want in [
        ('start: "ab" | "abc"', 0, "ab"),
        ('start: "ab" | "abc"', rng.randint(3, 20), "abc"),  # "ab" is at most 2 tokens
        ('start: "ab"', rng.randint(3, 20), "ab"),
    ]:
        sp = SamplingParams(max_tokens=20, temperature=0, grammar=grammar, min_tokens=min_tokens,
                            logit_bias=bias)  # fmt: skip
        out = engine.generate(prompt, sp)
        assert (out.text, out.finish_reason, out.error) == (want, "stop", None), (grammar, out)


def test_requests_joining_while_others_decode(model_dir, rng_seed):
    """Requests submitted at different calls (prefills among decode steps, the overlapped loop
    draining and resuming), each with EOS made the likeliest: each ends on EOS at token
    min_tokens + 1, in both loops alike."""
    rng = random.Random(rng_seed)
    eos = rng.choice(sorted(_load(model_dir, False).eos_token_ids))
    plan: dict = {}
    for k in range(rng.randint(2, 5)):
        m = rng.randint(0, 8)
        sp = SamplingParams(max_tokens=m + rng.randint(1, 6), min_tokens=m,
                            temperature=rng.choice([0, 1.0]), seed=rng.randrange(1 << 30),
                            logit_bias={eos: 100})  # fmt: skip
        plan.setdefault(rng.randint(0, 3 * k), []).append((_prompt(rng), sp, {}))
    submitted = [sp for call in sorted(plan) for _, sp, _ in plan[call]]
    events, _ = both_loops(lambda overlap: _load(model_dir, overlap), plan)
    for rid, sp in zip(sorted(events, key=lambda r: int(r.split("-")[1])), submitted, strict=True):
        tokens = _tokens(events[rid])
        assert len(tokens) == sp.min_tokens + 1 and tokens[-1] == eos, (rid, sp, rng_seed)
