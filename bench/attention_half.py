"""A decode token's attention block (the input norm, q/k/v projection, q/k norms + RoPE + K/V
store, attention, o_proj + add + norm) as ONE persistent launch (kernels/triton/
attention_block.py, EngineConfig.attention_block) against the engine's five launches, each in
a CUDA graph of 8 layers at the Qwen3-30B-A3B shape.

    python -m freetoken_agent.bench attention-half [--context 256 1024] [--tiles '{"BK": 256}']
        [--rounds 3]

Why: at 48 layers, b=1, a resident layer is ~67 us of kernels for ~30 us of HBM time, the MoE
half is within ~3 us of a one-kernel read (`bench expert-mlp`), and the attention half's five
launches take ~32-34 us for ~38 MB of weights.

Rows (us a layer; GB/s of its weights and KV, 37.7 MB + the context's, and their share of the
copy rate): `engine (5 launches)` as the decoder runs them at b=1 (the norm kernel, cuBLAS qkv,
the rope kernel, paged attention with its in-kernel combine, o_proj + add + norm; PDL as
FREETOKEN_PDL says, `light` by default), `block as 3 launches` (the kernel's phases with kernel
boundaries), `block, one launch` (the engine's). Each row is checked against the engine's
first. The probe's first versions (o_proj read ahead into registers or L2, a loop per tile,
two programs an SM) measured slower and are in git history (45cf176; NOTES, thirty-ninth
session).

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

from freetoken_agent.help_format import DefaultsHelpFormatter

RESULTS = Path(__file__).resolve().parent / "results"

SHAPE = dict(h=2048, heads=32, kv_heads=4, head_dim=128)  # Qwen3-30B-A3B's attention
PAGE = 16  # the engine's page size (tokens)
EPS = 1e-6


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


def engine_steps(
    x: Tensor,
    r: Tensor,
    layer: HalfLayer,
    cos: Tensor,
    sin: Tensor,
    cache: Cache,
    heads: int,
    *,
    max_kv_len: int | None = None,
    counters: Tensor | None = None,
    proj_scratch: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
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


def block_rows(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(row name, the kernel's keywords) per attention-block row."""
    from freetoken_agent.kernels.attention_block import MIN_SPLIT

    rows = []
    for tiles in args.tiles:
        for min_split in args.min_split:
            label = ",".join(f"{k}={v}" for k, v in tiles.items())
            if min_split != MIN_SPLIT:
                label += ("," if label else "") + f"min_split={min_split}"
            tag = f" ({label})" if label else ""
            kw = dict(tiles=tiles, min_split=min_split)
            rows.append((f"block as 3 launches{tag}", dict(persistent=False, **kw)))
            rows.append((f"block, one launch{tag}", dict(persistent=True, **kw)))
    return rows


def block(x: Tensor, r: Tensor, layer: HalfLayer, cos: Tensor, sin: Tensor, cache: Cache,
          heads: int, scratch: tuple[Tensor, ...], tiles: dict[str, int], *,
          persistent: bool, min_split: int | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The attention block kernel's (h, s) for x, r [1, H] (engine_steps' contract; the
    identity page table's slot of position pos is pos)."""
    from freetoken_agent.kernels.attention_block import MIN_SPLIT
    from freetoken_agent.kernels.triton.attention_block import attention_block

    d = cache.k.shape[3]
    return attention_block(x, r, layer.w_in, EPS, layer.wqkv, layer.qn, layer.kn, EPS, cos, sin,
                           cache.pos, cache.kv_lens, cache.pos, cache.page_table[0], cache.k,
                           cache.v, layer.wo, layer.w_post, heads, d**-0.5, scratch, tiles,
                           persistent=persistent, min_split=min_split or MIN_SPLIT)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench attention-half",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024],
                        help="tokens cached before the new one")  # fmt: skip
    parser.add_argument("--tiles", type=json.loads, nargs="+", default=[{}],
                        help="JSON overrides of kernels/attention_block.py TILES, a "
                        "row pair each")  # fmt: skip
    parser.add_argument("--min-split", type=int, nargs="+", default=[128],
                        help="positions an attention split takes at least (the engine's "
                        "MIN_SPLIT, 128: 2 splits at 256 tokens; 32: 8), a row pair "
                        "each")  # fmt: skip
    parser.add_argument("--graph-bound", type=int, default=4096,
                        help="the engine row's attention plan bound (a decode graph plans for "
                        "max_model_len; bench fusions runs 4096)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="turns of every row")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs CUDA")
    from freetoken_agent.bench.cuda_graph import captured, rotated_times, rows_beside_copy
    from freetoken_agent.bench.limits import hbm_copy_bandwidth
    from freetoken_agent.bench.moe_kernel import GRAPH_LAYERS
    from freetoken_agent.kernels.attention_block import block_tiles
    from freetoken_agent.kernels.pdl_switch import requested
    from freetoken_agent.kernels.triton.attention_block import new_scratch
    from freetoken_agent.kernels.triton.paged_attention import new_counters
    from freetoken_agent.kernels.triton.proj_norm import new_scratch as proj_scratch

    dev, dt = torch.device("cuda"), torch.bfloat16
    h, heads, kv_heads, d = SHAPE["h"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    hbm = hbm_copy_bandwidth(dev)
    gen = torch.Generator().manual_seed(0)
    layers = [make_layer(h, heads, kv_heads, d, dt, dev, gen) for _ in range(GRAPH_LAYERS)]
    weight_bytes = sum(t.nbytes for t in (layers[0].wqkv, layers[0].wo))
    x = torch.randn(1, h, generator=gen).to(dt).to(dev)
    r = torch.randn(1, h, generator=gen).to(dt).to(dev)
    report = {"bench": "attention-half", "hbm_copy_gb_s": hbm / 1e9, "sms": sms,
              "weights_mb_per_layer": weight_bytes / 1e6, "pdl_flags": requested(),
              "layers_per_graph": GRAPH_LAYERS, "contexts": {}}  # fmt: skip
    for context in args.context:
        cos, sin = rope_tables(d, context + 1, dt, dev)
        caches = [make_cache(context, context + 1, kv_heads, d, dt, dev, gen) for _ in layers]
        counters = [new_counters(dev) for _ in layers]
        proj = [proj_scratch(h, heads * d, dev) for _ in layers]

        def engine(caches=caches, counters=counters, proj=proj, cos=cos, sin=sin):
            a, b = x, r
            for layer, cache, cnt, ps in zip(layers, caches, counters, proj, strict=True):
                a, b = engine_steps(a, b, layer, cos, sin, cache, heads,
                                    max_kv_len=args.graph_bound, counters=cnt,
                                    proj_scratch=ps)  # fmt: skip
            return a, b

        steps = {"engine (5 launches)": engine}
        want = engine_steps(x, r, layers[0], cos, sin, caches[0], heads, counters=counters[0],
                            proj_scratch=proj[0])  # fmt: skip
        for name, kw in block_rows(args):
            tiles = block_tiles(h, heads, kv_heads, d, kw["tiles"])
            if tiles is None:
                print(f"{context} {name}: the tiles do not fit the shape", flush=True)
                continue
            scratches = [new_scratch(h, heads, kv_heads, d, sms, tiles, dt, dev) for _ in layers]
            try:
                got = block(x, r, layers[0], cos, sin, caches[0], heads, scratches[0], tiles,
                            persistent=kw["persistent"], min_split=kw["min_split"])  # fmt: skip
                torch.cuda.synchronize()
            except Exception as e:  # a variant may not compile (registers): report, go on
                print(f"{context} {name}: failed: {type(e).__name__}: {str(e)[-600:]}", flush=True)
                continue
            err = max((g.float() - w.float()).abs().max().item() / w.float().abs().max().item()
                      for g, w in zip(got, want, strict=True))  # fmt: skip
            print(f"{context} {name}: max error against the engine's {err:.2e}", flush=True)

            def run(caches=caches, scratches=scratches, tiles=tiles, kw=kw, cos=cos, sin=sin):
                a, b = x, r
                for layer, cache, sc in zip(layers, caches, scratches, strict=True):
                    a, b = block(a, b, layer, cos, sin, cache, heads, sc, tiles,
                                 persistent=kw["persistent"],
                                 min_split=kw["min_split"])  # fmt: skip
                return a, b

            steps[name] = run
        replays = {name: captured(step) for name, step in steps.items()}
        times = rotated_times(replays, args.rounds, GRAPH_LAYERS)
        kv_bytes = 2 * context * kv_heads * d * 2
        report["contexts"][str(context)] = rows_beside_copy(
            times, weight_bytes + kv_bytes, hbm, label=f"{context:6d} "
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_half.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
