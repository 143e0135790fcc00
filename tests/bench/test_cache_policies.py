"""bench cache-policies: the replayed policies on random traces. Belady is the optimum (an
exhaustive search agrees on small traces, and no policy misses less), every policy misses only
compulsorily when the cache holds every expert, pinned experts never miss, and LRU with one
slot misses at every change of expert."""

from __future__ import annotations

import functools
import json
import random

from freetoken_agent.bench import cache_policies as cp


def _optimal_misses(lids: list[int], slots: int) -> int:
    """Exhaustive: the fewest misses over every choice of victim."""

    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(lids):
            return 0
        if lids[i] in cache:
            return best(i + 1, cache)
        if len(cache) < slots:
            return 1 + best(i + 1, cache | {lids[i]})
        return 1 + min(best(i + 1, (cache - {v}) | {lids[i]}) for v in cache)

    return best(0, frozenset())


def test_belady_is_the_optimum(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(30):
        n, distinct, slots = rng.randint(1, 12), rng.randint(1, 6), rng.randint(1, 4)
        lids = [rng.randrange(distinct) for _ in range(n)]
        assert round(cp.belady(lids, slots, 0) * n) == _optimal_misses(lids, slots), lids


def test_no_policy_beats_belady_and_all_agree_when_everything_fits(rng_seed):
    rng = random.Random(rng_seed)
    lids = [rng.randrange(60) if rng.random() < 0.5 else rng.randrange(8) for _ in range(3000)]
    first = rng.randrange(0, 1000)
    for slots in (rng.randint(4, 40), 60):
        bound = cp.belady(lids, slots, first)
        rates = [cp.lru(lids, slots, first), cp.w_tinylfu(lids, slots, first, halve_every=500),
                 cp.popular_pins(lids, slots, first, 60, 1, 1, 0.5, every=50)]  # fmt: skip
        assert all(rate >= bound for rate in rates), (slots, bound, rates)
    compulsory = len({x for i, x in enumerate(lids) if i >= first and x not in lids[:i]})
    rate = compulsory / (len(lids) - first)
    assert cp.lru(lids, 60, first) == cp.belady(lids, 60, first) == rate


def test_lru_edges(rng_seed):
    rng = random.Random(rng_seed)
    lids = [rng.randrange(5) for _ in range(200)]
    changes = sum(1 for i in range(len(lids)) if i == 0 or lids[i] != lids[i - 1])
    assert cp.lru(lids, 1, 0) == changes / len(lids)
    assert cp.lru(lids, 2, 0, pinned=frozenset(range(5))) == 0.0  # every expert pinned


def test_the_bench_writes_its_rows(tmp_path, rng_seed):
    seed = random.Random(rng_seed).randrange(1000)
    args = ["--layers", "3", "--experts", "16", "--top-k", "2", "--slots", "20",
            "--tokens", "120", "--warm", "20", "--pinned", "4", "--seed", str(seed),
            "--out", str(tmp_path)]  # fmt: skip
    assert cp.main(args) == 0
    rows = json.loads((tmp_path / "cache_policies_3l.json").read_text())["miss_rate"]
    assert set(rows) == {"lru", "w-tinylfu", "popular-0.5", "popular-0.8", "pinned-4", "belady"}
    assert all(rows["belady"] <= rate <= 1.0 for rate in rows.values())


def test_w_tinylfu_keeps_hot_experts_through_a_scan(rng_seed):
    """A few hot experts between runs of ones used once: LRU loses the hot ones to each run;
    W-TinyLFU's admission keeps them (a once-used expert never outranks a hot one), so after
    the warm-up it misses only the once-used experts."""
    rng = random.Random(rng_seed)
    hot, slots = rng.randint(2, 5), rng.randint(8, 12)
    lids, fresh = [], 1000
    for _ in range(300):
        lids += [rng.randrange(hot)]
        for _ in range(rng.randint(slots, 2 * slots)):  # a run longer than the cache
            lids.append(fresh)
            fresh += 1
    first = len(lids) // 3
    once = sum(1 for x in lids[first:] if x >= 1000)
    assert cp.w_tinylfu(lids, slots, first) == once / (len(lids) - first)
    assert cp.lru(lids, slots, first) > once / (len(lids) - first)


def test_popular_pins_keep_hot_experts_through_a_scan(rng_seed):
    """The engine's popularity pins on the scan trace above: once the hot experts are pinned
    (chosen every step, so each as soon as it is first used), only the once-used experts
    miss; LRU loses the hot ones to every run."""
    rng = random.Random(rng_seed)
    hot, slots = rng.randint(2, 5), rng.randint(8, 12)
    lids, fresh = [], 1000
    for _ in range(300):
        lids += [rng.randrange(hot)]
        for _ in range(rng.randint(slots, 2 * slots)):
            lids.append(fresh)
            fresh += 1
    first = len(lids) // 3
    once = sum(1 for x in lids[first:] if x >= 1000)
    n_lids = fresh  # one layer of every expert id used, one use a step
    got = cp.popular_pins(lids, slots, first, n_lids, 1, 1, hot / slots + 0.01, every=1)
    assert got == once / (len(lids) - first)
    assert cp.lru(lids, slots, first) > got
