"""Programmatic dependent launch (kernels/triton/pdl.py): every PDL-aware kernel waits for the
kernel before it first, the switch, and the wait's place in compiled sm_90 code. The GPU tests
(tests/engine/test_pdl_gpu.py) check that PDL changes no bit of an engine's results."""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import re
import textwrap
from pathlib import Path

import pytest
import torch
from sm90_compile import compiled_json

from freetoken_agent.kernels.triton import pdl

# Every kernel of the decode step: the launches PDL could overlap (pdl.py's docstring).
AWARE = {
    "gemv": ["_gemv_kernel", "_sum_splits_kernel"],
    "norm": ["_rms_norm_kernel"],
    "router": ["_softmax_topk_kernel"],
    "moe_common": ["_sum_over_k_kernel"],
    "route": ["_route_kernel"],
    "rope": ["_qk_norm_rope_store_kernel"],
    "moe_decode": ["_decode_gate_up_kernel", "_decode_down_kernel"],
    "split_combine": ["_combine_splits_kernel"],
    "proj_norm": ["_proj_norm_kernel"],
    "norm_qkv": ["_norm_qkv_kernel"],
    "paged_attention": ["_paged_attention_kernel"],
    "expert_fills": ["_plan_kernel", "_copy_kernel"],
    "attention_block": ["_attention_block_kernel"],
}


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"freetoken_agent.kernels.triton.{module}"), name)


def _definition(fn) -> ast.FunctionDef:
    """The kernel's def (its Python function: compiled or interpreted Triton alike)."""
    return ast.parse(textwrap.dedent(inspect.getsource(fn.fn))).body[0]


# What may come before a kernel's `enter(PDL)`: index arithmetic and the L2 prefetch of its own
# weights (pdl.py's rule; `_prefetch_rows` reads the fill plan's rows, settled two kernels
# back, and its launch asks for PREFETCH only where they are). Any other call (a load, a
# helper that loads), save the loads of SETTLED buffers below, or a return fails.
BEFORE_ENTER = {"tl.program_id", "tl.arange", "tl.minimum", "tl.maximum", "tl.where",
                "tl.num_programs", "tl.cdiv", "_prefetch_tile", "_prefetch_rows"}  # fmt: skip
# Loads a kernel may issue before its wait, each of one of these buffers only: the step's
# lengths, which its input copies wrote before its first kernel and no kernel writes (paged
# attention's prologue: pdl.py's rule). `_find_seq` loads its first argument.
SETTLED = {"_paged_attention_kernel": {"cu_q_lens_ptr", "kv_lens_ptr"}}
SETTLED_LOADS = {"tl.load", "_find_seq"}


def _settled_load(kernel: str, call: ast.Call) -> bool:
    """Whether `call` loads (through its first argument) only buffers SETTLED for `kernel`."""
    if ast.unparse(call.func) not in SETTLED_LOADS or not call.args:
        return False
    pointers = {n.id for n in ast.walk(call.args[0]) if isinstance(n, ast.Name)}
    pointers = {p for p in pointers if p.endswith("_ptr")}
    return bool(pointers) and pointers <= SETTLED.get(kernel, set())


@pytest.mark.parametrize("module,name", [(m, n) for m, ns in AWARE.items() for n in ns])
def test_every_aware_kernel_waits_before_it_reads(module, name):
    """The rule that makes PDL safe: `enter(PDL)` before any load, store or early return, in
    every program (a program that returned first would let its grid end before its
    predecessor's, and a kernel after it read unfinished output); the one exception, loads of
    buffers SETTLED before the step's first kernel."""
    definition = _definition(_kernel(module, name))
    last = definition.args.args[-1]
    assert last.arg == "PDL" and ast.unparse(last.annotation) == "tl.constexpr", name
    body = definition.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    enters = [i for i, st in enumerate(body) if ast.unparse(st) == "enter(PDL)"]
    assert len(enters) == 1, name
    bound = {t.id for n in ast.walk(definition) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}  # fmt: skip
    assert not bound & SETTLED.get(name, set()), (name, "a settled pointer is rebound")
    for statement in body[: enters[0]]:
        for node in ast.walk(statement):
            assert not isinstance(node, ast.Return), name
            if isinstance(node, ast.Call) and not _settled_load(name, node):
                called = ast.unparse(node.func)
                assert called in BEFORE_ENTER or called.endswith(".to"), (name, called)


def test_no_other_kernel_takes_the_switch():
    """A kernel (`*_kernel`, the launched functions) with a PDL parameter outside AWARE would go
    unchecked above."""
    import freetoken_agent.kernels.triton as package

    found = set()
    for file in Path(package.__file__).parent.glob("*.py"):
        if file.stem == "pdl":  # `enter` itself
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            launched = isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
            if launched and "PDL" in [a.arg for a in node.args.args]:
                found.add((file.stem, node.name))
    assert found == {(m, n) for m, ns in AWARE.items() for n in ns}


def test_the_switch(monkeypatch):
    monkeypatch.delenv("FREETOKEN_PDL", raising=False)
    assert pdl.requested() == pdl.WAIT | pdl.RELEASE | pdl.LIGHT  # the measured default
    monkeypatch.setenv("FREETOKEN_PDL", "off")
    assert pdl.requested() == 0
    monkeypatch.setenv("FREETOKEN_PDL", "1")
    assert pdl.requested() == pdl.WAIT | pdl.RELEASE
    with pdl.override(False):
        assert pdl.requested() == 0
        with pdl.override(True):
            assert pdl.requested() == pdl.WAIT | pdl.RELEASE
        assert pdl.requested() == 0
    with pytest.raises(RuntimeError), pdl.override(False):
        raise RuntimeError("restored on the way out")
    assert pdl.requested() == pdl.WAIT | pdl.RELEASE
    cases = {"exit": pdl.WAIT, "on,prefetch": pdl.WAIT | pdl.RELEASE | pdl.PREFETCH,
             "light": pdl.WAIT | pdl.RELEASE | pdl.LIGHT,
             "prefetch": pdl.WAIT | pdl.RELEASE | pdl.PREFETCH,
             "exit+prefetch": pdl.WAIT | pdl.PREFETCH, "off": 0, "0": 0}  # fmt: skip
    for word in random.sample(list(cases), len(cases)):
        with pdl.override(word):
            assert pdl.requested() == cases[word], word
    with pytest.raises(ValueError, match="sometimes"):
        pdl.override("on,sometimes").__enter__()
    monkeypatch.setenv("FREETOKEN_PDL", "early")
    with pytest.raises(ValueError, match="early"):
        pdl.requested()
    # Never on a device without it: the CPU (and the interpreter) launch as before.
    with pdl.override("prefetch"):
        assert pdl.launch(torch.device("cpu")) == {"PDL": 0}


def test_launch_arguments(monkeypatch):
    """What a launch passes, on a device that has PDL: the kernel's flags (LIGHT is the
    launcher's, not the kernel's) and launch_pdl; `light` leaves the heavy kernels out."""
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    dev = torch.device("cpu")  # stands for the CUDA device `supported` now says it is
    on = {"PDL": pdl.WAIT | pdl.RELEASE, "launch_pdl": True}
    cases = {
        ("off", False): {"PDL": 0},
        ("on", False): on,
        ("on", True): on,
        ("light", False): on,
        ("light", True): {"PDL": 0},
        ("exit,prefetch", True): {"PDL": pdl.WAIT, "launch_pdl": True},
        ("prefetch", False): on,  # a kernel with nothing to prefetch compiles no variant for it
    }
    for (word, heavy), want in random.sample(list(cases.items()), len(cases)):
        with pdl.override(word):
            assert pdl.launch(dev, heavy=heavy) == want, (word, heavy)
    prefetching = {
        ("exit,prefetch", True): {"PDL": pdl.WAIT | pdl.PREFETCH, "launch_pdl": True},
        ("prefetch", False): {"PDL": pdl.WAIT | pdl.RELEASE | pdl.PREFETCH, "launch_pdl": True},
        ("on", True): on,
        ("light,prefetch", True): {"PDL": 0},
    }
    for (word, heavy), want in random.sample(list(prefetching.items()), len(prefetching)):
        with pdl.override(word):
            assert pdl.launch(dev, heavy=heavy, prefetch=True) == want, (word, heavy)
    # A heavy kernel that leads (it follows a small one): early under `light`, as under `on`;
    # its prefetch only where the word asks for it.
    everything = {"PDL": pdl.WAIT | pdl.RELEASE | pdl.PREFETCH, "launch_pdl": True}
    leading = {"light": on, "on": on, "on,prefetch": everything, "off": {"PDL": 0},
               "exit": {"PDL": pdl.WAIT, "launch_pdl": True}}  # fmt: skip
    for word, want in random.sample(list(leading.items()), len(leading)):
        with pdl.override(word):
            assert pdl.launch(dev, heavy=True, prefetch=True, lead=True) == want, word


def test_only_hopper_and_later_nvidia_gpus_launch_with_pdl(monkeypatch):
    """PDL needs sm_90+ on CUDA: an Ampere or Ada GPU, and a ROCm GPU (which torch.cuda
    reports too, MI300 as capability 9.x), launch without it whatever FREETOKEN_PDL says."""
    monkeypatch.setattr(pdl.tl.extra.cuda, "gdc_wait", lambda: None, raising=False)
    monkeypatch.setattr(pdl.tl.extra.cuda, "gdc_launch_dependents", lambda: None, raising=False)
    cases = [((8, 6), None, False), ((8, 9), None, False), ((9, 0), None, True),
             ((10, 0), None, True), ((9, 4), "6.2", False)]  # fmt: skip
    for capability, hip, want in random.sample(cases, len(cases)):
        pdl._sm90_with_gdc.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, c=capability: c)
        monkeypatch.setattr(torch.version, "hip", hip)
        assert pdl._sm90_with_gdc(0) is want, (capability, hip)
    pdl._sm90_with_gdc.cache_clear()


def _launch_sites() -> dict[str, tuple[bool, str | None]]:
    """Every launch of a PDL-aware kernel in kernels/triton: kernel name -> (whether it says
    heavy=True: a weight-streaming kernel, left out by `light`; what it passes as prefetch)."""
    import freetoken_agent.kernels.triton as package

    sites = {}
    for file in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                spread = [k.value for k in node.keywords if k.arg is None]
                calls = [c for c in spread if isinstance(c, ast.Call)]
                if any(ast.unparse(c.func) == "pdl_launch" for c in calls):
                    said = {k.arg: ast.unparse(k.value) for c in calls for k in c.keywords}
                    name = ast.unparse(node.func.value)
                    assert name not in sites or sites[name][1] is None, name
                    sites[name] = (said.get("heavy") == "True", said.get("prefetch"))
    return sites


def test_every_aware_kernel_launches_with_the_switch_and_the_heavy_ones_say_so():
    sites = _launch_sites()
    assert set(sites) == {n for ns in AWARE.values() for n in ns}
    heavy = {"_decode_gate_up_kernel", "_decode_down_kernel", "_gemv_kernel", "_proj_norm_kernel",
             "_norm_qkv_kernel", "_attention_block_kernel"}  # fmt: skip
    assert {name for name, is_heavy in sites.items() if is_heavy[0]} == heavy
    # PREFETCH goes to the kernels that prefetch before their wait: always for the model's
    # weights, where the caller says the rows are settled for gate/up.
    prefetch = {name: is_heavy[1] for name, is_heavy in sites.items() if is_heavy[1]}
    assert prefetch == {"_gemv_kernel": "True", "_proj_norm_kernel": "True",
                        "_norm_qkv_kernel": "True",
                        "_decode_gate_up_kernel": "rows_settled"}  # fmt: skip


# Compiles the RMSNorm kernel, the skinny matmul, MoE gate/up and paged attention for sm_90
# (no GPU needed) under each PDL flag set, in a process of its own: this one imported the
# kernels under the interpreter.
_COMPILE = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.gemv import _gemv_kernel
from freetoken_agent.kernels.triton.moe_decode import _decode_gate_up_kernel
from freetoken_agent.kernels.triton.norm import _rms_norm_kernel
warps = int(sys.argv[1])
def ptx(fn, consts, types):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps)).asm["ptx"]
norm_types = {n: "*bf16" for n in ("x_ptr", "r_ptr", "w_ptr", "y_ptr", "s_ptr")}
norm_types.update(inv_h="fp32", eps="fp32")
gemv_types = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", out_ptr="*fp32")
out = {}
for flags in (0, 1, 3):
    consts = dict(BLOCK_H=2048, CHUNKED=False, HAS_RES=True, MODE=2, ZERO_CENTRED=False, PDL=flags)
    out[f"norm{flags}"] = ptx(_rms_norm_kernel, consts, norm_types)
for flags in (3, 7):
    consts = dict(M=1, BLOCK_N=64, BLOCK_K=128, PREC="tf32", FINAL=False, HAS_BIAS=False, PDL=flags)
    out[f"gemv{flags}"] = ptx(_gemv_kernel, consts, gemv_types)
up_types = dict(x_ptr="*bf16", w13_ptr="*bf16", ids_ptr="*i64", hi_ptr="*bf16", lo_ptr="*bf16",
                hw13_ptr="*bf16")
consts = dict(K=8, BLOCK_P=16, BLOCK_M=16, BLOCK_I=32, BLOCK_H=128, PREC="tf32", SPLIT=True,
              HOST=True, FILL=False, PARTIAL=False, PDL=7)
out["up7"] = ptx(_decode_gate_up_kernel, consts, up_types)
from freetoken_agent.kernels.triton.paged_attention import _paged_attention_kernel
attn_types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
attn_types.update({n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")})
attn_types.update({n: "*i32" for n in ("count_ptr", "page_table_ptr", "cu_q_lens_ptr",
                                       "kv_lens_ptr")})
attn_types.update(qk_scale="fp32")
consts = dict(GROUP=8, HEADS=8, HEAD_CHUNKS=1, BLOCK_M=16, BLOCK_Q=2, BLOCK_N=64, PAGE=64,
              HEAD_DIM=128, D_PAD=128, DIRECT=False, SPLIT=True, UPCAST=False,
              DOT_PRECISION="tf32", COMBINE=True, SPLITS_PAD=128, CHUNK=4, SHORT_TILES=16, PDL=3)
out["attn3"] = ptx(_paged_attention_kernel, consts, attn_types)
print(json.dumps(out))
"""


def test_sm90_code_keeps_the_order():
    """Compiled: no PDL code when off; the wait, then the release (`on`), before the first
    global load; `exit` releases at no point; `prefetch` asks L2 for the weights before the
    wait, and only then."""
    ptx = compiled_json(_COMPILE, str(random.choice([4, 8])))  # num_warps
    assert "griddepcontrol" not in ptx["norm0"]
    on = ptx["norm3"]
    wait, release = on.index("griddepcontrol.wait"), on.index("griddepcontrol.launch_dependents")
    assert wait < release < on.index("ld.global")
    assert "launch_dependents" not in ptx["norm1"]
    assert ptx["norm1"].index("griddepcontrol.wait") < ptx["norm1"].index("ld.global")
    assert "prefetch" not in ptx["gemv3"]
    fetch = ptx["gemv7"]
    assert fetch.index("prefetch.global.L2 ") < fetch.index("griddepcontrol.wait")
    assert fetch.index("griddepcontrol.wait") < fetch.index("ld.global")
    # gate/up: before its wait one load of its pair's row, past L1, then the prefetches.
    up = ptx["up7"]
    before = up[: up.index("griddepcontrol.wait")]
    assert re.findall(r"ld\.global[.\w]*", before) == ["ld.global.cg.b64"]
    assert before.index("ld.global.cg") < before.index("prefetch.global.L2 ")
    # paged attention: the step's lengths load before its wait (its prologue), and no store,
    # atomic or return comes before it; the release right after it.
    attn = ptx["attn3"]
    wait = attn.index("griddepcontrol.wait")
    before = attn[:wait]
    loads = re.findall(r"ld\.global[.\w]*", before)
    assert len(loads) >= 2 and set(loads) == {"ld.global.b32"}  # scalar lengths, no q or K/V
    assert not re.findall(r"st\.global|atom\.|red\.|ret;", before)
    # An early return compiles to a branch past the wait: every branch before it stays there.
    labels = set(re.findall(r"^(\$L__\w+):", before, re.M))
    assert set(re.findall(r"bra(?:\.uni)?\s+(\$L__\w+);", before)) <= labels
    assert wait < attn.index("griddepcontrol.launch_dependents")
