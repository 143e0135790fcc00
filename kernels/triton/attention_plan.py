"""Paged attention's launch plan (kernels/triton/paged_attention.py): the tile table, the
split-KV policy and the grid of one launch, from python ints only, so a captured CUDA graph
replays the same plan whatever the device-side lengths hold."""

# Shape legend (paged_attention.py's): T query tokens, B sequences, Hq / Hkv heads, D head dim,
# NS kv splits; BLOCK_M rows = BLOCK_Q tokens x HEADS heads of one GQA group.

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int  # query rows per program (tokens x heads of one GQA group), >= 16 for tl.dot
    block_n: int  # kv positions per inner step, >= 16
    num_warps: int
    num_stages: int


# Tile table keyed by device class, then (tile class, padded head dim). "decode": at most 16 rows
# per sequence (decode and short speculative chunks): memory-bound, the tile only needs enough
# bytes in flight. "small": up to 64 rows. "prefill": compute-bound flash-attention tiles; D=256
# halves both sides so K/V stages fit in shared memory. Starting points for the H200 (sm_90):
# add a device key beside "default" once tuned on another machine.
_TILES: dict[str, dict[tuple[str, int], Tiles]] = {
    "default": {
        # 8 warps on 64-wide steps (same splits as 4 warps): the 48-layer b=1 step at 256 /
        # 4096 / 8192 prompt tokens 302.9 / 277.6 / 258.9 tok/s against 300.3 / 269.9 / 246.9
        # with 4 warps, b=4 within 0.4% (twenty-sixth session). (16, 128, 4, 2) attends
        # faster still from 4k tokens up in the kernel bench (b=1 16k 23.9 against 29.3 us a
        # layer), but at a 300-token context the 48-layer b=1 step lost 2.6% with it (fewer,
        # longer splits; twenty-fifth session): not taken while one graph serves every
        # context length.
        **{("decode", d): Tiles(16, 64, 8, 3) for d in (16, 32, 64, 128)},
        ("decode", 256): Tiles(16, 32, 4, 3),
        **{("small", d): Tiles(64, 64, 4, 3) for d in (16, 32, 64, 128)},
        ("small", 256): Tiles(64, 32, 8, 2),
        **{("prefill", d): Tiles(128, 64, 4, 3) for d in (16, 32)},
        **{("prefill", d): Tiles(128, 64, 8, 3) for d in (64, 128)},
        ("prefill", 256): Tiles(64, 32, 8, 2),
    },
}
_TILE_CLASS_ROWS = (("decode", 16), ("small", 64))  # rows per sequence -> class; else "prefill"

# Split-KV policy: aim at this many programs per SM, never cut a sequence of more than
# short_tiles tiles into pieces of fewer than min_tiles (every split adds a write and a read of
# D fp32 partials per row, and the combine reads them all); a short one takes a tile a split,
# where the chain of dependent loads in each program, not the combine, is the cost. On the
# H200 (bench attention-kernel, b=1, 64-wide tiles, twenty-fifth session): 1k tokens, 16
# splits of one tile 10.2 us a layer against 8 of two 10.5; 4k, 32 of two 15.5 against 64 of
# one 20.9; 16k and 32k, ~66 splits of 4 and 8 tiles. A 300-token context at the 48-layer b=1
# step: 300.2 tok/s with one tile a split (empty splits then still stored partials) against
# 295.8 with two (empty splits exiting). The rule, measured (twenty-sixth session): a 256-token
# prompt decodes at 300.4 tok/s under a 32k-token graph bound against 300.0 under a 4k one.
_SPLIT_POLICY = {"programs_per_sm": 2, "min_tiles": 2, "short_tiles": 16, "max_splits": 128}
SHORT_TILES = _SPLIT_POLICY["short_tiles"]
_SPLITS_PAD = triton.next_power_of_2(_SPLIT_POLICY["max_splits"])  # the reduce's split tile
_INTERPRETER_SMS = 8  # pretend SM count on the CPU, so the split heuristic runs there too
# A counter buffer's entries: one per (q block, kv head) program of a split launch. The split
# heuristic splits only launches of fewer than programs_per_sm x SMs programs (264 on an H200);
# a launch with more (a test's forced split count) combines in the second kernel.
COUNTERS = 1024


@functools.cache
def _device_facts(device_index: int) -> tuple[str, int]:
    # (tile-table key, SM count): host-side property queries, no device sync (capture-safe).
    props = torch.cuda.get_device_properties(device_index)
    return f"sm{props.major}{props.minor}", props.multi_processor_count


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Grid and tiles of one launch, from python ints only (identical on every graph replay)."""

    tiles: Tiles
    heads: int  # HEADS: query heads of one GQA group per program
    block_q: int  # BLOCK_Q: tokens per program
    head_chunks: int  # programs per kv head (> 1 only when G > BLOCK_M)
    q_blocks_per_seq: int  # cdiv(max_q_len, BLOCK_Q)
    direct: bool  # grid axis 0 is (sequence, q block) directly; else found by _find_seq
    q_blocks: int  # grid axis 0
    num_splits: int  # grid axis 2 (NS); 1 = no split, no combine kernel
    # Fewest kv tiles a split takes of a sequence's real range of more than SHORT_TILES tiles
    # (the policy's min_tiles; 1 for a forced split count). A decode graph plans NS for its
    # bound (max_model_len): the kernel still cuts a context into the splits the policy gives
    # its real length, and the other programs exit empty, so a graph at 4k tokens runs 32
    # splits, not 66.
    min_split_tiles: int


def plan_launch(device: torch.device, T: int, B: int, Hq: int, Hkv: int, D: int, max_q_len: int,
                max_kv_len: int, tiles: Tiles | None = None,
                num_splits: int | None = None) -> LaunchPlan:  # fmt: skip
    key, sms = _device_facts(device.index or 0) if device.type == "cuda" else ("", _INTERPRETER_SMS)
    g_pad = triton.next_power_of_2(Hq // Hkv)
    if tiles is None:  # the class follows the rows one sequence puts in a kv group's programs
        rows = max_q_len * g_pad
        cls = next((c for c, limit in _TILE_CLASS_ROWS if rows <= limit), "prefill")
        tiles = _TILES.get(key, _TILES["default"])[(cls, max(16, triton.next_power_of_2(D)))]
    heads = min(g_pad, tiles.block_m)
    block_q = tiles.block_m // heads
    # Grid axis 0: B * cdiv(max_q_len, BLOCK_Q) (direct index) or the T // BLOCK_Q + B bound of
    # _find_seq, whichever is smaller: decode takes the first, a long prefill mixed with many
    # decodes the second.
    per_seq = triton.cdiv(max_q_len, block_q)
    direct = B * per_seq <= T // block_q + B
    q_blocks = B * per_seq if direct else T // block_q + B
    min_split_tiles = 1 if num_splits is not None else _SPLIT_POLICY["min_tiles"]
    if num_splits is None:  # enough programs for programs_per_sm per SM, >= min_tiles each
        programs = max(q_blocks * Hkv * (g_pad // heads), 1)
        want = triton.cdiv(_SPLIT_POLICY["programs_per_sm"] * sms, programs)
        # Never below SHORT_TILES past it: a shorter range in the same launch (another
        # sequence, a window, an earlier q block) takes a tile a split, as under any bound.
        n_tiles = triton.cdiv(max_kv_len, tiles.block_n)
        longer = max(SHORT_TILES, triton.cdiv(n_tiles, min_split_tiles))
        most = n_tiles if n_tiles <= SHORT_TILES else longer
        num_splits = max(1, min(want, most, _SPLIT_POLICY["max_splits"]))
    # The combine reduces the splits in one tile of _SPLITS_PAD (split_combine.py).
    assert num_splits <= _SPLIT_POLICY["max_splits"], f"{num_splits} kv splits: at most 128"
    return LaunchPlan(tiles, heads, block_q, g_pad // heads, per_seq, direct, q_blocks, num_splits,
                      min_split_tiles)  # fmt: skip
