"""The attention block in one launch (kernels/triton/attention_block.py) computes what the
decoder's five steps do for one decode token (kernels/attention_block.py's plain path: the
norm, the projection, qk-norm/RoPE/store, paged attention, o_proj + add + norm): the outputs,
the K/V written at the new token's slot through a shuffled page table, nothing else written,
the counters back at 0. Its three phases run as launches in Triton's interpreter (a grid-wide
wait cannot run there); the one persistent launch on CUDA must give the phases' bits."""

from __future__ import annotations

import re

import pytest
import torch
from sm90_compile import compiled_json

from freetoken_agent.kernels.attention_block import attention_block, block_tiles, splits_for
from freetoken_agent.kernels.triton.attention_block import attention_block as triton_block
from freetoken_agent.kernels.triton.attention_block import new_scratch

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PAGE = 4


def _case(gen, dtype, device, *, h, heads, kv_heads, d, pos, rot=None, qk_norm=True,
          residual=True):  # fmt: skip
    """Weights near 1 in scale, `pos` cached tokens in shuffled pages (slots from the new
    token's on NaN), RoPE tables of `rot` dims (default all)."""
    rot = rot or d
    nqkv, nqd = (heads + 2 * kv_heads) * d, heads * d

    def draw(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=gen) * std + mean).to(dtype).to(device)

    pages = pos // PAGE + 2
    order = torch.randperm(pages + 3, generator=gen)[:pages]  # the sequence's pages, shuffled
    k_cache = torch.full((pages + 3, PAGE, kv_heads, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = order[torch.arange(pos) // PAGE] * PAGE + torch.arange(pos) % PAGE
    k_cache.view(-1, kv_heads, d)[slots] = torch.randn(pos, kv_heads, d, generator=gen).to(dtype)
    v_cache.view(-1, kv_heads, d)[slots] = torch.randn(pos, kv_heads, d, generator=gen).to(dtype)
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.arange(pos + 8, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    i32 = dict(dtype=torch.int32, device=device)
    args = dict(
        x=draw(1, h), residual=draw(1, h) if residual else None,
        in_norm=draw(h, std=0.1, mean=1.0), eps=1e-6, w_qkv=draw(nqkv, h, std=h**-0.5),
        q_norm=draw(d, std=0.1, mean=1.0) if qk_norm else None,
        k_norm=draw(d, std=0.1, mean=1.0) if qk_norm else None, qk_eps=1e-6,
        cos=emb.cos().to(dtype).to(device), sin=emb.sin().to(dtype).to(device),
        positions=torch.tensor([pos], device=device), kv_lens=torch.tensor([pos + 1], **i32),
        slot_mapping=(order[pos // PAGE] * PAGE + pos % PAGE).reshape(1).to(device),
        page_table=order[None].to(**i32), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        w_o=draw(h, nqd, std=nqd**-0.5), post_norm=draw(h, std=0.1, mean=1.0), heads=heads,
        scale=d**-0.5,
    )  # fmt: skip
    return args


def _reference(args):
    """The five steps on copies of the caches: (h, s, k_cache, v_cache)."""
    ref = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    h, s = attention_block(**ref)
    return h, s, ref["k_cache"], ref["v_cache"]


def _run(args, programs, tiles, *, persistent=False, min_split=4):
    scratch = new_scratch(args["x"].shape[1], args["heads"], args["k_cache"].shape[2],
                          args["k_cache"].shape[3], programs, tiles, args["x"].dtype,
                          args["x"].device)  # fmt: skip
    call = {**args, "page_table": args["page_table"][0]}
    h, s = triton_block(**call, scratch=scratch, tiles=tiles, persistent=persistent,
                        min_split=min_split)  # fmt: skip
    return h, s, scratch


def _check(got, want, args, tol):
    h, s, k_ref, v_ref = want
    torch.testing.assert_close(got[0].float().cpu(), h.float().cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(got[1].float().cpu(), s.float().cpu(), atol=tol, rtol=tol)
    for cache, ref in ((args["k_cache"], k_ref), (args["v_cache"], v_ref)):
        written = ~cache.isnan()
        assert torch.equal(written, ~ref.isnan()), "a slot other than the new token's changed"
        torch.testing.assert_close(cache[written].float().cpu(), ref[written].float().cpu(),
                                   atol=tol, rtol=tol)  # fmt: skip


SMALL = dict(h=64, heads=4, kv_heads=2, d=16)
# Two K steps a tile in both projections (the streamed loop crosses tile boundaries).
SMALL_TILES = dict(BN1=16, KS1=2, BK=16, BL=8, BN3=16, KS3=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", ["qwen3", "no-residual", "no-qk-norm", "partial-rotary"])
def test_the_phases_are_the_five_steps(rng_seed, dtype, variant):
    """Positions from 0 (the new token only) to several splits of tiles; 7 programs, so up to 3
    splits a kv head, each of at least 4 positions. fp16 rounds where the steps round, with
    sums in other orders (an ulp at a rounding point, carried through a norm)."""
    gen = torch.Generator().manual_seed(rng_seed)
    pos = int(torch.randint(0, 60, (1,), generator=gen))
    rot = 8 if variant == "partial-rotary" else None
    args = _case(gen, dtype, "cpu", **SMALL, pos=pos, residual=variant != "no-residual",
                 qk_norm=variant != "no-qk-norm", rot=rot)  # fmt: skip
    want = _reference(args)
    tiles = block_tiles(SMALL["h"], SMALL["heads"], SMALL["kv_heads"], SMALL["d"], SMALL_TILES)
    assert tiles is not None and splits_for(SMALL["kv_heads"], 7) == 3
    h, s, scratch = _run(args, 7, tiles)
    _check((h, s), want, args, 1e-4 if dtype == torch.float32 else 1e-2)
    assert (scratch[-1] == 0).all(), scratch[-1]


def test_many_splits_and_a_second_token_on_the_same_scratch(rng_seed):
    """A context long enough for every split (min_split 2 of 20 programs' 10 a kv head), then
    the next token on the same scratch and cache (the counters a launch leaves serve the next),
    fp32."""
    gen = torch.Generator().manual_seed(rng_seed)
    pos = int(torch.randint(40, 80, (1,), generator=gen))
    args = _case(gen, torch.float32, "cpu", **SMALL, pos=pos)
    tiles = block_tiles(SMALL["h"], SMALL["heads"], SMALL["kv_heads"], SMALL["d"], SMALL_TILES)
    want = _reference(args)
    scratch = new_scratch(SMALL["h"], SMALL["heads"], SMALL["kv_heads"], SMALL["d"], 20, tiles,
                          torch.float32, "cpu")  # fmt: skip
    call = {**args, "page_table": args["page_table"][0]}
    got = triton_block(**call, scratch=scratch, tiles=tiles, persistent=False, min_split=2)
    _check(got, want, args, 1e-4)
    # The next token: position pos + 1 in the same pages (two spare slots were left).
    order = args["page_table"][0]
    slot = (order[(pos + 1) // PAGE] * PAGE + (pos + 1) % PAGE).reshape(1).long()
    nxt = {**args, "x": torch.randn(1, SMALL["h"], generator=gen), "residual": got[1],
           "positions": args["positions"] + 1, "kv_lens": args["kv_lens"] + 1,
           "slot_mapping": slot}  # fmt: skip
    want = _reference(nxt)
    got = triton_block(**{**nxt, "page_table": order}, scratch=scratch, tiles=tiles,
                       persistent=False, min_split=2)  # fmt: skip
    _check(got, want, nxt, 1e-4)
    assert (scratch[-1] == 0).all(), scratch[-1]


def test_the_dispatcher_takes_the_kernel_only_with_its_scratch(rng_seed, monkeypatch):
    """kernels/attention_block.py runs the kernel (its phases under force_triton on the CPU)
    when the layer passes scratch and tiles, the five steps otherwise: the same values."""
    from freetoken_agent.kernels.triton import attention_block as module

    gen = torch.Generator().manual_seed(rng_seed)
    pos = int(torch.randint(1, 30, (1,), generator=gen))
    args = _case(gen, torch.float32, "cpu", **SMALL, pos=pos)
    want = _reference(args)
    calls = []

    def spy(*a, **kw):
        calls.append(kw["persistent"])
        return triton_block(*a, **kw)

    monkeypatch.setattr(module, "attention_block", spy)
    tiles = block_tiles(SMALL["h"], SMALL["heads"], SMALL["kv_heads"], SMALL["d"], SMALL_TILES)
    scratch = new_scratch(SMALL["h"], SMALL["heads"], SMALL["kv_heads"], SMALL["d"], 7, tiles,
                          torch.float32, "cpu")  # fmt: skip
    got = attention_block(**args, scratch=scratch, tiles=tiles, force_triton=True)
    assert calls == [False]  # the interpreter's three launches
    _check(got, want, args, 1e-4)


@pytest.mark.parametrize(
    ("shape", "fits"),
    [((2048, 32, 4, 128), True), ((64, 4, 2, 16), True), ((4096, 64, 4, 128), True),
     ((2048, 32, 4, 80), False), ((2048, 40, 2, 128), False), ((96, 6, 2, 16), True),
     ((2000, 32, 4, 128), True), ((2008, 32, 4, 128), False)],
)  # fmt: skip
def test_block_tiles_fit_the_shape_or_refuse_it(shape, fits):
    """Tiles divide their dimensions exactly (the kernel masks no partial tile); a head dim
    not a power of two, more than 16 q heads a kv head, or a hidden size no tile divides is
    refused."""
    h, heads, kv, d = shape
    t = block_tiles(h, heads, kv, d)
    assert (t is not None) == fits
    if t is not None:
        nqkv, nqd = (heads + 2 * kv) * d, heads * d
        assert nqkv % t["BN1"] == 0 and h % t["BN3"] == 0
        assert (h // t["KS1"]) % t["BK"] == 0 and (nqd // t["KS3"]) % t["BK"] == 0
    if shape == (2048, 32, 4, 128):
        assert t == {**t, "BN1": 32, "KS1": 4, "BK": 512, "BN3": 32, "KS3": 4}


@pytest.mark.gpu
@pytest.mark.parametrize("pos_range", [(0, 3), (100, 3000)], ids=["short", "long"])
def test_the_persistent_launch_is_the_phases_on_cuda(rng_seed, pos_range):
    """At the 30B shape in bf16 on every SM: the one launch gives the three launches' bits
    (the same sums in the same order), within bf16 roundings of the five steps, leaves the
    counters at 0, and replays in a CUDA graph with the same bits."""
    gen = torch.Generator().manual_seed(rng_seed)
    shape = dict(h=2048, heads=32, kv_heads=4, d=128)
    pos = int(torch.randint(*pos_range, (1,), generator=gen))
    args = _case(gen, torch.bfloat16, "cuda", **shape, pos=pos)
    want = _reference(args)
    tiles = block_tiles(shape["h"], shape["heads"], shape["kv_heads"], shape["d"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    phases = _run(args, sms, tiles, persistent=False, min_split=128)[:2]
    h, s, scratch = _run(args, sms, tiles, persistent=True, min_split=128)
    torch.cuda.synchronize()
    assert torch.equal(h, phases[0]) and torch.equal(s, phases[1])
    assert (scratch[-1] == 0).all(), scratch[-1]
    _check((h, s), want, args, 5e-2)
    call = {**args, "page_table": args["page_table"][0]}
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_block(**call, scratch=scratch, tiles=tiles)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = triton_block(**call, scratch=scratch, tiles=tiles)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], h) and torch.equal(out[1], s)
    assert (scratch[-1] == 0).all(), scratch[-1]


def test_the_config_switches_every_attention_layer(tmp_path, rng_seed):
    """EngineConfig.attention_block reaches every attention layer the kernel serves (Qwen3's);
    off, none. On the CPU a switched layer runs the five steps: the same tokens and logits.
    (q/k without norms, Mixtral's case, is test_the_phases_are_the_five_steps[no-qk-norm]: the
    tiny Mixtral has a sliding window.)"""
    from option_parity import assert_switch_reaches_layers_on_cpu

    assert_switch_reaches_layers_on_cpu(tmp_path, rng_seed, "qwen3_moe", "attention_block")


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "qwen3_next", "mixtral"])
def test_layers_the_kernel_cannot_serve_stay_apart(tmp_path, rng_seed, family):
    """OLMoE's norms over whole projections, Qwen2-MoE's q/k/v bias, Qwen3-Next's gated,
    zero-centred attention and the tiny Mixtral's sliding window are not the kernel's cases:
    the switch leaves those layers alone."""
    from tiny_models import make_tiny

    from freetoken_agent import Engine
    from freetoken_agent.engine.models.base import DecoderLayer

    make_tiny(family, tmp_path, rng_seed)
    engine = Engine.load(tmp_path, device="cpu", progress=False, attention_block=True)
    layers = [m for m in engine.loaded.model.modules() if isinstance(m, DecoderLayer)]
    assert layers and not any(m.attention_block for m in layers)


def test_a_switched_layer_takes_only_one_row_steps(tmp_path, rng_seed, monkeypatch):
    """A layer with attention_block sends steps of one row (a single sequence's decode) to the
    block, wider ones (prefill, two sequences) to its usual path: the block is called, and the
    tokens are the plain layer's. The block runs its kernel's phases here (Triton's
    interpreter, with a scratch of 5 programs), so the CPU engine exercises the kernel too."""
    from option_parity import assert_switch_keeps_tokens_on_cpu

    from freetoken_agent.engine.layers import attention
    from freetoken_agent.kernels.triton.attention_block import new_scratch as scratch_for

    rows = []

    def interpreted(x, *args, **kwargs):
        rows.append(x.shape[0])
        h, heads, w_qkv = x.shape[1], args[17], args[3]
        kv_heads, d = args[13].shape[2], args[13].shape[3]
        tiles = block_tiles(h, heads, kv_heads, d)
        assert tiles is not None and w_qkv.shape == ((heads + 2 * kv_heads) * d, h)
        scratch = scratch_for(h, heads, kv_heads, d, 5, tiles, x.dtype, x.device)
        return attention_block(x, *args, scratch=scratch, tiles=tiles, force_triton=True)

    monkeypatch.setattr(attention, "attention_block", interpreted)
    assert_switch_keeps_tokens_on_cpu(tmp_path, rng_seed, "attention_block")
    assert rows and set(rows) == {1}


@pytest.mark.gpu
def test_engine_with_the_attention_block_matches_the_default_on_cuda(tmp_path, rng_seed):
    """The attention block in one launch gives the plain layers' tokens and logits (fp32,
    decode under graphs)."""
    from option_parity import assert_option_keeps_results_on_cuda

    assert_option_keeps_results_on_cuda(tmp_path, rng_seed, attention_block=True)


_COMPILE = """
import json
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.attention_block import _attention_block_kernel as fn
consts = dict(H=2048, ROW=2048, D=128, ROT=128, NQ=32, NKV=4, S=16, BN1=32, KS1=4, BK=512,
              NS=32, SPLIT_MIN=128, BL=64, BN3=32, KS3=4, HAS_RES=True, QK_NORM=True,
              SPLITS_PAD=32, CHUNK=4, PHASE=0, MODE=3, PREC="tf32", PDL=3)
types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
types.update(pos_ptr="*i64", slot_ptr="*i64", kv_len_ptr="*i32", page_table_ptr="*i32",
             count_ptr="*i32", qkv_part_ptr="*fp32", att_acc_ptr="*fp32", att_ml_ptr="*fp32",
             o_part_ptr="*fp32", eps="fp32", qk_eps="fp32", inv_h="fp32", inv_d="fp32",
             scale="fp32")
sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
ptx = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
              options=dict(num_warps=4)).asm["ptx"]
print(json.dumps(ptx))
"""


def test_sm90_code_waits_first_and_spills_nothing():
    """The persistent launch compiled for the H200 at the 30B shape (the interpreter runs
    neither its waits nor a compiled kernel's rules, such as reading only constexpr globals):
    no local memory, PDL's wait before any global load, and acquire-release counters at GPU
    scope."""
    ptx = compiled_json(_COMPILE)
    assert ".local" not in ptx, "registers spilled"
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert re.search(r"atom\.[.\w]*acq_rel", ptx), "the combine's acquire-release counter"
    assert re.search(r"atom\.[.\w]*gpu", ptx), "the counters at GPU scope"
