"""bench offload's figures count what the window produced and divide by it: tokens (not
engine.step() calls, one more than the forward passes under overlap scheduling), per decoded
token (a step of batch 4 makes 4); the prefill limit from the bytes the streamer moved; one
limit rule for every policy; and `--help` names every knob (issue 3)."""

from __future__ import annotations

import math
import random

import pytest

from freetoken_agent.bench import offload
from freetoken_agent.bench.elastic_engines import TINY_QWEN3_MOE
from freetoken_agent.bench.host_caps import HostCaps
from freetoken_agent.bench.offload_decode import decode_window
from freetoken_agent.bench.offload_limits import (
    add_limits,
    closing_lines,
    fill_every_slot,
    prefill_limit,
    prefill_row,
)
from freetoken_agent.bench.random_model import random_engine
from freetoken_agent.engine.experts.streaming import STREAM_GROUP


def _engine(seed: int, slots: int, **options):
    return random_engine(dict(TINY_QWEN3_MOE), device="cpu", seed=seed, std=0.1,
                         policy="transfer", expert_slots=slots, max_num_seqs=4,
                         **options)  # fmt: skip


def _window(engine, n: int, batch: int, seed: int) -> tuple[float, dict, list]:
    """decode_window's timed window, with the requests' outputs kept as it collects them."""
    outputs = []
    collect = engine._collect

    def keep(rid):
        out = collect(rid)
        outputs.append(out)
        return out

    engine._collect = keep
    rate, st = decode_window(engine, n, random.Random(seed), batch=batch, context=16)
    return rate, st, outputs


def test_overlap_on_and_off_count_the_same_tokens_and_experts_per_token(rng_seed):
    """Overlap scheduling spends n engine calls on n - 1 forward passes (the first launches,
    the last only reads): the window's tokens, its passes and every per-token counter are the
    plain loop's, and the tokens are what the requests' outputs grew by in the window."""
    rng = random.Random(rng_seed)
    n, batch, slots = rng.randint(5, 14), rng.choice([1, 2, 4]), rng.randint(3, 24)
    rows, tokens = {}, {}
    for overlap in (False, True):
        engine = _engine(rng_seed, slots)
        engine.overlap.enabled = overlap
        try:
            rate, st, outputs = _window(engine, n, batch, rng_seed)
        finally:
            engine.close()
        assert len(outputs) == batch and all(len(o.token_ids) == n for o in outputs)
        # Each sequence's first token came from its prefill, before the clock started.
        assert st["tokens"] == sum(len(o.token_ids) - 1 for o in outputs) == batch * (n - 1)
        assert st["forward_passes"] == n - 1
        assert st["engine_calls"] == n - 1 + overlap
        assert rate > 0
        rows[overlap], tokens[overlap] = st, [o.token_ids for o in outputs]
    assert tokens[True] == tokens[False]  # the same decode, so the same routing
    for key in ("experts_per_token", "fetched_per_token", "pcie_bytes_per_token"):
        assert rows[True][key] == pytest.approx(rows[False][key]), key
    assert rows[True]["miss_rate"] == pytest.approx(rows[False]["miss_rate"])


def test_batch_4_counts_experts_per_decoded_token(rng_seed):
    """At batch 4 a step decodes 4 tokens: a token's share of the step's distinct experts is at
    most what one token routes to (top_k in each MoE layer), and the limit is still
    batch / (the step's floor), the step's bytes 4 tokens' worth."""
    rng = random.Random(rng_seed)
    engine = _engine(rng_seed, rng.randint(3, 12))
    engine.overlap.enabled = rng.random() < 0.5
    spec = engine.spec
    n, batch = rng.randint(5, 12), 4
    try:
        _, st, _ = _window(engine, n, batch, rng_seed)
        expert_bytes = engine.loaded.bank.pool.expert_bytes
    finally:
        engine.close()
    assert st["tokens"] == batch * st["forward_passes"]
    assert 0 < st["experts_per_token"] <= spec.n_moe_layers * spec.top_k
    assert st["fetched_per_token"] <= st["experts_per_token"]
    assert st["pcie_bytes_per_token"] == pytest.approx(st["fetched_per_token"] * expert_bytes)
    row = {"tok_s": rng.uniform(10, 1000), **st}
    caps = HostCaps(*(rng.uniform(10e9, 150e9) for _ in range(3)))
    b_hbm, dense = rng.uniform(1e12, 5e12), rng.uniform(1e6, 1e9)
    add_limits(row, "transfer", batch, expert_bytes, dense, caps, b_hbm)
    step_experts = st["experts_per_token"] * batch  # a step's distinct (layer, expert) pairs
    miss = step_experts * st["miss_rate"] * expert_bytes
    hit = step_experts * (1 - st["miss_rate"]) * expert_bytes
    assert row["step_host_bytes"] == pytest.approx(miss)
    assert row["step_device_bytes"] == pytest.approx(dense + hit)
    floor = (dense + hit) / b_hbm + miss / min(caps.b_p + caps.b_h, caps.b_read)
    assert row["limit_tok_s"] == pytest.approx(batch / floor)
    assert row["of_limit"] == pytest.approx(row["tok_s"] * floor / batch)


def test_every_policy_gets_the_machines_limit(rng_seed):
    """The limit is the machine's (DESIGN section 7: misses leave host memory over the link
    and the CPU's reads at once, under the read cap), not the policy's: at the same bytes,
    direct and gpu-fill (no CPU branch) get the same limit as the others."""
    rng = random.Random(rng_seed)
    caps = HostCaps(*(rng.uniform(10e9, 150e9) for _ in range(3)))
    st = {"tok_s": rng.uniform(10, 500), "tokens": 40, "forward_passes": 10,
          "experts_per_token": rng.uniform(1, 96), "miss_rate": rng.random()}  # fmt: skip
    b_hbm, dense, expert_bytes = rng.uniform(1e12, 5e12), rng.uniform(1e9, 6e9), 9.4e6
    limits = {}
    for policy in offload.POLICIES:
        row = dict(st)
        add_limits(row, policy, 4, expert_bytes, dense, caps, b_hbm)
        limits[policy] = row["limit_tok_s"]
    link = min(caps.b_p + caps.b_h, caps.b_read)
    floor = row["step_device_bytes"] / b_hbm + row["step_host_bytes"] / link
    for policy, limit in limits.items():
        assert limit == pytest.approx(4 / floor), policy


def test_the_prefill_limit_counts_every_chunks_streamed_bytes(rng_seed):
    """A prompt of n tokens, n not a multiple of the chunk: each of its ceil(n / chunk) chunks
    streams every layer's experts not already resident, so its limit is
    n / (ceil(n / chunk) * those bytes / B_P), the bytes the streamer's own count."""
    rng = random.Random(rng_seed)
    chunk = rng.choice([64, 96, 128])
    stream_min = 16
    # the last chunk partial, but streamed too (at least stream_min tokens)
    n = chunk * rng.randint(1, 3) + rng.randint(stream_min, chunk - 1)
    engine = _engine(rng_seed, rng.randint(4, 30), max_batched_tokens=chunk,
                     stream_min_tokens=stream_min, max_model_len=4096)  # fmt: skip
    bank = engine.loaded.bank
    try:
        decode_window(engine, rng.randint(3, 6), rng, batch=2, context=16)  # slots filled
        resident = sum(slot >= 0 for slot in bank.cache.host_slot_of)
        h2d0 = bank.streamer.bytes_h2d
        b_p = rng.uniform(1e9, 60e9)
        row = prefill_row(engine, n, chunk, b_p, rng)
        moved = bank.streamer.bytes_h2d - h2d0
        pool = bank.pool
        own = None if bank.streamer.lend else min(STREAM_GROUP, bank.n_experts)
    finally:
        engine.close()
    chunks = math.ceil(n / chunk)
    assert chunks >= 2 and n % chunk
    assert row["ring_group"] == (own or bank.streamer.group)  # a ring of its own: its rows
    not_resident = (pool.n_rows - resident) * pool.expert_bytes
    assert 0 < resident < pool.n_rows
    assert moved == chunks * not_resident  # what "the bytes not already resident" measured
    assert row["link_bytes_counted"] and row["chunks"] == chunks
    assert row["link_bytes"] == moved
    assert row["limit_tok_s"] == pytest.approx(n / (chunks * not_resident / b_p))
    assert row["limit_tok_s"] == pytest.approx(prefill_limit(n, chunk, b_p, not_resident))
    assert row["of_limit"] == pytest.approx(row["tok_s"] / row["limit_tok_s"])


def test_a_warm_prefill_streams_only_the_experts_no_slot_holds(rng_seed):
    """The `_warm` prefill rows: every slot given an expert first (`fill_every_slot`, as a long
    decode leaves the cache), so the row measures issue 3's "streaming limit of the bytes not
    already resident": each chunk moves the pool less the slots' experts, and the greedy
    tokens are a cold engine's (placement never changes results)."""
    from freetoken_agent.engine.sampling_params import SamplingParams

    rng = random.Random(rng_seed)
    chunk, stream_min = rng.choice([64, 96, 128]), 16
    n = chunk * rng.randint(1, 2) + rng.randint(stream_min, chunk - 1)
    slots = rng.randint(4, 30)
    options = dict(max_batched_tokens=chunk, stream_min_tokens=stream_min, max_model_len=4096)
    warm, cold = _engine(rng_seed, slots, **options), _engine(rng_seed, slots, **options)
    bank = warm.loaded.bank
    prompt = [rng.randrange(warm.spec.vocab_size) for _ in range(n)]
    greedy = SamplingParams(max_tokens=rng.randint(2, 6), temperature=0, ignore_eos=True)
    try:
        resident = fill_every_slot(bank, rng)
        held = [lid for lid, slot in enumerate(bank.cache._slot_of) if slot >= 0]
        h2d0 = bank.streamer.bytes_h2d
        row = prefill_row(warm, n, chunk, rng.uniform(1e9, 60e9), rng)
        moved = bank.streamer.bytes_h2d - h2d0
        fill_every_slot(bank, rng)
        assert warm.generate(prompt, greedy).token_ids == cold.generate(prompt, greedy).token_ids
        pool = bank.pool
    finally:
        warm.close()
        cold.close()
    assert resident == bank.cache.n_slots == len(set(held)) < pool.n_rows
    chunks = math.ceil(n / chunk)
    assert moved == row["link_bytes"] == chunks * (pool.n_rows - resident) * pool.expert_bytes


def test_a_prefill_figure_above_its_limit_is_flagged(rng_seed):
    """The run's closing lines warn about prefill rows above their limit, as about decode rows."""
    rng = random.Random(rng_seed)
    limit = rng.uniform(1e3, 1e4)
    report = {"decode": {}, "prefill": {
        "8192_double": {"tok_s": limit * rng.uniform(1.01, 1.5), "limit_tok_s": limit},
        "4096_single": {"tok_s": limit * rng.uniform(0.5, 0.99), "limit_tok_s": limit},
    }}  # fmt: skip
    for row in report["prefill"].values():
        row["of_limit"] = row["tok_s"] / row["limit_tok_s"]
    warnings = [line for line in closing_lines(report) if line.startswith("WARNING")]
    assert len(warnings) == 1 and "8192_double" in warnings[0]


def _help(main, argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exited:  # (argparse's --help exits)
        code = exited.code
    assert code in (0, None)
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere


ENV_KNOBS = ("FREETOKEN_CPU_THREADS", "FREETOKEN_WORKER_CPUS", "FREETOKEN_WORKER_TEAM",
             "FREETOKEN_HUGE_PAGES", "FREETOKEN_CPU_EXPERTS")  # fmt: skip


def test_offload_help_names_every_knob(capsys):
    text = _help(offload.main, ["--help"], capsys)
    options = text.index("options:")  # (the usage line names every option first)
    for knob in ENV_KNOBS:
        assert knob in text, knob
    for option, default in (("--rounds", "3"), ("--chunk", "8192"), ("--context", "64"),
                            ("--prefill", "4096 8192 16384"), ("--batches", "1 4")):  # fmt: skip
        at = text.index(option + " ", options)
        assert f"default: {default})" in text[at : at + 700], option
    regimes = text[text.index("--regimes REGIMES", options) :]
    assert "native uniform zipf:1.0,loc:0.7" in regimes[:900]
    assert "skew 1.0" in regimes[:900] and "locality 0.7" in regimes[:900]
    rounds = text[text.index("--rounds ROUNDS", options) :][:500]
    assert "at 2 rounds the slower" in rounds
    path = text[text.index("--adaptive-path {", options) :][:900]
    for name in ("stops (", "device (", "shared (", "split ("):
        assert name in path, name
    assert "the three" not in path


def test_bench_help_names_the_environment(capsys):
    from freetoken_agent.bench.__main__ import main

    text = _help(main, ["--help"], capsys)
    for knob in ENV_KNOBS:
        assert knob in text, knob


def test_cpu_experts_says_which_read_it_keeps():
    """limits.host_read_bandwidth keeps the fastest of its repeats, not their median."""
    from freetoken_agent.bench import cpu_experts

    assert "median of 7" not in cpu_experts.__doc__
    assert "fastest of 7" in " ".join(cpu_experts.__doc__.split())


def test_link_bytes_count_the_misses_read_in_place(rng_seed):
    """Under `direct` the MoE kernels read misses from the pool over the link as well as
    filling slots: the row's link bytes a token are both, each an expert's bytes."""
    from freetoken_agent.bench.offload_decode import start_policy

    rng = random.Random(rng_seed)
    engine = _engine(rng_seed, rng.randint(3, 12))
    bank = engine.loaded.bank
    try:
        start_policy(engine, bank, "direct", 1e9, 1e9)
        decode_window(engine, rng.randint(3, 6), random.Random(rng_seed), batch=1, context=16)
        _, st, _ = _window(engine, rng.randint(12, 24), rng.choice([1, 2]), rng_seed + 1)
        expert_bytes = bank.pool.expert_bytes
    finally:
        engine.close()
    assert st["host_reads_per_token"] > 0, "direct read no miss in place: the test shows nothing"
    link = (st["fetched_per_token"] + st["host_reads_per_token"]) * expert_bytes
    assert st["pcie_bytes_per_token"] == pytest.approx(link)


def test_a_repeated_prefill_row_reports_its_median_run(rng_seed):
    """`prefill_row` with repeats: each run after `prepare` (here the cache emptied), the
    median run's tok/s (the slower middle with an even count) and its bytes, every run's tok/s
    beside it; each run from an emptied cache moves the whole pool once a chunk."""
    rng = random.Random(rng_seed)
    chunk, stream_min = rng.choice([64, 96]), 16
    n = chunk + rng.randint(stream_min, chunk - 1)
    engine = _engine(rng_seed, rng.randint(4, 30), max_batched_tokens=chunk,
                     stream_min_tokens=stream_min, max_model_len=4096)  # fmt: skip
    bank = engine.loaded.bank
    repeats, prepared = rng.randint(2, 4), []
    try:
        fill_every_slot(bank, rng)  # the first prepare must empty it
        row = prefill_row(engine, n, chunk, rng.uniform(1e9, 60e9), rng, repeats,
                          lambda: prepared.append(bank.cache.reset()))  # fmt: skip
    finally:
        engine.close()
    runs = row["tok_s_runs"]
    assert len(prepared) == len(runs) == repeats
    assert row["tok_s"] == sorted(runs)[(repeats - 1) // 2]
    assert row["link_bytes"] == math.ceil(n / chunk) * bank.pool.nbytes
