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
in registers through the waits), `phase N alone` (--phase-rows: one phase's launches, its
share of `phases`). Each row's outputs are checked against the engine's first.

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
    count: Tensor  # [COUNT_WORDS + NKV] int32


def new_scratch(h: int, heads: int, kv_heads: int, d: int, programs: int, splits: int,
                tiles: dict[str, int], dtype: torch.dtype,
                device: torch.device | str) -> Scratch:  # fmt: skip
    from freetoken_agent.bench.attention_half_kernel import COUNT_WORDS

    f32 = dict(dtype=torch.float32, device=device)
    return Scratch(
        torch.empty(programs, h, dtype=dtype, device=device),
        torch.empty(tiles["KS1"], (heads + 2 * kv_heads) * d, **f32),
        torch.empty(kv_heads, splits, 16, d, **f32),
        torch.empty(kv_heads, splits, 2, 16, **f32),
        torch.empty(heads * d, dtype=dtype, device=device),
        torch.empty(tiles["KS3"], h, **f32),
        torch.zeros(COUNT_WORDS + kv_heads, dtype=torch.int32, device=device),
    )


_RESIDENT_CHECKED: set[tuple] = set()  # launches checked to fit the device at once


def resident_programs(compiled, device: torch.device) -> int:
    """How many programs of a compiled kernel the device holds at once: its SMs times the
    programs an SM fits by registers (allocated 256 a warp at a time), shared memory and
    threads."""
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    per_warp = -(-compiled.n_regs * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (compiled.metadata.shared + 1024)  # 1 KB a block reserved
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    return min(by_regs, by_smem, by_threads) * props.multi_processor_count


def attention_half(x: Tensor, r: Tensor, layer: HalfLayer, cos: Tensor, sin: Tensor,
                   cache: Cache, heads: int, scratch: Scratch, *, persistent: bool,
                   ahead: int = 0, warps: int = 4, tiles: dict[str, int] | None = None,
                   out: tuple[Tensor, Tensor] | None = None,
                   phases: tuple[int, ...] = (1, 2, 3),
                   l2: int = 0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The probe's (h, s) for x, r [1, H] (engine_steps' contract): one persistent launch
    (CUDA only), or the same kernel as three launches (`phases`: fewer, for a phase's time
    alone). The cache gets the new K/V at pos. `tiles`: DEFAULT_TILES' overrides, and STAGES
    (Triton's num_stages). `l2`: the kernel's L2 read-ahead bits (its L2)."""
    import triton

    from freetoken_agent.bench.attention_half_kernel import _attention_half_kernel, split_tiles
    from freetoken_agent.kernels.triton.norm import round_mode

    tiles = {**DEFAULT_TILES, **(tiles or {})}
    stages = tiles.pop("STAGES", None)
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
            sc.o_part, h, s, sc.count, EPS, EPS, 1.0 / hid, 1.0 / d, d**-0.5,
            cos.stride(0))  # fmt: skip
    consts = dict(H=hid, ROW=triton.next_power_of_2(hid), D=d, NQ=heads, NKV=kv_heads,
                  NS=splits, MODE=round_mode(x.dtype),
                  PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=warps, **tiles)  # fmt: skip
    if stages is not None:
        consts["num_stages"] = stages
    if persistent:
        consts.update(AHEAD=ahead, PHASE=0, L2=l2)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        key = (programs, warps, tuple(sorted((k, str(v)) for k, v in consts.items())))
        if programs > sms and key not in _RESIDENT_CHECKED:
            # More programs than SMs wait for each other only if all are resident at once:
            # a first launch of one wave (always resident) compiles the kernel, whose
            # registers and shared memory then tell how many fit.
            compiled = _attention_half_kernel[(sms,)](*args, **consts)
            fit = resident_programs(compiled, x.device)
            assert programs <= fit, f"{programs} programs but only {fit} fit at once"
            _RESIDENT_CHECKED.add(key)
        _attention_half_kernel[(programs,)](*args, **consts)
    else:
        for phase in phases:
            grid = kv_heads * splits if phase == 2 else programs
            _attention_half_kernel[(grid,)](*args, AHEAD=0, PHASE=phase, L2=l2 & 1, **consts)
    return h, s


def _variants(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(row name, attention_half's keywords and per_sm: programs an SM) per probe row."""
    rows = []
    for per_sm in args.programs_per_sm:
        for name, kw in _variants_per_sm(args):
            label = f", P={per_sm}/SM" if per_sm > 1 else ""
            rows.append((name + label, {**kw, "per_sm": per_sm}))
    return rows


def _variants_per_sm(args: argparse.Namespace) -> list[tuple[str, dict]]:
    rows = []
    for tiles in args.tiles:
        label = ",".join(f"{k}={v}" for k, v in tiles.items())
        for warps in args.warps:
            tag = f"w{warps}" + (f", {label}" if label else "")
            rows.append((f"phases, {tag}", dict(persistent=False, warps=warps, tiles=tiles)))
            for phase in (1, 2, 3) if args.phase_rows else ():
                kw = dict(persistent=False, warps=warps, tiles=tiles, phases=(phase,))
                rows.append((f"phase {phase} alone, {tag}", kw))
            for ahead in args.ahead:
                for l2 in args.l2:
                    kw = dict(persistent=True, ahead=ahead, warps=warps, tiles=tiles, l2=l2)
                    rows.append((f"persistent, ahead={ahead}, l2={l2}, {tag}", kw))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench attention-half",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024],
                        help="tokens cached before the new one")  # fmt: skip
    parser.add_argument("--ahead", type=int, nargs="+", default=[0, 1, 2],
                        help="o_proj tiles a program reads before its waits (0-4)")  # fmt: skip
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="warps a program")
    parser.add_argument("--splits", type=int, default=8, help="attention splits a kv head")
    parser.add_argument("--tiles", type=json.loads, nargs="+", default=[{}],
                        help=f"JSON overrides of the tiles {DEFAULT_TILES}, a row set "
                        "each")  # fmt: skip
    parser.add_argument("--l2", type=int, nargs="+", default=[0],
                        help="the persistent rows' L2 read-ahead bits: 1 its qkv rows before "
                        "the norm, 2 its o_proj rows before the waits")  # fmt: skip
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1],
                        help="programs a row launches per SM (more than one: the persistent "
                        "rows check that all fit at once)")  # fmt: skip
    parser.add_argument(
        "--phase-rows",
        action="store_true",
        help="rows of each phase launched alone (its time without the others)",
    )
    parser.add_argument("--graph-bound", type=int, default=4096,
                        help="the engine row's attention plan bound (a decode graph plans for "
                        "max_model_len; bench fusions runs 4096)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="turns of every row")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results folder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs CUDA")
    if not all(0 <= a <= 4 for a in args.ahead):
        parser.error("--ahead takes 0 to 4")
    from triton.testing import do_bench

    from freetoken_agent.bench.cuda_graph import captured
    from freetoken_agent.bench.limits import hbm_copy_bandwidth
    from freetoken_agent.bench.moe_kernel import GRAPH_LAYERS
    from freetoken_agent.kernels.pdl_switch import requested
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
        for name, kw in _variants(args):
            tiles = {**DEFAULT_TILES, **kw["tiles"]}  # new_scratch reads KS1 and KS3
            programs = sms * kw.pop("per_sm")
            scratch = new_scratch(h, heads, kv_heads, d, programs, args.splits, tiles, dt, dev)
            outs = [(torch.empty_like(x), torch.empty_like(x)) for _ in layers]
            try:
                whole = {k: v for k, v in kw.items() if k != "phases"}  # the check: all three
                got = attention_half(x, r, layers[0], cos, sin, caches[0], heads, scratch,
                                     **whole)  # fmt: skip
                torch.cuda.synchronize()
            except Exception as e:  # a variant may not compile (registers): report, go on
                print(f"{context} {name}: failed: {type(e).__name__}: {str(e)[-600:]}", flush=True)
                continue
            err = max((g.float() - w.float()).abs().max().item() / w.float().abs().max().item()
                      for g, w in zip(got, want, strict=True))  # fmt: skip
            print(f"{context} {name}: max error against the engine's {err:.2e}", flush=True)

            def probe(caches=caches, scratch=scratch, outs=outs, kw=kw, cos=cos, sin=sin):
                a, b = x, r
                for layer, cache, out in zip(layers, caches, outs, strict=True):
                    a, b = attention_half(a, b, layer, cos, sin, cache, heads, scratch,
                                          out=out, **kw)  # fmt: skip
                return a, b

            steps[name] = probe
        replays = {name: captured(step) for name, step in steps.items()}
        times: dict[str, list[float]] = {name: [] for name in replays}
        for rnd in range(args.rounds):
            order = list(replays)[rnd % len(replays) :] + list(replays)[: rnd % len(replays)]
            for name in order:
                times[name].append(do_bench(replays[name], return_mode="median") / GRAPH_LAYERS)
        rows = report["contexts"][str(context)] = {}
        kv_bytes = 2 * context * kv_heads * d * 2
        for name, ms in times.items():
            best = sorted(ms)[len(ms) // 2]
            gbps = (weight_bytes + kv_bytes) / best / 1e6
            rows[name] = {"us_per_layer": 1e3 * best, "gb_s": gbps, "of_copy": gbps / (hbm / 1e9),
                          "rounds_us": [1e3 * t for t in ms]}  # fmt: skip
            print(f"{context:6d} {name:44s} {1e3 * best:7.2f} us a layer  {gbps:6.0f} GB/s  "
                  f"{100 * gbps / (hbm / 1e9):3.0f}% of copy", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_half.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
