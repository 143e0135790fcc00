"""Programmatic dependent launch (kernels/triton/pdl.py): every PDL-aware kernel waits for the
kernel before it first, the switch, and the wait's place in compiled sm_90 code. The GPU tests
(tests/engine/test_pdl_gpu.py) check that PDL changes no bit of an engine's results."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

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
    "paged_attention": ["_paged_attention_kernel"],
    "expert_fills": ["_plan_kernel", "_copy_kernel"],
}


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"freetoken_agent.kernels.triton.{module}"), name)


def _definition(fn) -> ast.FunctionDef:
    """The kernel's def (its Python function: compiled or interpreted Triton alike)."""
    return ast.parse(textwrap.dedent(inspect.getsource(fn.fn))).body[0]


@pytest.mark.parametrize("module,name", [(m, n) for m, ns in AWARE.items() for n in ns])
def test_every_aware_kernel_waits_first(module, name):
    """The rule that makes PDL safe: `enter(PDL)` before any load, store or early return, in
    every program (a program that returned first would let its grid end before its
    predecessor's, and a kernel after it read unfinished output)."""
    definition = _definition(_kernel(module, name))
    last = definition.args.args[-1]
    assert last.arg == "PDL" and ast.unparse(last.annotation) == "tl.constexpr", name
    body = definition.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0]
    assert isinstance(first, ast.Expr) and ast.unparse(first.value) == "enter(PDL)", name


def test_no_other_kernel_takes_the_switch():
    """A kernel with a PDL parameter outside AWARE would go unchecked above."""
    import freetoken_agent.kernels.triton as package

    found = set()
    for file in Path(package.__file__).parent.glob("*.py"):
        if file.stem == "pdl":  # `enter` itself
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.FunctionDef) and "PDL" in [a.arg for a in node.args.args]:
                found.add((file.stem, node.name))
    assert found == {(m, n) for m, ns in AWARE.items() for n in ns}


def test_the_switch(monkeypatch):
    monkeypatch.delenv("FREETOKEN_PDL", raising=False)
    assert not pdl.requested()
    monkeypatch.setenv("FREETOKEN_PDL", "1")
    assert pdl.requested()
    with pdl.override(False):
        assert not pdl.requested()
        with pdl.override(True):
            assert pdl.requested()
        assert not pdl.requested()
    with pytest.raises(RuntimeError), pdl.override(False):
        raise RuntimeError("restored on the way out")
    assert pdl.requested()
    # Never on a device without it: the CPU (and the interpreter) launch as before.
    with pdl.override(True):
        assert pdl.launch(torch.device("cpu")) == {"PDL": False}


# Compiles the RMSNorm kernel for sm_90 (no GPU needed) with PDL on and off, in a process of its
# own: this one imported the kernels under the interpreter (TRITON_INTERPRET=1).
_COMPILE = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken_agent.kernels.triton.norm import _rms_norm_kernel as fn
out = {}
for on in (True, False):
    consts = dict(BLOCK_H=2048, CHUNKED=False, HAS_RES=True, MODE=2, ZERO_CENTRED=False, PDL=on)
    sig = {n: "constexpr" if n in consts else "*bf16" if n.endswith("_ptr") else
           "fp32" if n in ("inv_h", "eps") else "i32" for n in fn.arg_names}
    k = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=int(sys.argv[1])))
    out[str(on)] = k.asm["ptx"]
print(json.dumps(out))
"""


def test_sm90_code_waits_before_its_first_load():
    """Compiled, the wait comes before the kernel's first global load, then the release."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    warps = str(random.choice([4, 8]))
    done = subprocess.run([sys.executable, "-c", _COMPILE, warps], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ptx = json.loads(done.stdout.strip().splitlines()[-1])
    on, off = ptx["True"], ptx["False"]
    assert "griddepcontrol" not in off
    wait, release = on.index("griddepcontrol.wait"), on.index("griddepcontrol.launch_dependents")
    assert wait < release < on.index("ld.global")
