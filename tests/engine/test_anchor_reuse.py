"""Anchor-bounded re-prefill on hybrid models (CPU): a request resumes its recurrent layers from
the deepest checkpoint at or before where it diverges from the cache, prefills only the tokens
after it, and produces what a cold full prefill produces."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import HYBRID_FAMILIES, make_tiny

from freetoken_agent import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
VOCAB = 320


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _load(path, **options) -> Engine:
    """float64: resumed and cold runs split the prefill differently, and in fp32 the chunked
    delta rule's rounding on a random model's near-flat logits can flip a greedy token (seed
    369626076: the cold fp32 run's second token was off transformers' and the fp64 engine's,
    ~0.1 in log-probability; every split agreed in fp64). The resume logic is what is tested."""
    options.setdefault("kv_tokens", 4096)
    options.setdefault("dtype", torch.float64)
    return Engine.load(path, device="cpu", progress=False, **options)


@pytest.fixture(params=HYBRID_FAMILIES)
def hybrid(request, tmp_path, rng_seed):
    make_tiny(request.param, tmp_path, rng_seed)
    return tmp_path, random.Random(rng_seed)


def _expected_resume(mode: str, boundaries: set[int], diverge: int, n_prompt: int) -> int:
    """The deepest checkpointed boundary a request can resume from: at most the divergence and
    at most len(prompt) - 1 (the last prompt token is always computed)."""
    limit = min(diverge, n_prompt - 1)
    if mode == "none":
        return 0
    return max([b for b in boundaries if b <= limit], default=0)


@pytest.mark.parametrize("mode", ["anchors", "positional:48", "none"])
def test_edit_resumes_from_deepest_checkpoint(hybrid, mode):
    path, rng = hybrid
    engine = _load(path, checkpoints=mode)
    first = _tokens(rng, rng.randrange(150, 260))
    anchors = sorted(rng.sample(range(1, len(first)), 6))
    out1 = engine.generate(first, GREEDY, anchors=anchors)
    assert out1.stats["prefilled_tokens"] == len(first)
    # An edit inside the prompt, away from any anchor: the rest is new.
    diverge = rng.randrange(anchors[1] + 1, len(first) - 1)
    second = first[:diverge] + _tokens(rng, rng.randrange(20, 60))
    second[diverge] = (first[diverge] + 1 - 3) % (VOCAB - 3) + 3  # differs right there
    out2 = engine.generate(second, GREEDY, anchors=[])
    if mode == "anchors":
        taken = {*anchors, len(first)}
    elif mode.startswith("positional"):
        taken = set(range(48, len(first) + 1, 48))
    else:
        taken = set()
    resume = _expected_resume(mode.split(":")[0], taken, diverge, len(second))
    assert out2.stats["reused_tokens"] == resume
    assert out2.stats["resumed_tokens"] == resume
    assert out2.stats["prefilled_tokens"] == len(second) - resume
    engine.check_integrity()
    cold = _load(path, checkpoints="none")
    assert cold.generate(second, GREEDY).token_ids == out2.token_ids
    assert cold.generate(first, GREEDY).token_ids == out1.token_ids


def test_branches_share_a_checkpoint(hybrid):
    """Two sessions sharing a system prompt and tools: the second resumes at the shared anchor."""
    path, rng = hybrid
    engine = _load(path)
    shared = _tokens(rng, 97)
    a, b = shared + _tokens(rng, 40), shared + _tokens(rng, 33)
    b[len(shared)] = (a[len(shared)] + 1 - 3) % (VOCAB - 3) + 3
    engine.generate(a, GREEDY, anchors=[len(shared)])
    out = engine.generate(b, GREEDY, anchors=[len(shared)])
    assert out.stats["prefilled_tokens"] == len(b) - len(shared)
    # One checkpoint at the branch point, on the tree, shared: b resumed from a's.
    at_branch = [n for n in engine.radix._nodes() if len(shared) in n.checkpoints]
    assert len(at_branch) == 1 and out.stats["resumed_tokens"] == len(shared)
    cold = _load(path, checkpoints="none")
    assert cold.generate(b, GREEDY).token_ids == out.token_ids
    engine.check_integrity()


def test_decode_checkpoint_before_marker_token(hybrid):
    """A checkpoint taken while decoding (before a marker token) serves the follow-up turn."""
    path, rng = hybrid
    engine = _load(path)
    prompt = _tokens(rng, 60)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = engine.generate(prompt, sp, anchor_tokens=range(VOCAB))  # before every token
    k = rng.randrange(2, 7)
    new = _tokens(rng, 12)
    while new[0] == first.token_ids[k]:  # the edit must diverge at token k, not later
        new[0] = rng.randrange(3, VOCAB)
    follow = prompt + first.token_ids[:k] + new
    out = engine.generate(follow, GREEDY)
    assert out.stats["reused_tokens"] == len(prompt) + k
    assert out.stats["prefilled_tokens"] == len(follow) - len(prompt) - k
    cold = _load(path, checkpoints="none")
    assert cold.generate(follow, GREEDY).token_ids == out.token_ids
    engine.check_integrity()


def test_checkpoints_spill_and_drop_under_pressure(hybrid):
    """A checkpoint pool of two device rows and two host rows: many anchors spill and drop
    (counted in stats), nothing fails, outputs stay exact."""
    path, rng = hybrid
    probe = _load(path)
    per = probe.stats()["checkpoints"]["bytes_per_checkpoint"]
    rows = dict(checkpoint_device_bytes=2 * per, checkpoint_host_bytes=2 * per)
    # 32-token chunks: the anchors' snapshots come over several steps and push older ones out.
    engine = _load(path, max_batched_tokens=32, **rows)
    prompt = _tokens(rng, 200)
    anchors = sorted(rng.sample(range(1, 200), 12))
    engine.generate(prompt, GREEDY, anchors=anchors)
    engine.check_integrity()
    stats = engine.stats()["checkpoints"]
    assert stats["device_rows"] == 2 and stats["host_rows"] == 2
    assert stats["spilled"] >= 2 and stats["dropped"] >= 1
    assert stats["device_used"] <= 2 and stats["host_used"] <= 2
    # The most recent checkpoints survive: an edit near the end resumes from one of them.
    follow = prompt[:-1] + _tokens(rng, 5)
    out = engine.generate(follow, GREEDY)
    assert out.stats["resumed_tokens"] > 0
    cold = _load(path, checkpoints="none")
    assert cold.generate(follow, GREEDY).token_ids == out.token_ids
    engine.check_integrity()
    # In one chunk only two rows can be written (its second boundary lies too early to end
    # the chunk there): its shallowest and deepest boundaries get them, and the count says
    # how many went without.
    one_chunk = _load(path, **rows)
    one_chunk.generate(prompt, GREEDY, anchors=anchors)
    kept = sorted(b for n in one_chunk.radix._nodes() for b in n.checkpoints)
    assert kept == [anchors[0], len(prompt)]
    assert one_chunk.stats()["checkpoints"]["reserve_skipped"] == len(anchors) - 1
    one_chunk.check_integrity()
    # A request that shares only the prompt's first anchor resumes there, not from token 0.
    other = prompt[: anchors[0]] + _tokens(rng, 30)
    other[anchors[0]] = (prompt[anchors[0]] + 1 - 3) % (VOCAB - 3) + 3
    out = one_chunk.generate(other, GREEDY)
    assert out.stats["resumed_tokens"] == anchors[0]
    assert cold.generate(other, GREEDY).token_ids == out.token_ids


def test_a_full_pool_drops_dense_anchors_before_a_historys_first(hybrid):
    """Four checkpoint rows, nine anchors: the first (the end of a system prompt) is far from
    any other, the rest a few tokens apart. The pool drops what costs least to lose (the
    tokens back to the next shallower checkpoint), so the first anchor stays and a new
    session sharing only it resumes there. (LRU dropped it first: the oldest.)"""
    path, rng = hybrid
    probe = _load(path)
    per = probe.stats()["checkpoints"]["bytes_per_checkpoint"]
    engine = _load(path, max_batched_tokens=32, checkpoint_device_bytes=2 * per,
                   checkpoint_host_bytes=2 * per)  # fmt: skip
    first = rng.randrange(90, 130)
    prompt = _tokens(rng, first + rng.randrange(80, 120))
    dense = sorted(rng.sample(range(first + 20, len(prompt)), 8))
    engine.generate(prompt, GREEDY, anchors=[first, *dense])
    # A drop had to happen (LRU's first would have been the oldest: `first`).
    assert engine.stats()["checkpoints"]["dropped"] >= 1
    kept = sorted(b for n in engine.radix._nodes() for b in n.checkpoints)
    assert kept[0] == first and len(kept) <= 4
    other = prompt[:first] + _tokens(rng, 30)
    other[first] = (prompt[first] + 1 - 3) % (VOCAB - 3) + 3
    out = engine.generate(other, GREEDY)
    assert out.stats["resumed_tokens"] == first
    engine.check_integrity()
    cold = _load(path, checkpoints="none")
    assert cold.generate(other, GREEDY).token_ids == out.token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_checkpoints_cost_their_gap_and_spare_another_sessions_anchor(hybrid, overlap):
    """A session decoding with every token an anchor takes a checkpoint a token (under overlap
    scheduling ahead of the token, kept at its accept). Each costs one token to lose, so a
    full pool drops those, not another session's system-prompt anchor, which its new branch
    then resumes from."""
    path, rng = hybrid
    per = _load(path).stats()["checkpoints"]["bytes_per_checkpoint"]
    # Four rows: with three, a step's locked rows (the checkpoint being written, the one
    # ahead) can leave only the two first anchors to choose between.
    engine = _load(path, checkpoint_device_bytes=2 * per, checkpoint_host_bytes=2 * per,
                   max_batched_tokens=64, overlap_schedule=overlap)  # fmt: skip
    # GreedyDual's inflation grows with each drop (by ~a token's gap back to the last kept
    # checkpoint): 6-8 decode checkpoints keep it at ~20-30, far below the system prompt's.
    system = _tokens(rng, rng.randrange(160, 200))
    engine.generate(system + _tokens(rng, 10), GREEDY, anchors=[len(system)])
    other = _tokens(rng, rng.randrange(220, 300))
    sampling = SamplingParams(max_tokens=rng.randint(6, 8), temperature=0, ignore_eos=True)
    engine.generate(other, sampling, anchors=[len(other)], anchor_tokens=range(VOCAB))
    assert engine.stats()["checkpoints"]["dropped"] >= 1
    branch = system + _tokens(rng, 10)
    out = engine.generate(branch, GREEDY, anchors=[len(system)])
    assert out.stats["resumed_tokens"] == len(system)
    engine.check_integrity()
    cold = _load(path, checkpoints="none")
    assert cold.generate(branch, GREEDY).token_ids == out.token_ids


def test_a_chunk_ends_early_so_that_every_anchor_gets_a_row(hybrid):
    """Four device rows, one chunk crossing seven boundaries, its fourth past 3/4 of the
    chunk: the chunk ends there and the next step takes the other three, once the first four
    have spilled to the host tier. Every boundary is checkpointed, and an edit right after the
    shallowest resumes from it."""
    path, rng = hybrid
    probe = _load(path)
    per = probe.stats()["checkpoints"]["bytes_per_checkpoint"]
    engine = _load(path, checkpoint_device_bytes=4 * per, checkpoint_host_bytes=16 * per)
    prompt = _tokens(rng, 200)
    anchors = sorted(rng.sample(range(152, 199), 6))  # the fourth boundary: past 150
    out = engine.generate(prompt, GREEDY, anchors=anchors)
    kept = sorted(b for n in engine.radix._nodes() for b in n.checkpoints)
    assert kept == [*anchors, len(prompt)]
    stats = engine.stats()["checkpoints"]
    assert stats["reserve_skipped"] == 0 and stats["spilled"] >= 3, stats
    engine.check_integrity()
    cold = _load(path, checkpoints="none")
    assert cold.generate(prompt, GREEDY).token_ids == out.token_ids
    edited = prompt[:]
    edited[anchors[0]] = (prompt[anchors[0]] + 1 - 3) % (VOCAB - 3) + 3
    out = engine.generate(edited, GREEDY)
    assert out.stats["resumed_tokens"] == anchors[0]
    assert cold.generate(edited, GREEDY).token_ids == out.token_ids
    engine.check_integrity()


def test_a_request_admitted_beside_a_chunk_holding_every_row_keeps_its_first_anchor(hybrid):
    """A's chunk ends early and takes every device row; B, admitted into the budget it left,
    has none for its anchor (its system prompt's end) that step: its chunk stops before it,
    and the next step checkpoints it, so a session sharing B's system prompt resumes there."""
    path, rng = hybrid
    probe = _load(path)
    per = probe.stats()["checkpoints"]["bytes_per_checkpoint"]
    engine = _load(path, checkpoint_device_bytes=4 * per, checkpoint_host_bytes=64 * per,
                   max_batched_tokens=64, overlap_schedule=False)  # fmt: skip
    a = _tokens(rng, 200)
    # The fourth in [48, 56]: A's chunk ends there, leaving B 8 or more tokens (past its anchor)
    a_anchors = sorted(rng.sample(range(45, 57), 4)) + sorted(rng.sample(range(57, 64), 2))
    b, b_anchor = _tokens(rng, 40), rng.randrange(3, 8)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    ids = [engine.submit(a, sp, anchors=a_anchors), engine.submit(b, sp, anchors=[b_anchor])]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    for rid in ids:
        engine.release(rid)
    c = b[:b_anchor] + _tokens(rng, 20)
    c[b_anchor] = (b[b_anchor] + 1 - 3) % (VOCAB - 3) + 3
    out = engine.generate(c, GREEDY)
    assert out.stats["resumed_tokens"] == b_anchor
    assert _load(path, checkpoints="none").generate(c, GREEDY).token_ids == out.token_ids
    engine.check_integrity()


def test_pure_attention_model_ignores_anchors(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path, rng_seed)
    engine = _load(tmp_path)
    prompt = _tokens(rng, 120)
    engine.generate(prompt, GREEDY, anchors=[10, 50])
    follow = prompt[:100] + _tokens(rng, 10)
    follow[100] = (prompt[100] + 1 - 3) % (VOCAB - 3) + 3
    out = engine.generate(follow, GREEDY)
    assert out.stats["reused_tokens"] == 100  # the whole common prefix, not an anchor
    assert engine.stats()["checkpoints"] is None


def test_bad_anchor_is_refused(hybrid):
    path, rng = hybrid
    engine = _load(path)
    from freetoken_agent.engine.outputs import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="outside the prompt"):
        engine.submit(_tokens(rng, 10), GREEDY, anchors=[11])
    with pytest.raises(ValueError, match="positional:N"):
        _load(path, checkpoints="every:5")


def test_recomputed_prefix_dedupes_into_the_tree(tmp_path, rng_seed):
    """A hybrid model in mode none recomputes a growing session's whole prefix every turn. Its
    copies of cached pages are swapped for the tree's when its prompt is cached, so the tree's
    chain is never pinned under a private duplicate: decoding finds pages, and a lone request
    is never preempted (it was, with 2,400 tokens in a 4,096-token pool)."""
    make_tiny("qwen3_5_moe", tmp_path, rng_seed, max_position_embeddings=4096)
    rng = random.Random(rng_seed)
    engine = _load(tmp_path, checkpoints="none", max_model_len=4096, max_batched_tokens=512)
    history = _tokens(rng, 1800)
    for _ in range(3):
        history += _tokens(rng, 300)
        out = engine.generate(history, GREEDY)
        assert out.stats["preempted"] == 0
        assert out.stats["prefilled_tokens"] == len(history)
        engine.check_integrity()


def test_a_checkpoint_on_a_sibling_page_is_found(hybrid):
    """A checkpoint inside a page hangs on the request's own partial page. A second request
    sharing the prefix caches the full page of the same tokens beside it; a third, whose
    path runs through that full page, still resumes from the checkpoint (it used to look only
    at the nodes of its own path, and re-prefilled from the start)."""
    path, rng = hybrid
    engine = _load(path)
    page = engine.config.page_size
    n = rng.randint(2, 3) * page + rng.randint(1, page - 2)  # a boundary inside a page
    first, more = _tokens(rng, n), _tokens(rng, page + 4)
    engine.generate(first, GREEDY, anchors=[n])
    engine.generate(first + more, GREEDY, anchors=[])
    # Past the end of the checkpoint's page: the third's path runs through the full page.
    third = first + more[: rng.randint(page - n % page, page)] + _tokens(rng, 5)
    out = engine.generate(third, GREEDY)
    assert out.stats["resumed_tokens"] == n
    assert out.stats["prefilled_tokens"] == len(third) - n
    cold = _load(path, checkpoints="none").generate(third, GREEDY)
    assert out.token_ids == cold.token_ids
    engine.check_integrity()


def test_a_readmission_past_the_prompt_reports_the_prompts_own_figures(hybrid):
    """Two requests in a KV pool too small for both: one is preempted while decoding and is
    readmitted from a checkpoint its own decoding took (past its prompt). Its final event's
    figures, what usage reports, are its prompt's: reused (at its first admission) and
    prefilled add up to the prompt. They used to be the work summed over admissions (reused
    48 of a 30-token prompt: Anthropic's input_tokens came out negative)."""
    path, rng = hybrid
    preempted = 0
    # Random prompts may all fit, or preempt only before a checkpoint past the prompt (seed
    # 3919953782 did in three rounds): rounds go on, each checked, until one readmits past it.
    for round_, kv in enumerate([96, 112, 128, 104, 120, 96, 112, 128, 104, 120]):
        if preempted and round_ >= 3:
            break
        engine = _load(path, kv_tokens=kv, page_size=8, overlap_schedule=False)
        prompts = [_tokens(rng, rng.randint(20, 40)) for _ in range(2)]
        sp = SamplingParams(max_tokens=45, temperature=0, ignore_eos=True)
        ids = [engine.submit(p, sp, anchor_tokens=range(VOCAB)) for p in prompts]
        finals = {}
        while engine.has_unfinished():
            finals.update((e.request_id, e) for e in engine.step() if e.finished)
        for rid, prompt in zip(ids, prompts, strict=True):
            event = finals[rid]
            assert event.error is None, event.error
            assert 0 <= event.reused_tokens <= len(prompt) - 1, (kv, event.reused_tokens)
            assert event.reused_tokens + event.prefilled_tokens == len(prompt)
            stats = engine._collect(rid).stats
            preempted += stats["preempted"] > 0 and stats["reused_tokens"] > len(prompt)
    assert preempted, "no request was readmitted past its prompt: the test is void"
