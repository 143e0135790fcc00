"""bench side-fill: the pieces an expert is copied in, the copy index, the argument checks, and
on the device every variant's copies landing where the step says."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from freetoken_agent.bench import side_fill
from freetoken_agent.bench.side_fill import Layout, copy_index, miss_layers


def _layout(rng: random.Random) -> Layout:
    pieces = rng.choice([1, 2, 3, 4, 6])
    return Layout(2 * pieces * rng.randint(1, 40), pieces)


def test_an_experts_halves_are_its_pieces_in_order(rng_seed):
    rng = random.Random(rng_seed)
    layout = _layout(rng)
    n = rng.randint(2, 9)
    pool = torch.randn(n, layout.expert_elems, generator=torch.Generator().manual_seed(rng_seed))
    pieces = pool.view(-1, layout.piece_elems)
    half = layout.expert_elems // 2
    for expert in range(n):
        first, second = layout.rows(expert, 0), layout.rows(expert, 1)
        assert torch.equal(pieces[first].reshape(-1), pool[expert, :half])
        assert torch.equal(pieces[second].reshape(-1), pool[expert, half:])


@pytest.mark.parametrize("whole", [False, True])
def test_the_copy_index_puts_each_drawn_row_in_its_slot(rng_seed, whole):
    """Copies done as the step's kernels do them (destination piece = source piece, in the
    index's order) leave slot m holding pool row rows[m]: whole, or its first half only."""
    rng = random.Random(rng_seed)
    layout = _layout(rng)
    n, misses = rng.randint(2, 9), rng.randint(1, 5)
    gen = torch.Generator().manual_seed(rng_seed)
    pool = torch.randn(n, layout.expert_elems, generator=gen)
    slots = torch.zeros(misses, layout.expert_elems)
    rows = [rng.randrange(n) for _ in range(misses)]
    index = copy_index(layout, whole, rows)
    per_miss = 2 * layout.pieces * (2 if whole else 1)
    assert len(index) == misses * per_miss
    src_pieces, dst_pieces = pool.view(-1, layout.piece_elems), slots.view(-1, layout.piece_elems)
    for m in range(misses):
        entry = index[m * per_miss : (m + 1) * per_miss]
        src, dst = entry[: per_miss // 2], entry[per_miss // 2 :]
        for s, d in zip(src, dst, strict=True):
            dst_pieces[d] = src_pieces[s]
    half = layout.expert_elems // 2
    for m, row in enumerate(rows):
        copied = 2 * half if whole else half
        assert torch.equal(slots[m, :copied], pool[row, :copied])
        assert not slots[m, copied:].any()


def test_bad_arguments_are_refused_by_name(rng_seed):
    rng = random.Random(rng_seed)
    with pytest.raises(ValueError, match="equal pieces"):
        Layout(2 * 5 * rng.randint(1, 9) + 2, 5)
    with pytest.raises(ValueError, match="equal pieces"):
        side_fill.main(["--pieces", "7"])  # the real expert: 2^19 x 9 elements
    layers = rng.randint(1, 60)
    with pytest.raises(ValueError, match="--miss-layers"):
        side_fill.main(["--layers", str(layers), "--miss-layers", str(layers + 1)])
    chosen = miss_layers(layers, rng.randint(0, layers), rng)
    assert chosen == sorted(set(chosen)) and all(0 <= layer < layers for layer in chosen)


@pytest.mark.gpu
def test_every_variants_copies_land_in_the_slots(tmp_path, rng_seed):
    """A small step measured end to end: each variant's slots hold its drawn rows after the
    timed replays (measure checks them), and its bytes on and behind the step are its own."""
    rng = random.Random(rng_seed)
    args = argparse.Namespace(layers=rng.randint(3, 6), miss_layers=2, layer_mb=0.5,
                              pieces=[1, 3], batch=rng.choice([1, 4]), steps=3, hidden=256,
                              inter=128, pool=8, seed=rng_seed)  # fmt: skip
    report = side_fill.measure(args, torch.device("cuda"))
    rows = report["rows"]
    assert sorted(rows) == sorted(["hit", "full", "half"] + [
        f"half+{kind}|pieces{p}" for kind in ("side-sm", "side-dma", "early-dma")
        for p in (1, 3)])  # fmt: skip
    expert_mb = 3 * 256 * 128 * 2 / 1e6
    assert rows["hit"]["own_mb"] == 0 and rows["full"]["own_mb"] == pytest.approx(2 * expert_mb)
    assert rows["half"]["own_mb"] == pytest.approx(expert_mb)
    for key, row in rows.items():
        assert row["step_ms"] > 0 and row["p10_ms"] <= row["step_ms"] <= row["p90_ms"]
        if "|pieces" in key:  # the other half copied behind
            assert row["behind_mb"] == pytest.approx(expert_mb) and "delay_over_half_ms" in row
