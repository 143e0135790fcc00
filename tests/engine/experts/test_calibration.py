"""Bandwidth calibration: measured, cached per machine and shape, used by the adaptive policy,
and corrected online."""

from __future__ import annotations

import json
import logging
import platform
import random
import time

import pytest
import torch
from tiny_models import make_tiny

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.engine.experts import calibration, device_path
from freetoken_agent.engine.experts.policy import CPU_KNEE_TOKENS, Bandwidths
from freetoken_agent.kernels.expert_fills import (
    COPY_PROGRAM_CHOICES,
    COPY_PROGRAMS,
    COPY_PROGRAMS_MAX,
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_calibrate_measures_and_caches(cache_dir):
    cal = calibration.calibrate(64, 32, torch.float32)
    assert cal.cpu > 1e6 and cal.pcie > 0 and cal.expert_bytes == 3 * 64 * 32 * 4
    assert 1.0 <= cal.knee <= calibration.KNEE_PROBE_TOKENS
    assert cal.copy_programs in COPY_PROGRAM_CHOICES
    again = calibration.cached(64, 32, torch.float32)
    assert again == cal
    assert calibration.cached(64, 48, torch.float32) is None  # another shape: not measured


def test_a_calibration_cached_before_the_knee_was_measured_takes_the_default(cache_dir):
    cal = calibration.calibrate(64, 32, torch.float32)
    path = calibration.cache_file()
    table = json.loads(path.read_text())
    for entry in table.values():
        del entry["knee"]
    path.write_text(json.dumps(table))
    old = calibration.cached(64, 32, torch.float32)
    assert old.knee == CPU_KNEE_TOKENS and (old.pcie, old.cpu) == (cal.pcie, cal.cpu)


def test_a_calibration_cached_before_the_copy_grid_was_timed_takes_the_default(cache_dir, rng_seed):
    entry = _entry(random.Random(rng_seed))
    path = calibration.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({calibration.machine_key(64, 32, torch.float32): entry}))
    old = calibration.cached(64, 32, torch.float32)
    assert old.copy_programs == COPY_PROGRAMS and old.pcie == entry["pcie"]


@pytest.mark.parametrize("policy", ["adaptive", "gpu-fill"])
def test_the_device_path_copies_on_the_grid_calibrated_or_chosen(
    cache_dir, tmp_path, rng_seed, policy, monkeypatch
):
    """The copy kernel's grid comes from EngineConfig.copy_programs, else from this host's
    calibration, and every fill copy of the device path is launched with it."""
    rng = random.Random(rng_seed)
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    timed = rng.choice([p for p in COPY_PROGRAM_CHOICES if p != COPY_PROGRAMS])
    path = calibration.cache_file()
    path.parent.mkdir(parents=True)
    entry = {**_entry(rng), "copy_programs": timed}
    path.write_text(json.dumps({calibration.machine_key(64, 32, torch.float32): entry}))
    grids = []
    copy = device_path.copy_fills
    monkeypatch.setattr(device_path, "copy_fills",
                        lambda *a, **k: grids.append(k["programs"]) or copy(*a, **k))  # fmt: skip
    chosen = rng.randrange(1, COPY_PROGRAMS_MAX + 1)
    for asked, expect in ((None, timed), (chosen, chosen)):
        engine = Engine.load(tmp_path / "m", device="cpu", policy=policy, expert_slots=3,
                             copy_programs=asked, progress=False)  # fmt: skip
        assert engine.loaded.bank.copy_programs == expect
        grids.clear()
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 9))]
        engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
        assert grids and set(grids) == {expect}, grids
        engine.close()


def test_the_knee_separates_reading_from_computing():
    """One token's time is one read of the expert; far past the knee each token adds work:
    a wide expert (compute ~ tokens) measures a knee well inside the probe's range. The best
    of three: a timing on a 2-core machine shared with other tests' threads once came out at
    the probe's end."""
    pool = calibration.probe_pool(512, 256, torch.bfloat16, 64 << 20)
    knees = [calibration.measure_knee(512, 256, torch.bfloat16, pool) for _ in range(3)]
    assert all(k >= 1.0 for k in knees) and min(knees) < calibration.KNEE_PROBE_TOKENS, knees


def test_adaptive_engine_uses_the_cached_bandwidths(cache_dir, tmp_path, rng_seed):
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    cal = calibration.calibrate(64, 32, torch.float32)
    engine = Engine.load(
        tmp_path / "m", device="cpu", policy="adaptive", expert_slots=3, progress=False
    )
    bw = engine.loaded.bank.bandwidths
    assert (bw.pcie, bw.cpu, bw.knee) == (cal.pcie, cal.cpu, cal.knee)


def test_online_update_moves_toward_observations():
    est = 10e9
    for _ in range(50):
        est = calibration.update(est, bytes_moved=40_000_000, seconds=1e-3)  # 40 GB/s seen
    assert abs(est - 40e9) / 40e9 < 1e-3
    assert calibration.update(est, 0, 1.0) == est  # nothing measured, nothing changes


def _entry(rng: random.Random) -> dict:
    """A valid entry for 64x32 fp32 experts, with random bandwidths."""
    bandwidths = dict(pcie=rng.uniform(1e9, 6e10), cpu=rng.uniform(1e9, 6e10))
    return dict(**bandwidths, expert_bytes=3 * 64 * 32 * 4, measured_at=time.time(),
                knee=rng.uniform(1.0, 64.0))  # fmt: skip


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda e: {**e, "h2d_streams": 2}, "unknown field"),  # another version's entry
        (lambda e: {k: v for k, v in e.items() if k != "cpu"}, "missing field"),
        (lambda e: {**e, "pcie": 0.0}, "pcie is 0.0"),  # a failed measurement
        (lambda e: {**e, "cpu": -e["cpu"]}, "cpu is -"),
        (lambda e: {**e, "knee": float("nan")}, "knee is nan"),
        (lambda e: {**e, "cpu": "fast"}, "cpu is 'fast'"),
        (lambda e: {**e, "expert_bytes": e["expert_bytes"] // 2}, "-byte experts"),
        (lambda e: "stale", "the entry is a string"),
        (lambda e: None, "the entry is null"),
        (lambda e: {**e, "copy_programs": 0}, "copy_programs is 0"),
        (lambda e: {**e, "copy_programs": True}, "copy_programs is True"),
        (lambda e: {**e, "copy_programs": 32.0}, "copy_programs is 32.0"),
        (lambda e: {**e, "copy_programs": COPY_PROGRAMS_MAX + 1}, "not a grid of 1 to"),
    ],
)
def test_a_bad_cache_entry_is_ignored_with_one_warning(
    cache_dir, tmp_path, rng_seed, caplog, damage, says
):
    """Engine.load runs on the defaults (never a crash, nor a division by a zero bandwidth
    where the stream threshold is derived), and says once why."""
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)
    path = calibration.cache_file()
    path.parent.mkdir(parents=True)
    key = calibration.machine_key(64, 32, torch.float32)
    path.write_text(json.dumps({key: damage(_entry(random.Random(rng_seed)))}))
    with caplog.at_level(logging.WARNING, logger="freetoken"):
        engine = Engine.load(tmp_path / "m", device="cpu", policy="adaptive", expert_slots=3,
                             stream_min_tokens=None, progress=False)  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "bandwidth calibration" in r.getMessage()]
    assert len(warned) == 1 and says in warned[0] and str(path) in warned[0], warned
    bw = engine.loaded.bank.bandwidths
    assert (bw.pcie, bw.cpu, bw.knee) == (Bandwidths().pcie, Bandwidths().cpu, CPU_KNEE_TOKENS)


@pytest.mark.parametrize(
    "text, says",
    [("[1, 2]", "holds a list"), ("{not json", "does not parse"), ('"x"', "holds a string")],
)
def test_a_cache_file_that_is_no_table_is_ignored_and_measured_again(
    cache_dir, text, says, caplog, monkeypatch
):
    path = calibration.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="freetoken"):
        assert calibration.cached(64, 32, torch.float32) is None
    assert len(caplog.records) == 1 and says in caplog.text, caplog.text
    # `freetoken calibrate` replaces it (a small probe pool: the measurement is not the point)
    small = calibration.probe_pool
    monkeypatch.setattr(calibration, "probe_pool", lambda h, i, d: small(h, i, d, 8 << 20))
    cal = calibration.calibrate(64, 32, torch.float32)
    assert calibration.cached(64, 32, torch.float32) == cal


def test_the_machine_key_names_the_cpu_model_and_the_cache_format(
    cache_dir, tmp_path, monkeypatch, rng_seed
):
    """platform.processor() is "x86_64" on every x86 Linux machine: the key takes the model
    name from /proc/cpuinfo, and the cache format, so another version's entries are not
    trusted."""
    rng = random.Random(rng_seed)
    old_key = f"cpu|{platform.processor() or platform.machine()}|64x32|torch.float32"
    path = calibration.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({old_key: _entry(rng)}))  # written by the format before
    assert calibration.cached(64, 32, torch.float32) is None
    keys = []
    for _ in range(2):
        model = f"Vendor(R) Chip {rng.randrange(10**9)} @ {rng.uniform(1, 5):.2f}GHz"
        info = tmp_path / "cpuinfo"
        cpu = f"vendor_id\t: Vendor\nmodel name\t: {model}\nflags\t\t: fpu sse2\n"
        info.write_text(f"processor\t: 0\n{cpu}\nprocessor\t: 1\n{cpu}")
        monkeypatch.setattr(calibration, "CPUINFO", info, raising=False)
        keys.append(calibration.machine_key(64, 32, torch.float32))
        assert model in keys[-1] and f"v{calibration.FORMAT}|" in keys[-1]
    assert keys[0] != keys[1]
    monkeypatch.setattr(calibration, "CPUINFO", tmp_path / "absent")  # not Linux
    assert (platform.processor() or platform.machine()) in calibration.machine_key(
        64, 32, torch.float32
    )


def test_the_fastest_grid_is_the_fewest_programs_near_the_best_rate(rng_seed):
    """Rates drawn close together (within 6%): the grid kept is within 3% of the best, and no
    smaller grid is."""
    rng = random.Random(rng_seed)
    for _ in range(20):
        top = rng.uniform(1e9, 6e10)
        rates = {p: top * rng.uniform(0.94, 1.0) for p in COPY_PROGRAM_CHOICES}
        kept, best = calibration.fastest_grid(rates), max(rates.values())
        assert rates[kept] >= 0.97 * best, (rates, kept)
        assert all(rates[p] < 0.97 * best for p in rates if p < kept), (rates, kept)


@pytest.mark.gpu
def test_the_copy_grid_is_timed_on_the_device(rng_seed):
    """Every grid of COPY_PROGRAM_CHOICES copies real-shaped experts from pinned memory; the
    one kept moves them at a rate the link allows (more than 1 GB/s, less than HBM's)."""
    rng = random.Random(rng_seed)
    hidden, inter = rng.choice([(2048, 768), (1024, 512)])
    rates = calibration.copy_grid_rates(hidden, inter, torch.bfloat16)
    print(f"copy grids {hidden}x{inter}, GB/s:", {p: round(r / 1e9, 1) for p, r in rates.items()})
    assert set(rates) == set(COPY_PROGRAM_CHOICES)
    assert all(1e9 < r < 1e12 for r in rates.values())
    programs, rate = calibration.measure_copy_programs(hidden, inter, torch.bfloat16)
    assert programs in COPY_PROGRAM_CHOICES and 1e9 < rate < 1e12


def _refuse_pinning(monkeypatch) -> None:
    """As torch fails when the driver refuses page-locked memory (a memlock limit)."""

    def refuse(self, *args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)\nmore lines")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)


def test_memory_that_cannot_be_pinned_is_used_as_it_is_with_one_warning(
    monkeypatch, caplog, rng_seed
):
    """`freetoken calibrate` crashed with the CUDA error where pinning failed; the engine's
    own pool falls back with a warning, and so does the calibration now."""
    _refuse_pinning(monkeypatch)
    host = torch.randn(random.Random(rng_seed).randint(1, 64))
    with caplog.at_level(logging.WARNING, logger="freetoken.experts"):
        got = calibration._pinned(host, "timed from pageable memory")
    assert got is host and torch.equal(got, host)
    assert len(caplog.records) == 1
    says = caplog.records[0].getMessage()
    assert "could not be pinned (CUDA error: out of memory (cudaHostAlloc))" in says, says
    assert says.endswith("timed from pageable memory") and "more lines" not in says


@pytest.mark.gpu
def test_calibrate_runs_where_memory_cannot_be_pinned(monkeypatch, caplog):
    """B_P timed from pageable memory, the copy grid left untimed (its device paths need
    pinned memory), each with one warning: no CUDA error."""
    _refuse_pinning(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="freetoken.experts"):
        pcie = calibration.measure_pcie(3 * 1024 * 512 * 2)
        rates = calibration.copy_grid_rates(1024, 512, torch.bfloat16)
    print(f"pageable B_P {pcie / 1e9:.1f} GB/s")
    assert 1e8 < pcie < 1e12 and rates == {}
    assert sum("could not be pinned" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.gpu
def test_a_model_without_a_calibration_entry_is_told_so(cache_dir, tmp_path, rng_seed, caplog):
    """An entry is per machine, expert shape and dtype: a model of another shape than the one
    calibrated ran the q* split on defaults with an INFO line nobody saw. One warning names
    the shape; calibrated for it, none."""
    make_tiny("qwen3_moe", tmp_path / "m", rng_seed, dtype=torch.bfloat16)
    load = dict(device="cuda", policy="adaptive", expert_slots=2, progress=False, kv_tokens=256)
    with caplog.at_level(logging.WARNING, logger="freetoken.experts"):
        engine = Engine.load(tmp_path / "m", **load)
    says = [r.getMessage() for r in caplog.records if "no bandwidth calibration" in r.getMessage()]
    spec = engine.spec
    assert (
        len(says) == 1
        and f"({spec.hidden_size} x {spec.moe_intermediate_size} bfloat16)" in says[0]
    )
    del engine
    calibration.calibrate(spec.hidden_size, spec.moe_intermediate_size, torch.bfloat16)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="freetoken.experts"):
        Engine.load(tmp_path / "m", **load)
    assert not any("no bandwidth calibration" in r.getMessage() for r in caplog.records)
