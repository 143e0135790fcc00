"""The per-turn measures the elastic bench adds beside tok/s: the spread of decode steps, the
garbage collector's time, and a host profile per step."""

import cProfile
import gc
import random
import statistics
import time

from freetoken_agent.bench.elastic_turn import host_profile
from freetoken_agent.bench.turn_run import GcClock, step_spread


def test_step_spread_reports_median_tail_and_slowest():
    rng = random.Random()
    steps = [rng.uniform(0.01, 0.02) for _ in range(rng.randrange(20, 200))]
    stall = rng.uniform(0.2, 0.5)
    steps.insert(rng.randrange(len(steps)), stall)
    out = step_spread(steps)
    assert abs(out["step_p50_ms"] - 1e3 * statistics.median(steps)) < 1e-9
    assert out["step_max_ms"] == 1e3 * stall
    assert 10 <= out["step_p90_ms"] <= 20  # one stall does not move the 90th percentile
    assert step_spread([]) == {"step_p50_ms": None, "step_p90_ms": None, "step_max_ms": None}


def test_gc_clock_times_collections_only_while_installed():
    with GcClock() as clock:
        junk = [[i] for i in range(random.randrange(10_000, 20_000))]
        gc.collect()
    assert clock.collections >= 1 and clock.seconds > 0
    seen = clock.collections
    gc.collect()
    del junk
    assert clock.collections == seen, "counted a collection after it was removed"
    assert clock not in gc.callbacks


def _work(n: int) -> int:
    return sum(range(n))


def test_host_profile_is_per_step():
    steps, calls = random.randrange(3, 9), random.randrange(2, 6)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        for _ in range(calls):
            _work(50_000)
    prof.disable()
    top = host_profile(prof, steps, top=50)
    row = next(r for r in top if r["function"].endswith("(_work)"))
    assert row["calls_per_step"] == calls
    assert row["cum_us_per_step"] >= row["own_us_per_step"] > 0
    assert [r["own_us_per_step"] for r in top] == sorted(
        (r["own_us_per_step"] for r in top), reverse=True
    )


def _tiny_engine(seed: int):
    from freetoken_agent.bench.elastic_engines import TINY_QWEN3_MOE
    from freetoken_agent.bench.random_model import random_engine

    return random_engine(dict(TINY_QWEN3_MOE), device="cpu", seed=seed, std=0.1)


def test_turn_run_in_blocks_decodes_what_a_whole_turn_does_and_times_only_its_blocks(rng_seed):
    """A turn decoded in blocks with other work between them (what an interleaved session
    does) gives the tokens of a turn decoded whole, and its decode_tok_s counts its own blocks
    only: the engine's clock, which also holds the pauses, reads slower."""
    from freetoken_agent.bench.turn_run import TurnRun, run_turn

    r = random.Random(rng_seed)
    ids = [r.randrange(3, 500) for _ in range(r.randrange(20, 60))]
    n, block, pause = r.randrange(12, 20), r.randrange(2, 5), 0.05
    whole = run_turn(_tiny_engine(rng_seed), ids, n)
    run = TurnRun(_tiny_engine(rng_seed), ids, n).start()
    blocks = 0
    while not run.done:
        run.decode(block)
        blocks += 1
        time.sleep(pause)  # another engine's block
    row = run.finish()
    assert "failed" not in row and "failed" not in whole
    assert row["answer"] == whole["answer"] and row["decoded"] == n
    assert blocks == -(-(n - 1) // block)  # n - 1 decode steps after the first token
    assert len(run.steps_s) == n - 1
    assert row["step_ms"] == 1e3 * run.decode_s / (n - 1)
    assert run.decode_s < sum(run.steps_s) + blocks * pause / 2  # no pause inside the clock
    assert row["engine_decode_tok_s"] < row["decode_tok_s"]


def test_turn_run_reports_a_refused_prompt_as_its_row():
    from freetoken_agent.bench.turn_run import TurnRun

    engine = _tiny_engine(0)
    too_long = [5] * (engine.max_model_len + 1)
    run = TurnRun(engine, too_long, 4).start()
    assert run.done
    row = run.finish()
    assert row["failed"].startswith("refused:") and "tokens" in row["failed"]
    assert not engine.has_unfinished()
