"""A measurement probe: a decode token's attention half of a layer (norm, q/k/v projection,
q/k norms + RoPE + K/V store, attention, o_proj + add + norm) as ONE persistent grid whose
programs read o_proj's weights into registers before they wait for attention, against the
engine's five launches, each in a CUDA graph of 8 layers at the Qwen3-30B-A3B shape.

    python -m freetoken_agent.bench attention-half [--context 256 1024] [--ahead 0 1 2]
        [--warps 4 8] [--splits 8] [--rounds 3]

Why (bench/attention_half_kernel.py has the kernel and its phases): at 48 layers, b=1, a
resident layer is ~67 us of kernels for ~30 us of HBM time, the MoE half is within ~3 us of a
one-kernel read (`bench expert-mlp`), and the attention half's five launches take ~30 us for
~38 MB. A persistent layer kernel is worth building into the engine only if its attention half
beats those launches by a margin; this measures that before any engine code.

Rows (us a layer; GB/s of its weights, 37.7 MB at this shape, and their share of the copy
rate): `engine` (the five launches as the decoder runs them at b=1: the norm kernel, cuBLAS
qkv, the rope kernel, paged attention with its in-kernel combine, o_proj + add + norm; PDL as
FREETOKEN_PDL says, `light` by default), `phases` (the probe's kernel as three launches: its
code with kernel boundaries), `persistent, ahead=A` (one launch; A o_proj tiles a program held
in registers through the waits). Each row's outputs are checked against the engine's first.

JSON: `attention_half.json`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

RESULTS = Path(__file__).resolve().parent / "results"

SHAPE = dict(h=2048, heads=32, kv_heads=4, head_dim=128)  # Qwen3-30B-A3B's attention
PAGE = 16  # the engine's page size (tokens)
EPS = 1e-6
DEFAULT_TILES = dict(BN1=16, KS1=2, BK=256, BL=64, BN3=16, KS3=4)


@dataclass
class HalfLayer:
    """One layer's attention-half weights: norms [H], wqkv [NQKV, H], wo [H, NQ D], q/k norms
    [D]."""

    w_in: Tensor
    w_post: Tensor
    wqkv: Tensor
    wo: Tensor
    qn: Tensor
    kn: Tensor


@dataclass
class Cache:
    """A sequence's KV cache in the engine's layout ([pages, PAGE, NKV, D], pages in order)
    and what the engine's kernels read of it for one decode token at `pos`."""

    k: Tensor
    v: Tensor
    pos: Tensor  # [1] int64: the new token's position
    page_table: Tensor  # [1, pages] int32
    cu_q_lens: Tensor  # [2] int32
    kv_lens: Tensor  # [1] int32 (pos + 1)


def make_layer(h: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype,
               device: torch.device | str, gen: torch.Generator) -> HalfLayer:  # fmt: skip
    """Random weights, scaled so every activation stays near 1."""
    nqkv, nqd = (heads + 2 * kv_heads) * d, heads * d

    def draw(*shape: int, std: float = 1.0, mean: float = 0.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * std + mean).to(dtype).to(device)

    return HalfLayer(draw(h, std=0.1, mean=1.0), draw(h, std=0.1, mean=1.0),
                     draw(nqkv, h, std=h**-0.5), draw(h, nqd, std=nqd**-0.5),
                     draw(d, std=0.1, mean=1.0), draw(d, std=0.1, mean=1.0))  # fmt: skip


def make_cache(pos: int, capacity: int, kv_heads: int, d: int, dtype: torch.dtype,
               device: torch.device | str, gen: torch.Generator) -> Cache:  # fmt: skip
    """`pos` cached tokens of random K/V (the slots from pos on NaN: a read of one shows)."""
    pages = -(-capacity // PAGE)
    k = torch.full((pages, PAGE, kv_heads, d), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    k.view(-1, kv_heads, d)[:pos] = torch.randn(pos, kv_heads, d, generator=gen).to(dtype)
    v.view(-1, kv_heads, d)[:pos] = torch.randn(pos, kv_heads, d, generator=gen).to(dtype)
    i32 = dict(dtype=torch.int32, device=device)
    return Cache(k.to(device), v.to(device), torch.tensor([pos], device=device),
                 torch.arange(pages, **i32)[None], torch.tensor([0, 1], **i32),
                 torch.tensor([pos + 1], **i32))  # fmt: skip


def rope_tables(d: int, capacity: int, dtype: torch.dtype, device: torch.device | str,
                theta: float = 1e6) -> tuple[Tensor, Tensor]:  # fmt: skip
    """cos, sin [capacity, D] as engine/layers/rope.py tabulates them (full rotary)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def engine_steps(x: Tensor, r: Tensor, layer: HalfLayer, cos: Tensor, sin: Tensor,
                 cache: Cache, heads: int, *, max_kv_len: int | None = None,
                 counters: Tensor | None = None, proj_scratch=None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(h, s) of the decoder layer's attention half at b=1, through the engine's kernels as
    engine/models/base.py calls them (Triton on CUDA, the plain-torch twins on the CPU):
    x, r [1, H]."""
    from freetoken_agent.kernels.norm import rms_norm
    from freetoken_agent.kernels.paged_attention import paged_attention
    from freetoken_agent.kernels.proj_norm import proj_add_norm
    from freetoken_agent.kernels.rope import qk_norm_rope_store

    kv_heads, d = cache.k.shape[2], cache.k.shape[3]
    h, s = rms_norm(x, layer.w_in, EPS, r)
    qkv = F.linear(h, layer.wqkv)
    q = qk_norm_rope_store(qkv, cache.pos, cos, sin, heads, kv_heads, d, layer.qn, layer.kn,
                           EPS, cache.k, cache.v, cache.pos)  # fmt: skip
    out = paged_attention(q, cache.k, cache.v, cache.page_table, cache.cu_q_lens, cache.kv_lens,
                          d**-0.5, 1, max_kv_len=max_kv_len, counters=counters)  # fmt: skip
    return proj_add_norm(out.reshape(1, -1), layer.wo, s, layer.w_post, EPS,
                         scratch=proj_scratch)  # fmt: skip


@dataclass
class Scratch:
    """The probe's buffers (one set serves every layer of a step: a launch leaves its counters
    at 0 and reads nothing of the launch before)."""

    xn: Tensor  # [P, H]
    qkv_part: Tensor  # [KS1, NQKV] fp32
    att_acc: Tensor  # [NKV, NS, 16, D] fp32
    att_ml: Tensor  # [NKV, NS, 2, 16] fp32
    attn: Tensor  # [NQ D]
    o_part: Tensor  # [KS3, H] fp32
    count: Tensor  # [COUNT_HEADS + NKV] int32


def new_scratch(h: int, heads: int, kv_heads: int, d: int, programs: int, splits: int,
                tiles: dict[str, int], dtype: torch.dtype,
                device: torch.device | str) -> Scratch:  # fmt: skip
    from freetoken_agent.bench.attention_half_kernel import COUNT_HEADS

    f32 = dict(dtype=torch.float32, device=device)
    return Scratch(
        torch.empty(programs, h, dtype=dtype, device=device),
        torch.empty(tiles["KS1"], (heads + 2 * kv_heads) * d, **f32),
        torch.empty(kv_heads, splits, 16, d, **f32),
        torch.empty(kv_heads, splits, 2, 16, **f32),
        torch.empty(heads * d, dtype=dtype, device=device),
        torch.empty(tiles["KS3"], h, **f32),
        torch.zeros(COUNT_HEADS + kv_heads, dtype=torch.int32, device=device),
    )


def attention_half(x: Tensor, r: Tensor, layer: HalfLayer, cos: Tensor, sin: Tensor,
                   cache: Cache, heads: int, scratch: Scratch, *, persistent: bool,
                   ahead: int = 0, warps: int = 4, tiles: dict[str, int] | None = None,
                   out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The probe's (h, s) for x, r [1, H] (engine_steps' contract): one persistent launch
    (CUDA only), or the same kernel as three launches. The cache gets the new K/V at pos."""
    import triton

    from freetoken_agent.bench.attention_half_kernel import _attention_half_kernel, split_tiles
    from freetoken_agent.kernels.triton.norm import round_mode

    tiles = {**DEFAULT_TILES, **(tiles or {})}
    hid = x.shape[1]
    kv_heads, d = cache.k.shape[2], cache.k.shape[3]
    programs, splits = scratch.xn.shape[0], scratch.att_acc.shape[1]
    assert heads % kv_heads == 0 and heads // kv_heads <= 16, (heads, kv_heads)
    assert triton.next_power_of_2(d) == d, "whole heads in one load"
    assert kv_heads * splits <= programs, "a program per (kv head, split)"
    split_tiles(hid, (heads + 2 * kv_heads) * d, heads * d, tiles["BN1"], tiles["KS1"],
                tiles["BK"], tiles["BN3"], tiles["KS3"])  # fmt: skip
    assert not persistent or x.is_cuda, "the grid's waits cannot run in the interpreter"
    h, s = out if out is not None else (torch.empty_like(x), torch.empty_like(x))
    sc = scratch
    args = (x, r, layer.w_in, layer.w_post, layer.wqkv, layer.wo, layer.qn, layer.kn, cos, sin,
            cache.pos, cache.k, cache.v, sc.xn, sc.qkv_part, sc.att_acc, sc.att_ml, sc.attn,
            sc.o_part, h, s, sc.count, EPS, EPS, 1.0 / hid, 1.0 / d, d**-0.5, cos.stride(0))  # fmt: skip
    consts = dict(H=hid, ROW=triton.next_power_of_2(hid), D=d, NQ=heads, NKV=kv_heads,
                  NS=splits, MODE=round_mode(x.dtype),
                  PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=warps, **tiles)  # fmt: skip
    if persistent:
        _attention_half_kernel[(programs,)](*args, AHEAD=ahead, PHASE=0, **consts)
    else:
        for phase in (1, 2, 3):
            grid = kv_heads * splits if phase == 2 else programs
            _attention_half_kernel[(grid,)](*args, AHEAD=0, PHASE=phase, **consts)
    return h, s
